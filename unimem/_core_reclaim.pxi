# Included by _core.pyx: how cached memory goes back to the backend. Whole
# free segments only (empty_cache, the last retry before out-of-memory), the
# oversize blocks max_split_size frees first, garbage collection of old cached
# blocks, and the opt-in max_reserved_ratio. All on the miss path or in
# empty_cache: memory is returned outside the lock.

# Segments to release, ordered by a key (a C++ vector: a scan that holds
# Segment pointers makes no Python object, see _release).
ctypedef pair[pair[int64_t, uintptr_t], uintptr_t] RankedSegment


cdef int _release(CachingAllocator self, vector[Segment*]& victims) except -1:
    """Give wholly free, unsplit segments back to the backend (PyTorch's
    release_block). They leave the allocator under the lock; the backend
    is then called outside it (and, for a raw backend, without the GIL),
    because giving memory back may wait for the device (the XPU backend
    waits on the queue, whose host tasks may need the GIL and this lock).

    Between choosing the victims (the caller) and taking them out of the
    allocator (here) no Python object is made: making one may run the
    garbage collector, whose finalizers can re-enter the allocator on this
    thread (the lock is recursive) and allocate from a victim, or release
    it (empty_cache), leaving a pointer to freed memory. Once detached, the
    segments are this call's alone, and Python may run.

    A backend free that raises may or may not have released the memory
    (a Ctrl-C can arrive after the driver let go): such a segment is never
    cached again, since handing it out could hand out freed memory. It is
    forgotten, counted in :meth:`lost_segments`, and the first error is
    raised once the other segments were given back."""
    cdef vector[Segment*] detached
    cdef vector[uint64_t] freed_by_pool     # the private pool whose allocator frees it; 0: the backend
    cdef Segment* seg
    cdef size_t i
    for i in range(victims.size()):
        seg = victims[i]
        if _segment_is_free(self, seg):   # it may have been reused meanwhile
            freed_by_pool.push_back(seg.pool.id if seg.pool != NULL and seg.pool.has_backend else 0)
            _detach_segment(self, seg)
            detached.push_back(seg)
    if detached.empty():
        return 0
    # A detached pool's entry in pool_backends stays: only _reap_private_pools
    # drops it, and not while this call holds the lock.
    free_fns = [self.pool_backends[pool_id].free if pool_id else None for pool_id in freed_by_pool]
    cdef bint outside = self.lock_depth == 1
    first_error = None
    if outside:
        self._unlock()
    try:
        for i in range(detached.size()):
            seg = detached[i]
            try:
                _backend_free(self, seg.base, seg.size, seg.stream, outside, free_fns[i])
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
                self.lost_segment_count += 1
                self.lost_segment_bytes += seg.size
    finally:
        if outside:
            self._lock()
        for i in range(detached.size()):
            block_delete(&self.slab, detached[i].head)
            sys_free(detached[i])
    if first_error is not None:
        raise first_error
    return 0


cdef void _detach_segment(CachingAllocator self, Segment* seg) noexcept nogil:
    """Take a wholly free segment out of the allocator (and its statistics)."""
    cdef Block* b = seg.head
    cdef StreamPools* sp
    fi_remove(self._pool_of(b), b)
    self._unlink_segment(seg)
    self.stats.num_device_free += 1
    self.total_allocated_memory -= seg.size
    pool_decrease(&self.stats, S_SEGMENT, seg.is_small, 1)
    pool_decrease(&self.stats, S_RESERVED_BYTES, seg.is_small, seg.size)
    if seg.size >= self.policy.max_split_size:
        stat_decrease(&self.stats.oversize_segments, 1)
    if self.recording:
        self._trace(T_SEGMENT_FREE, seg.base, seg.size, seg.stream)
    if seg.pool != NULL:
        _forget_pool_segment(self, seg)
        return
    sp = self._stream_pools(seg.stream)
    if sp != NULL:
        sp.n_segments -= 1
        self._drop_stream_if_unused(sp)


cdef inline bint _segment_is_free(CachingAllocator self, Segment* seg) noexcept nogil:
    """Wholly free, to be given back whole (an expandable segment never is:
    its pages are unmapped and its range released on their own)."""
    cdef Block* b = seg.head
    return (not seg.expandable and b.next == NULL and not b.allocated and b.event_count == 0
            and b.stream_uses == NULL)


cdef int _release_segments(CachingAllocator self, bint only_large, bint has_stream, uintptr_t stream,
                           size_t min_size) except -1:
    """Release every wholly free segment matching the filter (of the
    device's own pools and of dead private pools: a live MemPool keeps its
    memory). The first backend error is raised after the others were tried."""
    cdef vector[Segment*] victims
    cdef Segment* seg = self.segments
    while seg != NULL:
        if (_segment_is_free(self, seg) and _releasable(seg) and not (only_large and seg.is_small)
                and not (has_stream and seg.stream != stream) and seg.size >= min_size):
            victims.push_back(seg)
        seg = seg.next_seg
    return _release(self, victims)


cdef bint _release_available_cached_blocks(CachingAllocator self, size_t size, uintptr_t stream,
                                           PrivatePool* pool) except -1:
    """With max_split_size set (PyTorch's release_available_cached_blocks):
    free the smallest cached oversize block of the stream (and of the
    request's pool) that is big enough, or else the stream's oversize
    blocks, largest first, until as much as was asked has been released."""
    if self.policy.max_split_size == SIZE_UNSET:
        return False
    cdef size_t key = size if size >= self.policy.max_split_size else self.policy.max_split_size
    cdef Segment* seg = self.segments
    cdef Segment* best = NULL
    cdef vector[Segment*] victims
    cdef vector[RankedSegment] candidates       # (size, base), taken from the last
    while seg != NULL:
        if (not seg.is_small and seg.stream == stream and seg.pool == pool and _segment_is_free(self, seg)
                and seg.size >= self.policy.max_split_size):
            candidates.push_back(RankedSegment(pair[int64_t, uintptr_t](<int64_t>seg.size, seg.base),
                                               <uintptr_t>seg))
            if seg.size >= key and (best == NULL or seg.size < best.size
                                    or (seg.size == best.size and seg.base < best.base)):
                best = seg
        seg = seg.next_seg
    if best != NULL:
        victims.push_back(best)
        _release(self, victims)
        return True
    cdef size_t released = 0
    cdef Py_ssize_t i
    cpp_sort(candidates.begin(), candidates.end())
    for i in range(<Py_ssize_t>candidates.size() - 1, -1, -1):   # PyTorch walks its set back from the largest
        if released >= key:
            break
        seg = <Segment*>candidates[i].second
        released += seg.size
        victims.push_back(seg)
    _release(self, victims)
    return released >= key


cdef int _garbage_collect(CachingAllocator self) except -1:
    """Free cached large blocks that have waited longest (PyTorch's
    garbage_collect_cached_blocks), until reserved memory is back under
    garbage_collection_threshold × the allowed maximum."""
    cdef size_t gc_threshold = <size_t>(self.policy.gc_threshold * <double>self.allowed_memory_maximum)
    if self.total_allocated_memory <= gc_threshold:
        return 0
    cdef size_t target = self.total_allocated_memory - gc_threshold
    cdef size_t reclaimed = 0
    cdef double total_age = 0.0
    cdef int64_t count = 0
    cdef Segment* seg = self.segments
    cdef vector[Segment*] freeable
    while seg != NULL:
        if not seg.is_small and seg.pool == NULL and _segment_is_free(self, seg):
            freeable.push_back(seg)
            total_age += <double>_gc_age(self, seg.head)
            count += 1
        seg = seg.next_seg
    cdef bint freed_one = True
    cdef double threshold
    cdef size_t i
    cdef vector[Segment*] victims
    while reclaimed < target and freed_one and count > 0:
        threshold = total_age / count
        freed_one = False
        for i in range(freeable.size()):
            seg = freeable[i]
            if seg == NULL:
                continue
            if <double>_gc_age(self, seg.head) >= threshold:
                freed_one = True
                reclaimed += seg.size
                total_age -= <double>_gc_age(self, seg.head)
                count -= 1
                freeable[i] = NULL
                victims.push_back(seg)
    return _release(self, victims)


cdef int _release_to_reserved_ratio(CachingAllocator self, size_t size, size_t alloc_size) except -1:
    """unimem's max_reserved_ratio (off by default; PyTorch has no such
    policy): before growing, give back wholly free cached segments,
    largest first, while reserved memory would exceed the ratio times
    the memory in use. It bounds what the cache keeps beyond the live
    data, at the cost of device calls when the working set shifts.
    With expandable segments (never wholly free) the free whole pages in
    the holes of their ranges are unmapped instead, where the request's
    place is known (_expandable_alloc, _core_holes.pxi)."""
    if self.expandable:
        return 0
    cdef double in_use = <double>(pool_current(&self.stats, S_ALLOCATED_BYTES) + size)
    cdef double limit = self.policy.max_reserved_ratio * in_use
    cdef double reserved = <double>(self.total_allocated_memory + alloc_size)
    if reserved <= limit:
        return 0
    cdef Segment* seg = self.segments
    cdef vector[Segment*] victims
    cdef vector[RankedSegment] free_segments    # (-size, base): largest first
    cdef size_t i
    while seg != NULL:
        if _segment_is_free(self, seg) and _releasable(seg):
            free_segments.push_back(RankedSegment(pair[int64_t, uintptr_t](-<int64_t>seg.size, seg.base),
                                                  <uintptr_t>seg))
        seg = seg.next_seg
    cpp_sort(free_segments.begin(), free_segments.end())
    for i in range(free_segments.size()):
        if reserved <= limit:
            break
        seg = <Segment*>free_segments[i].second
        victims.push_back(seg)
        reserved -= <double>seg.size
    return _release(self, victims)


cdef inline int64_t _gc_age(CachingAllocator self, Block* b) noexcept nogil:
    return self._pool_of(b).get_free_blocks_call_count - b.gc_count_base


cdef object _empty_cache(CachingAllocator self, stream, wait):
    """CachingAllocator.empty_cache."""
    self._check_usable()
    cdef bint one_stream = stream is not None
    cdef uintptr_t handle = check_stream(stream) if one_stream else 0
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
    if not self.deferred_frees.empty():
        _free_deferred(self)
    self._lock()
    try:
        if wait:
            _synchronize_and_free_events(self)
        elif self.n_pending_events:
            _process_events(self)
        if self.expandable:
            _unmap_free_pages(self, one_stream, handle)
            if not wait and self.releasing_bytes and self.n_pending_events:
                _process_events(self)      # those unmaps may have waited for the device: held pages go too
        _end_dead_pool_sleeps(self, NULL)   # pools that died asleep (a finalizer could not)
        _release_segments(self, False, one_stream, handle, 0)
        self._drop_unused_streams()
        _reap_private_pools(self)
    finally:
        self._unlock()
    _tell_backend_dropped_streams(self)
    self._flush_trace()
