# Included by _core.pyx: stream-ordered reuse. A block used on other streams
# (record_stream) is freed with one event per stream and goes back to the
# free index only when they all completed; empty_cache and the last retry
# before out-of-memory wait for them, outside the lock.

cdef extern from *:
    """
    #include <vector>
    static inline int um_push_address(std::vector<uintptr_t>& v, uintptr_t p) {
        try { v.push_back(p); return 0; } catch (...) { return -1; }
    }
    """
    # -1 when host memory ran out (nothing changed then)
    int _push_address "um_push_address"(vector[uintptr_t]& v, uintptr_t p) nogil


cdef extern from *:
    """
    #include <new>
    static inline std::vector<uintptr_t>* um_new_stream_uses() {
        return new (std::nothrow) std::vector<uintptr_t>();
    }
    """
    # NULL when host memory ran out
    vector[uintptr_t]* _new_stream_uses "um_new_stream_uses"() nogil


cdef int _defer_free(CachingAllocator self, uintptr_t ptr) noexcept nogil:
    """Keep the free of ``ptr`` (its low bit set for an Allocation's block:
    blocks are aligned to 512 bytes), a live block used on other streams (with
    the cache off, any: _keep_uncached_free), for a call from Python's side
    (_free_deferred); 0 when kept. Its deleter runs
    on a runtime's thread (a SYCL host task dropping the last reference to
    an array when its kernels are done), where recording an event submits
    work to a queue: a barrier submitted there waits for the SYCL scheduler
    while holding the GIL, and a thread submitting kernels (which holds the
    scheduler) waits for the GIL, a deadlock. PyTorch records its events at
    the free, on any thread; CUDA allows that, SYCL does not from a host
    task. The block stays live (allocated) until then. Lock held."""
    if _push_address(self.deferred_frees, ptr) != 0:
        return -1
    self.unusual = True
    return 0


cdef int _keep_uncached_free(CachingAllocator self, uintptr_t ptr) noexcept nogil:
    """c_free_detached on a runtime's thread with the cache off: the free of
    ``ptr`` would give its segment back, and the backend's free may wait
    for the segment's queue (the XPU backend waits, as PyTorch's does before
    sycl::free): on a SYCL host task's thread that is a wait for the queue
    the host task belongs to, and a wait behind any other thread waiting
    for that queue (seen: the main thread freeing an array, waiting inside
    DPCTLQueue_Wait for this host task, which waited for the same turn). So
    the free is kept as one needing events is (_defer_free), and done, its
    segment given back, by the next call from Python's side (_free_deferred),
    where waiting is allowed. _free_fast's codes: 0 kept, or (no host memory
    to keep it) freed now, its segment cached until empty_cache or
    set_caching; 1 unknown; 2 or 3 needs Python; 4 an Allocation's. Lock held."""
    cdef Block* b = <Block*>um_find(&self.active, ptr)
    if b == NULL:
        return 1
    if b.by_handle:
        return 4
    if _defer_free(self, ptr) == 0:
        return 0
    return self._free_fast(ptr, False)


cdef int _free_deferred(CachingAllocator self) except -1:
    """Free the blocks _defer_free kept, recording their events now. Called
    from Python's side (the next allocation that is not a re-entered one,
    process_events, empty_cache, synchronize), not with this thread holding
    the lock: recording runs Python. A block whose event cannot be recorded
    is live again and stays kept for the next call (reported as
    unraisable); a Ctrl-C there keeps it and the rest, and reaches the
    caller. What runs after the frees (the history hook, a cache that is
    off giving segments back) runs once they are all done: a block freed
    is never kept again (another thread may have it by then)."""
    cdef vector[uintptr_t] kept
    cdef size_t i = 0
    cdef uintptr_t ptr
    cdef int rc
    cdef bint freed
    if self.lock.held_here():
        return 0
    self._lock()
    kept.swap(self.deferred_frees)
    self._update_unusual()
    self._unlock()
    try:
        while i < kept.size():
            ptr = kept[i] & ~<uintptr_t>1       # the low bit: an Allocation's block
            freed = False
            self._lock_hot()
            rc = self._free_fast(ptr, kept[i] & 1)
            try:
                if rc == 2 or rc == 3:
                    self._free_slow(ptr, rc)       # lets the lock go
                else:
                    self._unlock()
                freed = True
            except Exception as exc:
                _report_unraisable(exc, "unimem: freeing a block a runtime's thread let go of")
            if not freed:
                _keep_for_later(self, kept, i, i + 1)
            elif self.cache_off and rc != 1:
                _give_back_segment_at(self, ptr)
            i += 1
    except BaseException:
        _keep_for_later(self, kept, i if not freed else i + 1, kept.size())
        raise
    self._after_free()
    return 0


cdef inline int _drain_inbox(CachingAllocator self) except -1:
    """The end of an operation from Python's side: the frees that went to
    the inbox meanwhile (a finalizer run by a backend call made with the
    lock held, a runtime's thread) are done before it returns."""
    if not self.deferred_frees.empty():
        _free_deferred(self)
    return 0


cdef int _keep_for_later(CachingAllocator self, vector[uintptr_t]& kept, size_t start, size_t stop) except -1:
    """Put back kept[start:stop] for the next _free_deferred."""
    self._lock()
    while start < stop:
        _push_address(self.deferred_frees, kept[start])
        start += 1
    self._update_unusual()
    self._unlock()
    return 0


cdef int _free_with_events(CachingAllocator self, uintptr_t ptr) except -1:
    """Free a block used on other streams: record an event on each, and
    keep the block out of the pool until all of them have completed. Lock
    held on entry and exit, let go while the backend records.

    The block leaves the address index first: a second free of the same
    address meanwhile (another thread, a finalizer run by the backend's
    Python) finds nothing. It waits in stream_events.recording, allocated,
    until the events are queued; if one cannot be recorded, the events
    recorded so far are given back and the block is live again, as before
    the call. Re-entered with the lock held by an outer call of this thread
    (a finalizer run by a backend call still made under the lock), the
    lock cannot be let go: the free goes to the inbox (_defer_free), done by
    the next call from Python's side."""
    cdef Block* b
    cdef vector[uintptr_t] streams
    cdef size_t i
    b = <Block*>um_find(&self.active, ptr)
    if self.lock_depth != 1:
        if _defer_free(self, ptr | <uintptr_t>b.by_handle) != 0:
            raise MemoryError("host memory for the allocator's bookkeeping ran out")
        return 0
    if _copy_addresses(streams, b.stream_uses[0]) != 0 or um_push_block(self.stream_events.recording, b) != 0:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    um_pop(&self.active, ptr)
    self._unlock()
    events = []
    error = None
    try:
        record = self.backend.record_event
        for i in range(streams.size()):
            events.append(record(streams[i], self.device))
    except BaseException as exc:
        error = exc
    self._lock()
    _stop_recording(self, b)
    if error is not None:
        um_put(&self.active, ptr, b)      # count went down by one: no growth, cannot fail
        self._unlock()
        try:
            _release_events(self, events)
        finally:
            self._lock()
        raise error
    self._account_free_request(b)
    b.event_count = len(events)
    for i in range(len(events)):
        _add_pending(self, events[i], b, streams[i])
    _forget_stream_uses(self, b)
    if b.event_count == 0:
        self._free_block(b)
    return 0


cdef extern from *:
    """
    #include <vector>
    static inline int um_copy_addresses(std::vector<uintptr_t>& to, const std::vector<uintptr_t>& from) {
        try { to = from; return 0; } catch (...) { return -1; }
    }
    """
    int _copy_addresses "um_copy_addresses"(vector[uintptr_t]& to, vector[uintptr_t]& src) nogil


cdef void _stop_recording(CachingAllocator self, Block* b) noexcept nogil:
    """``b``'s events are recorded (or failed to be): off the list a forked
    child would finish. Lock held."""
    cdef size_t i
    for i in range(self.stream_events.recording.size()):
        if self.stream_events.recording[i] == <void*>b:
            self.stream_events.recording.erase(self.stream_events.recording.begin() + i)
            return


cdef void _finish_free_without_events(CachingAllocator self, Block* b) noexcept nogil:
    """A forked child's end of a free another thread was recording events
    for: freed at once (the child's device work is its own)."""
    self._account_free_request(b)
    _forget_stream_uses(self, b)
    b.event_count = 0
    self._free_block(b)


cdef void _forget_stream_uses(CachingAllocator self, Block* b) noexcept nogil:
    """The block's events are recorded: its streams need it no more."""
    cdef StreamPools* sp
    cdef StreamTable.iterator it
    for s in b.stream_uses[0]:
        it = self.streams.find(s)
        if it != self.streams.end():
            sp = deref(it).second
            sp.n_stream_uses -= 1
            self._drop_stream_if_unused(sp)
    del b.stream_uses
    b.stream_uses = NULL


cdef int _release_events(CachingAllocator self, list events) except -1:
    """Give back events that will not be waited for (optional for a backend)."""
    release = getattr(self.backend, "release_event", None)
    if release is not None:
        _tell_each(release, [(ev,) for ev in events], "unimem: giving back a stream event")
    return 0


cdef int _process_events_and_deferred(CachingAllocator self) except -1:
    """CachingAllocator.process_events (called by c_malloc without the
    method lookup while events are pending)."""
    if not self.deferred_frees.empty():
        _free_deferred(self)
    self._lock()
    try:
        if self.n_pending_events:
            _process_events(self)
    finally:
        self._unlock()
    self._flush_trace()
    return 0


cdef int _process_events(CachingAllocator self) except -1:
    """Blocks whose recorded stream work has finished go back to the pool.
    Lock held on entry and exit, let go while the backend is asked: each
    stream's oldest event is copied out (_take_asks), asked about, and the
    answers committed (_commit_answers); while one was done, the next ones
    are asked about. Re-entered with the lock held by an outer call of this
    thread, nothing is asked (the outer call's next pass does it)."""
    cdef vector[um_event_ask] asks
    cdef vector[uintptr_t] released
    cdef vector[uintptr_t] freed
    cdef vector[uintptr_t] waiting      # streams whose oldest event is not done: not asked again
    cdef size_t n_done, k
    cdef bint more = True
    if self.lock_depth != 1 or not self.n_pending_events:
        return 0
    _handle_known_done(self, released, &freed if self.cache_off else NULL)
    asks.swap(self.stream_events.spare_asks)   # its room: no heap allocation per call
    error = None
    while more and error is None:
        asks.clear()
        if _take_asks(self, asks, False, False, &waiting) != 0:
            _commit_answers(self, asks, 0, released, NULL)
            raise MemoryError("host memory for the allocator's bookkeeping ran out")
        if asks.empty():
            break
        self._unlock()
        n_done = 0
        try:
            query = self.backend.event_done
            while n_done < asks.size() and query(<object>asks[n_done].event):
                n_done += 1
            # the streams after the first not done are others: asked too
            if n_done + 1 < asks.size():
                n_done = _answers_in_order(self, asks, n_done, query)
        except BaseException as exc:
            error = exc                 # the events not asked about stay pending
        self._lock()
        # while a stream's oldest was done, its next one is asked about;
        # the streams not done are not asked again in this call
        more = _commit_answers(self, asks, n_done, released, &freed if self.cache_off else NULL) > 0
        if more:
            for k in range(n_done, asks.size()):
                _push_address(waiting, asks[k].stream)     # no memory: asked again, no harm
    if self.stream_events.spare_asks.capacity() < asks.capacity():
        asks.swap(self.stream_events.spare_asks)
    if not (self.stream_events.to_release.empty() and released.empty() and freed.empty()):
        _after_events_handled(self, released, freed)
    if error is not None:
        raise error
    return 0


cdef size_t _answers_in_order(CachingAllocator self, vector[um_event_ask]& asks, size_t n_done,
                              object query) except? 0:
    """asks[n_done] (one stream's oldest) is not done: ask about the other
    streams' after it, moving those done before the not-done ones, so that
    asks[:result] are all done. Lock let go."""
    cdef size_t k
    cdef um_event_ask keep
    cdef size_t first_not_done = n_done
    for k in range(n_done + 1, asks.size()):
        if query(<object>asks[k].event):
            keep = asks[k]
            asks[k] = asks[first_not_done]
            asks[first_not_done] = keep
            first_not_done += 1
    return first_not_done


cdef int _after_events_handled(CachingAllocator self, vector[uintptr_t]& released,
                               vector[uintptr_t]& freed, bint every_free_segment=False) except -1:
    """What waits for the lock to be let go once events were handled: the
    references dropped, held pages unmapped, with the cache off the freed
    blocks' segments given back (``every_free_segment``: every wholly free
    one). Lock held on entry and exit."""
    if self.stream_events.to_release.empty() and released.empty() and freed.empty():
        return 0
    cdef vector[PyObject*] refs
    refs.swap(self.stream_events.to_release)
    try:
        if not refs.empty():
            self._unlock()
            try:
                for i in range(refs.size()):
                    Py_DECREF(<object>refs[i])
            finally:
                self._lock()
        if not released.empty():
            _unmap_released(self, released)
    finally:
        if not freed.empty() and every_free_segment:
            _release_every_free_segment(self)
        elif not freed.empty():
            _give_back_segments_of(self, freed)
    return 0


cdef int _synchronize_and_free_events(CachingAllocator self, bint held_only=False) except -1:
    """Wait for every recorded stream event, then free their blocks
    (PyTorch's synchronize_and_free_events; counted in num_sync_all_streams).
    ``held_only``: only the events of pages held to unmap (_core_holes.pxi),
    not counted: a map refused while they still count against the device.

    Lock held on entry and exit, but not while waiting: a wait on a SYCL
    queue may need a host task that frees a pool block, and so this lock.
    Events another thread is asking about meanwhile are that thread's to
    commit. Re-entered with the lock held by an outer call of this thread,
    nothing is waited for."""
    cdef vector[um_event_ask] asks
    cdef vector[uintptr_t] released
    cdef vector[uintptr_t] freed
    cdef size_t n_done = 0
    if not held_only:
        self.stats.num_sync_all_streams += 1
    if not self.n_pending_events or self.lock_depth != 1:
        return 0
    _handle_known_done(self, released, &freed if self.cache_off else NULL)
    if _take_asks(self, asks, True, held_only, NULL) != 0:
        _commit_answers(self, asks, 0, released, NULL)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    error = None
    if not asks.empty():
        self._unlock()
        try:
            sync = self.backend.event_synchronize
            while n_done < asks.size():
                sync(<object>asks[n_done].event)
                n_done += 1
        except BaseException as exc:
            error = exc                 # the rest are waited for next time
        self._lock()
        _commit_answers(self, asks, n_done, released, &freed if self.cache_off else NULL)
    # With the cache off, every wholly free segment goes back once the
    # events were waited for, these blocks' among them: a free that fails
    # raises after all were tried, as the release that follows here (an
    # allocation's last retry, empty_cache) would have done.
    _after_events_handled(self, released, freed, True)
    if error is not None:
        raise error
    return 0


cdef int _release_abandoned_streams(CachingAllocator self, uintptr_t serving) except -1:
    """After a new stream's first miss: give back the cached memory of the
    streams (wholly free ones) the backend says were abandoned (``abandoned_streams(streams,
    device)``, optional: a SYCL queue made for one task, that nothing but
    unimem's tables holds any more and whose work is done). Nobody can
    allocate on such a stream again, so its free segments would stay
    reserved until ``empty_cache`` or out-of-memory: with a queue per task
    that is a segment a task, and on the SYCL CPU device that is host RAM.

    PyTorch and CuPy keep a dead stream's cache until then; the check runs
    once per new stream, not per allocation. A backend error is reported as
    unraisable (the caller's allocation succeeded); a Ctrl-C is raised."""
    self.stream_notices.added = False
    abandoned_streams = getattr(self.backend, "abandoned_streams", None)
    if abandoned_streams is None:
        return 0
    cdef vector[uintptr_t] held
    cdef StreamTable.iterator it
    cdef StreamPools* sp
    cdef Segment* seg
    cdef cmap[uintptr_t, bint] busy      # streams with a segment that is not wholly free
    self._lock()
    try:
        # Only streams whose every segment can go back now: the backend may
        # stop waiting on what it names (the XPU backend's frees skip the
        # queue wait), so a stream it names must leave the allocator whole
        # (and its queue with it), never keep a segment in use.
        seg = self.segments
        while seg != NULL:
            if seg.pool == NULL and not _segment_is_free(self, seg):
                busy[seg.stream] = True
            seg = seg.next_seg
        it = self.streams.begin()
        while it != self.streams.end():
            sp = deref(it).second
            if (sp.stream != 0 and sp.stream != serving and sp.n_segments != 0 and sp.n_stream_uses == 0
                    and sp.n_private_segments == 0 and busy.find(sp.stream) == busy.end()):
                held.push_back(sp.stream)
            inc(it)
    finally:
        self._unlock()
    if held.empty():
        return 0
    try:
        candidates = list(held)
        named = set(abandoned_streams(list(candidates), self.device))
        abandoned = [stream for stream in candidates if stream in named]
        if abandoned:
            self._lock()
            try:
                if self.n_pending_events:
                    _process_events(self)
                for stream in abandoned:
                    if self.expandable:
                        _unmap_free_pages(self, True, stream)
                    _release_segments(self, False, True, stream, 0)
                self._drop_unused_streams()
            finally:
                self._unlock()
            _tell_backend_dropped_streams(self)
            if self.recording:
                self._flush_trace()
    except Exception as exc:
        _report_unraisable(exc, "unimem: giving back the cache of abandoned streams")
    return 0
