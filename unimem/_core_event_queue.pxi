# Included by _core.pyx: the stream events the allocator waits for, one queue
# per stream in the order they were recorded (PyTorch's cuda_events).
#
# Work on one stream completes in the order it was queued, so an event whose
# work is not done means no later event of its stream is done either:
# _process_events asks about each queue's oldest events only, until the first
# that is not done. An allocation made while streams run behind then asks the
# backend once per stream, not once per pending event (each a Python call:
# with 100 events pending on one stream, the core's Python pair took 6.95 us
# before and 284 ns after, python -m benchmarks compare's "core pair, 100
# events pending"). A backend whose events complete out of order on one
# stream only has blocks come back later, never too early.
#
# The queues are Python lists, and making any Python object may run a
# garbage collection whose finalizers re-enter the allocator (free a block
# used on another stream, allocate, process events). So while the queues
# are asked about or rearranged (``processing_events``), a call re-entered
# changes none of them: its events wait in ``pending_arrivals`` and are
# queued once the outer call is done (_queue_arrivals), and a nested
# _process_events returns at once. Only _take_back_held may run nested: it
# writes an entry's address to 0, which every reader checks.


cdef class _PendingEvent:
    """An event recorded on ``stream`` and the block waiting for it
    (``address``: a Block*, 0 when held pages were taken back meanwhile,
    _take_back_held). ``event`` is None once the backend said it is done:
    a done CUDA event is destroyed by that answer and never asked about again."""
    cdef object event
    cdef uintptr_t address
    cdef uintptr_t stream

    def __cinit__(self, event, uintptr_t address, uintptr_t stream):
        self.event = event
        self.address = address
        self.stream = stream


cdef int _add_pending(CachingAllocator self, object event, uintptr_t address, uintptr_t stream) except -1:
    """Queue ``event`` last on its stream (in ``pending_arrivals`` while the
    queues are busy)."""
    entry = _PendingEvent(event, address, stream)
    self.pending_arrivals.append(entry)
    self.n_pending_events += 1
    self._update_unusual()
    if not self.processing_events:
        self.processing_events = True
        try:
            _queue_arrivals(self)
        finally:
            self.processing_events = False
    return 0


cdef int _queue_arrivals(CachingAllocator self) except -1:
    """Move ``pending_arrivals`` to the end of their streams' queues
    (``processing_events`` set: what arrives meanwhile waits there too, and
    is moved by the next turn of the loop)."""
    cdef _PendingEvent entry
    cdef bint new_stream = False
    while self.pending_arrivals:
        fresh = []
        arrivals, self.pending_arrivals = self.pending_arrivals, fresh
        for entry in arrivals:
            queue = self.pending_events.get(entry.stream)
            if queue is None:
                self.pending_events[entry.stream] = [entry]
                new_stream = True
            else:
                queue.append(entry)
        if new_stream:
            _list_queues(self)
            new_stream = False
    return 0


cdef list _pending_list(CachingAllocator self):
    """Every pending event, each stream's in order."""
    every = []
    for queue in self.pending_events.values():
        every.extend(queue)
    every.extend(self.pending_arrivals)
    return every


cdef list _take_pending(CachingAllocator self, bint held_only):
    """Take every pending event out of the queues (``held_only``: those of
    pages held to unmap) and return them, each stream's in order. Not for a
    call re-entered while the queues are busy (see the top of this file)."""
    cdef _PendingEvent entry
    taken = []
    self.processing_events = True
    try:
        for stream, queue in list(self.pending_events.items()):
            kept = []
            for entry in queue:
                if held_only and not _is_held(entry.address):
                    kept.append(entry)
                else:
                    taken.append(entry)
            if kept:
                self.pending_events[stream] = kept
            else:
                del self.pending_events[stream]
        _list_queues(self)
        _queue_arrivals(self)
    finally:
        self.processing_events = False
    _count_pending(self)
    return taken


cdef int _put_back_pending(CachingAllocator self, list entries) except -1:
    """Queue ``entries`` (taken, each stream's in order) before what their
    streams recorded since: they are older."""
    cdef _PendingEvent entry
    if not entries:
        return 0
    self.processing_events = True
    try:
        by_stream = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        for stream, older in by_stream.items():
            queue = self.pending_events.get(stream)
            if queue is not None:
                older.extend(queue)         # no new object between reading and replacing it
            self.pending_events[stream] = older
        _list_queues(self)
        _queue_arrivals(self)
    finally:
        self.processing_events = False
    _count_pending(self)
    return 0


cdef int _list_queues(CachingAllocator self) except -1:
    """A new list of the queues, after streams came or went: _query_pending
    walks the list it found, which a call re-entered from a query may
    replace but never changes (a dict would raise if a stream came then)."""
    self.pending_queues = list(self.pending_events.values())
    return 0


cdef int _count_pending(CachingAllocator self) except -1:
    cdef size_t n = len(self.pending_arrivals)
    for queue in self.pending_events.values():
        n += len(queue)
    self.n_pending_events = n
    self._update_unusual()
    return 0


cdef int _query_pending(CachingAllocator self, list done) except -1:
    """Ask the backend about each stream's oldest events, until the first
    that is not done, and append those done to ``done`` (their ``event``
    set to None), still queued. Blocks are not touched: a query is Python
    code, during which another thread may fork (the child must find no
    event handled but still pending), and a call re-entered from it may
    queue more events (in ``pending_arrivals``, asked about next time) or
    take held pages back (read once the queries are over). When a query
    raises, ``done`` holds what was found done before it."""
    cdef _PendingEvent entry
    query = self.backend.event_done
    for queue in self.pending_queues:
        for entry in queue:
            if entry.event is not None:
                if not query(entry.event):
                    break
                entry.event = None
            done.append(entry)
    return 0


cdef int _dequeue(CachingAllocator self, list done, set kept) except -1:
    """Take ``done`` (entries _query_pending found done: each stream's
    oldest, in order), but for ``kept``, out of their queues (queues busy)."""
    cdef _PendingEvent entry
    cdef Py_ssize_t i, n
    cdef bint dropped = False
    by_stream = {}
    for entry in done:
        if entry not in kept:
            by_stream.setdefault(entry.stream, []).append(entry)
    for stream, finished in by_stream.items():
        queue = self.pending_events.get(stream)
        if queue is None:
            continue
        n = len(finished)
        i = 0
        while i < n and i < len(queue) and queue[i] is finished[i]:
            i += 1
        if i == n:
            del queue[:n]
        else:                   # not the oldest ones (a kept entry before them)
            gone = set(finished)
            queue[:] = [entry for entry in queue if entry not in gone]
        if not queue:
            del self.pending_events[stream]
            dropped = True
    if dropped:
        _list_queues(self)
    _count_pending(self)
    return 0
