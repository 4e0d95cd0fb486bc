# Included by _core.pyx: the stream events the allocator waits for, one queue
# per stream in the order they were recorded (PyTorch's cuda_events), as
# native data (_native/stream_events.hpp): no Python object lives in them
# but the events themselves, whose references the entries own.
#
# Work on one stream completes in the order it was queued, so an event whose
# work is not done means no later event of its stream is done either: each
# stream's oldest event is asked about, and the next one only once it is
# done. An allocation made while streams run behind then asks the backend
# once per stream, not once per pending event (each a Python call: with 100
# events pending on one stream, python -m benchmarks compare's "core pair,
# 100 events pending"). A backend whose events complete out of order on one
# stream only has blocks come back later, never too early.
#
# The backend is asked with the lock let go: under the lock the events to
# ask about are copied out and marked taken (no other thread asks about a
# taken one: the answer "done" destroys a CUDA event); outside it they are
# asked about; under the lock again the answers are committed, by each
# entry's number (an entry may have gone meanwhile: its held pages taken
# back, its queue waited for by empty_cache). A reference an entry let go
# of is dropped after the lock is (_drop_released_events), since dropping
# the last one may run Python. A child forked while another thread asked
# finds its entries untaken, asked about again.


cdef int _add_pending(CachingAllocator self, object event, Block* b, uintptr_t stream) except -1:
    """Queue ``event`` last on ``stream``, ``b`` waiting for it (its
    reference is the queue's now). Lock held; makes no Python object."""
    if um_events_add(self.stream_events, <PyObject*>event, <void*>b, stream) != 0:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    Py_INCREF(event)
    _count_pending(self)
    return 0


cdef inline void _count_pending(CachingAllocator self) noexcept nogil:
    self.n_pending_events = self.stream_events.count
    self._update_unusual()


cdef int _take_asks(CachingAllocator self, vector[um_event_ask]& asks, bint every,
                    bint held_only, vector[uintptr_t]* skip) noexcept nogil:
    """Copy out and mark taken the events to ask about: each stream's oldest
    one not taken (``every``: all of them; ``held_only``: only those of pages
    held to unmap), none of the streams in ``skip`` (may be NULL). An entry already known done whose block could not be
    handled before (no host memory then) is handled here. Lock held."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef um_pending_event* e
    cdef size_t i
    cdef uintptr_t stream
    while it != self.stream_events.queues.end():
        stream = deref(it).first
        if skip != NULL and _holds_address(deref(skip), stream):
            inc(it)
            continue
        i = 0
        while i < deref(it).second.size():
            e = &deref(it).second[i]
            i += 1
            if e.taken:
                continue
            if e.event == NULL:
                continue                        # done; its block waits for host memory (_commit)
            if held_only and not _is_held(<uintptr_t>e.block):
                continue
            if um_push_ask(asks, e.event, stream, e.seq) != 0:
                return -1
            e.taken = True
            if not every:
                break
        inc(it)
    return 0


cdef inline bint _holds_address(vector[uintptr_t]& v, uintptr_t p) noexcept nogil:
    cdef size_t i
    for i in range(v.size()):
        if v[i] == p:
            return True
    return False


cdef int _commit_answers(CachingAllocator self, vector[um_event_ask]& asks, size_t n_done,
                         vector[uintptr_t]& released, vector[uintptr_t]* freed) noexcept nogil:
    """Under the lock again: asks[:n_done] were found done (their events
    destroyed by that answer), the rest are asked about again another time.
    Each entry done is handled (_handle_done) and leaves its queue; held
    pages whose wait is over go to ``released`` (unmapped by the caller);
    blocks freed to ``freed`` (with the cache off, else NULL). Returns how
    many were done and still in their queues."""
    cdef size_t k
    cdef long i
    cdef um_pending_event* e
    cdef cmap[uintptr_t, um_event_queue].iterator it
    cdef int handled = 0
    for k in range(asks.size()):
        it = self.stream_events.queues.find(asks[k].stream)
        if it == self.stream_events.queues.end():
            continue
        i = um_events_index(deref(it).second, asks[k].seq)
        if i < 0:
            continue
        e = &deref(it).second[i]
        e.taken = False
        if k >= n_done:
            continue
        _let_go_of_event(self, e)
        handled += 1
        if _handle_done(self, e, released, freed) == 0:
            um_events_erase(self.stream_events, deref(it).second, i)
            um_events_drop_if_empty(self.stream_events, asks[k].stream)
        else:
            self.stream_events.known_done += 1  # no host memory: _handle_known_done
    _count_pending(self)
    return handled


cdef inline void _let_go_of_event(CachingAllocator self, um_pending_event* e) noexcept nogil:
    """The backend said ``e``'s event is done (and destroyed it): its
    reference goes to be dropped, the entry keeps no event."""
    if e.event != NULL:
        _push_reference(self, e.event)
        e.event = NULL


cdef extern from *:
    """
    #include <vector>
    static inline void um_push_reference(std::vector<PyObject*>& v, PyObject* o) {
        try { v.push_back(o); } catch (...) {}   // no memory: a leak of one small object
    }
    """
    void um_push_reference(vector[PyObject*]& v, PyObject* o) nogil


cdef inline void _push_reference(CachingAllocator self, PyObject* o) noexcept nogil:
    um_push_reference(self.stream_events.to_release, o)


cdef int _handle_done(CachingAllocator self, um_pending_event* e, vector[uintptr_t]& released,
                      vector[uintptr_t]* freed) noexcept nogil:
    """The block of an entry whose event is done: one event less to wait
    for, freed at the last; held pages go to ``released`` (unmapped by the
    caller, _core_holes.pxi). A block freed goes to ``freed`` (with the
    cache off, else NULL): the caller gives its segment back, as every free
    does then (_give_back_segments_of). 1: not handled, for want of host
    memory for the free index (the entry stays, handled next time)."""
    cdef Block* b = <Block*>e.block
    if b == NULL:                       # held pages taken back (_take_back_held)
        return 0
    if b.releasing:
        if _push_address(released, <uintptr_t>b) != 0:
            return 1
        e.block = NULL
        return 0
    if b.event_count == 1 and self._reserve_class(b) != 0:
        return 1
    if b.event_count == 1 and freed != NULL:
        if _push_address(freed[0], b.ptr) != 0:
            return 1
    e.block = NULL
    b.event_count -= 1
    if b.event_count == 0:
        self._free_block(b)
    return 0


cdef int _handle_known_done(CachingAllocator self, vector[uintptr_t]& released,
                            vector[uintptr_t]* freed) noexcept nogil:
    """Entries found done earlier whose block could not be handled then (no
    host memory): handled now, where possible. Lock held."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef cmap[uintptr_t, um_event_queue].iterator here
    cdef size_t i
    cdef size_t left = 0
    cdef um_pending_event* e
    if self.stream_events.known_done == 0:
        return 0                        # the common case: no scan of every entry
    while it != self.stream_events.queues.end():
        here = it
        inc(it)
        i = 0
        while i < deref(here).second.size():
            e = &deref(here).second[i]
            if e.event == NULL and not e.taken and _handle_done(self, e, released, freed) == 0:
                um_events_erase(self.stream_events, deref(here).second, i)
            else:
                left += e.event == NULL
                i += 1
        if deref(here).second.empty():
            self.stream_events.queues.erase(here)
    self.stream_events.known_done = left
    _count_pending(self)
    return 0


cdef int _drop_released_events(CachingAllocator self) except -1:
    """Drop the references entries let go of: after the lock is let go
    (the last one may run Python), here with it taken for the swap only."""
    cdef vector[PyObject*] refs
    cdef size_t i
    if self.stream_events.to_release.empty():
        return 0
    self._lock()
    refs.swap(self.stream_events.to_release)
    self._unlock()
    for i in range(refs.size()):
        Py_DECREF(<object>refs[i])
    return 0


cdef int _forget_every_event(CachingAllocator self) noexcept:
    """__dealloc__: every reference the queues hold goes (no lock: nobody
    else can reach a dying allocator)."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef size_t i
    while it != self.stream_events.queues.end():
        for i in range(deref(it).second.size()):
            if deref(it).second[i].event != NULL:
                Py_XDECREF(deref(it).second[i].event)
        inc(it)
    self.stream_events.queues.clear()
    for i in range(self.stream_events.to_release.size()):
        Py_XDECREF(self.stream_events.to_release[i])
    self.stream_events.to_release.clear()
    self.stream_events.count = 0
    return 0


cdef list _pending_blocks(CachingAllocator self):
    """The address of every block an entry waits for (0: none), and of those
    whose events are being recorded: for _check_invariants."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef size_t i
    waiting = []
    while it != self.stream_events.queues.end():
        for i in range(deref(it).second.size()):
            waiting.append(<uintptr_t>deref(it).second[i].block)
        inc(it)
    return waiting


cdef int _untake_after_fork(CachingAllocator self) noexcept nogil:
    """In a forked child: the threads asking about events are gone, their
    entries are asked about again; blocks whose events another thread was
    recording are freed (that free was under way; nobody else can)."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef size_t i
    cdef Block* b
    while it != self.stream_events.queues.end():
        for i in range(deref(it).second.size()):
            deref(it).second[i].taken = False
        inc(it)
    for i in range(self.stream_events.recording.size()):
        b = <Block*>self.stream_events.recording[i]
        _finish_free_without_events(self, b)
    self.stream_events.recording.clear()
    return 0


cdef void _prune_empty_queues(CachingAllocator self) noexcept nogil:
    """Drop the queues left empty, and count again. Lock held."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef cmap[uintptr_t, um_event_queue].iterator here
    while it != self.stream_events.queues.end():
        here = it
        inc(it)
        if deref(here).second.empty():
            self.stream_events.queues.erase(here)
    _count_pending(self)
