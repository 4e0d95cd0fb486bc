# Included by _core.pyx: the miss path of an allocation (it may call Python):
# what c_malloc does out of line in an unusual state (_before_unusual_malloc),
# after a cache miss (_malloc_miss: a new segment, reclaiming, or
# out-of-memory; PyTorch's malloc after get_free_block failed), and after a
# new block was handed out (_after_malloc: history, debug mode). The cache
# hit never comes here.


from posix.unistd cimport usleep

cdef extern from "pythread.h":
    # Python's thread ident, callable without the GIL (it is pthread_self).
    unsigned long _thread_ident "PyThread_get_thread_ident"() nogil


cdef Block* _alloc_block(CachingAllocator self, size_t alloc_size, size_t size, uintptr_t stream, bint is_small,
                         bint is_retry, PrivatePool* pool) except? NULL:
    """A new segment from the backend (PyTorch's alloc_block), or NULL.
    ``size`` is the rounded request: under a byte limit (CuPy's set_limit)
    a segment that would pass the limit shrinks to it when it fits.
    ``pool``: the private pool it is for (its allocator's memory), or NULL."""
    if is_retry:
        self.stats.num_alloc_retries += 1
    # A reclaim before this attempt let the lock go around a backend call,
    # whose Python (or another thread) may have put the allocator or the
    # pool to sleep: no new segment then.
    _refuse_if_asleep(self, pool)
    if self.set_fraction and _held_or_asked(self) + alloc_size > self.allowed_memory_maximum:
        if not (self.limit_in_bytes and _held_or_asked(self) + size <= self.allowed_memory_maximum):
            return NULL
        alloc_size = size
    if _held_or_asked(self) + alloc_size > MAX_RESERVED:
        return NULL
    cdef Segment* seg = <Segment*>sys_malloc(sizeof(Segment))
    cdef Block* b = block_new(&self.slab)
    if seg == NULL or b == NULL:
        sys_free(seg)
        if b != NULL:
            block_delete(&self.slab, b)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    cdef uintptr_t ptr = 0
    cdef int rc
    cdef int64_t took_us = 0
    # The backend is asked with the lock let go: other threads' cache hits
    # and frees go on meanwhile, and a free its Python makes (a finalizer)
    # is an ordinary one. Not for a private pool (its death during the call
    # is put off while the lock is held: _core_pools.pxi) nor for a call
    # made while this thread holds the lock more than once (a Python backend
    # call under the lock allocating). Its bytes count against the limits
    # meanwhile (in_flight_bytes), and the state is read again after.
    cdef bint unlocked = pool == NULL and self.lock_depth == 1
    cdef pair[unsigned long, uint64_t] call
    try:
        if unlocked:
            call.second = _note_call_in_flight(self, alloc_size)
            self._unlock()
            try:
                rc = _backend_malloc(self, alloc_size, stream, &ptr, pool, True, &took_us)
            finally:
                self._lock()
                self.in_flight_bytes = self.in_flight_bytes - alloc_size if self.in_flight_bytes > alloc_size else 0
                _forget_call_in_flight(self, call.second)
        else:
            rc = _backend_malloc(self, alloc_size, stream, &ptr, pool, False, &took_us)
        if rc == 0:
            duration_add(&self.stats.device_alloc_time, took_us)
            _check_new_segment(self, ptr, alloc_size)
    except BaseException:
        sys_free(seg)
        block_delete(&self.slab, b)
        raise
    if rc != 0:
        sys_free(seg)
        block_delete(&self.slab, b)
        return NULL
    if self.sleeping or (pool != NULL and pool.sleeping):
        # The backend's Python put the allocator (or the pool) to sleep:
        # the new memory goes back, and the request is refused.
        sys_free(seg)
        block_delete(&self.slab, b)
        _backend_free(self, ptr, alloc_size, stream, False, _pool_free_fn(self, pool))
        _refuse_if_asleep(self, pool)
    # Looked up only now: a Python backend may have run finalizers that
    # dropped the stream's (then empty) pools during the call.
    cdef StreamPools* sp = self._stream_pools(stream) if pool == NULL else _pool_segment_tables(self, pool, stream)
    if sp == NULL:
        sys_free(seg)
        block_delete(&self.slab, b)
        _backend_free(self, ptr, alloc_size, stream, False, _pool_free_fn(self, pool))
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    _adopt_segment(self, seg, b, ptr, alloc_size, stream, is_small, pool, sp)
    return b


cdef void _adopt_segment(CachingAllocator self, Segment* seg, Block* b, uintptr_t ptr, size_t alloc_size,
                         uintptr_t stream, bint is_small, PrivatePool* pool, StreamPools* sp) noexcept nogil:
    """Make the backend's ``alloc_size`` bytes at ``ptr`` a segment of
    ``sp``'s pools (of private pool ``pool``, or NULL), described by ``seg``
    and its one free block ``b`` (not yet in a free index), and count it.
    Lock held."""
    seg.base = ptr
    seg.size = alloc_size
    seg.stream = stream
    seg.is_small = is_small
    seg.head = b
    seg.expandable = False
    seg.pool = pool
    self._link_segment(seg)
    sp.n_segments += 1
    if pool != NULL:
        _count_pool_segment(self, pool, stream, 1)
    b.ptr = ptr
    b.size = alloc_size
    b.stream = stream
    b.segment = seg
    b.is_small = is_small
    b.index = sp.small if is_small else sp.large
    if self.debug_on:
        memset(<void*>ptr, DEBUG_FILL, alloc_size)
    self.total_allocated_memory += alloc_size
    pool_increase(&self.stats, S_SEGMENT, is_small, 1)
    pool_increase(&self.stats, S_RESERVED_BYTES, is_small, alloc_size)
    if alloc_size >= self.policy.max_split_size:
        stat_increase(&self.stats.oversize_segments, 1)
    self.stats.num_device_alloc += 1
    if self.recording:
        self._trace(T_SEGMENT_ALLOC, ptr, alloc_size, stream)


cdef Block* _malloc_miss_nogil(CachingAllocator self, size_t orig_size, uintptr_t stream,
                               unsigned char client) noexcept nogil:
    """c_malloc_nogil's miss without the GIL (a thread that does not hold
    it), for the common case: a backend of the provider ABI, PyTorch's plain
    segments (not expandable; no garbage collection threshold, no reserved
    ratio), a segment within every limit, and nothing the backend must be
    told first (a new stream, dropped streams). The backend is asked once,
    with the lock let go, as _alloc_block asks it (a call in flight that
    refused misses wait for). Anything else, a refusal
    included (the retries that free cached memory, and the out-of-memory
    error, need Python), returns NULL having changed nothing but the cache
    of a segment it got, and the caller takes the GIL. Lock held once (and
    held again at return)."""
    cdef size_t size = self._round_size(orig_size)
    cdef bint is_small = size <= self.policy.small_request_max
    cdef size_t alloc_size = _segment_size(self, size)
    cdef FreeIndex* fi
    cdef Segment* seg
    cdef Block* b
    cdef StreamPools* sp
    cdef uintptr_t ptr = 0
    cdef int rc
    cdef int64_t took_ns
    cdef uint64_t call
    if (not self._has_raw or self.expandable or self._gc_enabled() or self.policy.max_reserved_ratio
            or self.lock_depth != 1 or self.stream_notices.added or not self.stream_notices.dropped.empty()):
        return NULL
    if ((self.capacity and alloc_size > self.capacity) or (self.max_allocation and alloc_size > self.max_allocation)
            or (self.set_fraction and _held_or_asked(self) + alloc_size > self.allowed_memory_maximum)
            or _held_or_asked(self) + alloc_size > MAX_RESERVED):
        return NULL
    fi = self._pool(stream, is_small)
    if fi == NULL or self._reserve_for_alloc(fi) != 0:
        return NULL
    seg = <Segment*>sys_malloc(sizeof(Segment))
    b = block_new(&self.slab)
    if seg == NULL or b == NULL:
        sys_free(seg)
        if b != NULL:
            block_delete(&self.slab, b)
        return NULL
    call = _note_call_in_flight(self, alloc_size)
    self._unlock()
    took_ns = um_now_ns()
    rc = self._raw.malloc(self._raw.ctx, alloc_size, self.device, stream, &ptr)
    took_ns = um_now_ns() - took_ns
    self.lock.lock()                     # no GIL held: rule 1
    self.lock_depth += 1
    self.in_flight_bytes = self.in_flight_bytes - alloc_size if self.in_flight_bytes > alloc_size else 0
    _forget_call_in_flight(self, call)
    sp = NULL
    if rc == RAW_OK and ptr != 0 and (ptr > <uintptr_t>-1 - alloc_size
                                      or _segment_clash(self, ptr, alloc_size) != NULL):
        ptr = 0     # a backend error: the memory may be a live segment's, so it is not given back
    elif rc == RAW_OK and ptr != 0 and not (self.sleeping or self.poisoned):
        sp = self._stream_pools(stream)
    if sp == NULL:
        if rc == RAW_OK and ptr != 0:
            self._raw.free(self._raw.ctx, ptr, alloc_size, self.device, stream)
        sys_free(seg)
        block_delete(&self.slab, b)
        return NULL
    duration_add(&self.stats.device_alloc_time, took_ns // 1000)
    _adopt_segment(self, seg, b, ptr, alloc_size, stream, is_small, NULL, sp)
    fi = b.index
    if self._reserve_for_alloc(fi) != 0:
        fi_insert(fi, b)                 # a cached segment: the caller's c_malloc finds it
        return NULL
    return self._alloc_found_block(b, fi, size, orig_size, False, client)


cdef uint64_t _note_call_in_flight(CachingAllocator self, size_t alloc_size) noexcept nogil:
    """A segment of ``alloc_size`` bytes is about to be asked of the backend
    with the lock let go: its bytes count against the limits, and misses
    refused meanwhile wait for it (_wait_for_calls_in_flight). Its number,
    for _forget_call_in_flight. Lock held."""
    cdef pair[unsigned long, uint64_t] call
    self.in_flight_numbered += 1
    call.first = _thread_ident()
    call.second = self.in_flight_numbered
    self.in_flight_calls.push_back(call)
    self.in_flight_bytes += alloc_size
    return call.second


cdef void _forget_call_in_flight(CachingAllocator self, uint64_t number) noexcept nogil:
    """Call ``number`` is no longer in flight (lock held)."""
    cdef size_t i
    for i in range(self.in_flight_calls.size()):
        if self.in_flight_calls[i].second == number:
            self.in_flight_calls.erase(self.in_flight_calls.begin() + i)
            return


cdef bint _wait_for_calls_in_flight(CachingAllocator self) except -1:
    """Wait for the segments other threads are asking the backend for with
    the lock let go (_alloc_block), when there are any: a request refused
    meanwhile may have been refused for their bytes alone (a memory limit
    they fill, or a device they fill), and what they get may serve it from
    the cache, as it would have had it waited for the lock. Only the calls
    in flight now are waited for (later ones could keep it waiting). True
    when it waited (the caller looks at the cache again). Never when this
    thread has a call in flight itself (a request made by the backend's own
    Python: it would wait for itself), nor when the lock is held more than
    once. Lock held on entry and exit, let go while waiting, without the GIL."""
    cdef unsigned long thread = PyThread_get_thread_ident()
    cdef uint64_t last = self.in_flight_numbered
    cdef size_t i
    if self.lock_depth != 1 or self.in_flight_calls.empty():
        return False
    for i in range(self.in_flight_calls.size()):
        if self.in_flight_calls[i].first == thread:
            return False
    while _calls_in_flight_up_to(self, last):
        self._unlock()
        with nogil:
            usleep(50)
        self._lock()
    return True


cdef bint _calls_in_flight_up_to(CachingAllocator self, uint64_t last) noexcept nogil:
    cdef size_t i
    for i in range(self.in_flight_calls.size()):
        if self.in_flight_calls[i].second <= last:
            return True
    return False


cdef Block* _take_cached_again(CachingAllocator self, size_t size, uintptr_t stream, bint is_small) noexcept nogil:
    """The best fit for ``size`` rounded bytes in the device's pools, taken off
    the free index, or NULL (after _wait_for_calls_in_flight). Lock held."""
    cdef FreeIndex* fi = self._pool(stream, is_small)
    if fi == NULL or self._reserve_for_alloc(fi) != 0:
        return NULL
    return self._get_free_block(fi, size)


cdef inline size_t _held_or_asked(CachingAllocator self) noexcept nogil:
    """The bytes held from the backend and being asked of it (with the lock
    let go): what a limit is checked against."""
    return self.total_allocated_memory + self.in_flight_bytes


cdef inline size_t _segment_size(CachingAllocator self, size_t size) noexcept nogil:
    """The segment a miss of ``size`` rounded bytes asks the backend for
    (PyTorch's get_allocation_size, or the request itself under CuPy's policy)."""
    if self.policy.exact_segments:
        return size
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


cdef Block* _malloc_slow(CachingAllocator self, size_t orig_size, uintptr_t stream, bint by_handle,
                         unsigned char client, bint* oom, size_t* tried, PrivatePool* pool,
                         bint uncached) except? NULL:
    """Everything after a cache miss, in PyTorch's order. Lock held.
    ``tried`` receives the segment size asked for (the OOM message names it).
    ``pool``: a private pool's request (NULL: the device's own pools);
    ``uncached``: the cache is off, the segment is the rounded request."""
    cdef size_t size = self._round_size(orig_size)
    cdef bint is_small = size <= (self.policy.small_request_max if pool == NULL else K_SMALL_SIZE)
    cdef bint expandable = self.expandable and pool == NULL   # a private pool's segments are plain
    cdef size_t alloc_size = (_round_up(size, _page_of(self, is_small)) if expandable
                              else size if uncached else _segment_size(self, size))
    cdef size_t smallest = size if self.limit_in_bytes else alloc_size
    cdef FreeIndex* fi = self._pool(stream, is_small) if pool == NULL else _pool_index(self, pool, stream, is_small)
    cdef Block* b
    oom[0] = False
    tried[0] = alloc_size
    # c_malloc's check ran before the lock: a sleep() may have come in
    # between (its blocks are held, so only a miss can get here)
    _refuse_if_asleep(self, pool)
    # Reserve the bookkeeping first, so that nothing fails after the
    # backend handed memory over.
    if fi == NULL or self._reserve_for_alloc(fi) != 0:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    # A request no device of this size can ever hold does not flush the cache.
    if (self.capacity and alloc_size > self.capacity) or (
            self.max_allocation and alloc_size > self.max_allocation) or (
            self.set_fraction and smallest > self.allowed_memory_maximum):
        oom[0] = True
        return NULL
    if self._gc_enabled():
        _garbage_collect(self)
    if self.policy.max_reserved_ratio:
        _release_to_reserved_ratio(self, size, alloc_size)
    if expandable:
        # PyTorch's order: grow; free everything cached (unmapping free
        # pages and, as its release_cached_blocks does, releasing ranges
        # left with no page) and grow again, counted as a retry. Every held
        # hole of this pool is taken back first (_take_back_held).
        b = _take_back_held(self, fi, size) if self.releasing_bytes else NULL
        if b == NULL:
            b = _expandable_alloc(self, size, stream, is_small, False)
        if b == NULL and _wait_for_calls_in_flight(self):
            # Refused for what other threads' calls map (or give back) with
            # the lock let go, perhaps: once they are done, as for a plain
            # segment below.
            b = _take_cached_again(self, size, stream, is_small)
            if b == NULL:
                b = _expandable_alloc(self, size, stream, is_small, False)
        if b == NULL and self.releasing_bytes:
            # Pages of holes held until their stream's work is done still
            # count against the device (or a limit): wait for those alone
            # and map again, before giving back every cache.
            _synchronize_and_free_events(self, True)
            b = _expandable_alloc(self, size, stream, is_small, False)
        if b == NULL:
            _synchronize_and_free_events(self)
            _unmap_free_pages(self, False, 0)
            _release_empty_ranges(self, False, 0)
            b = _expandable_alloc(self, size, stream, is_small, True)
            if b == NULL:
                # A range made for a request larger than a range is (1 TiB
                # for a 1 TiB request) and left with no page mapped goes
                # back; one of the usual size stays for the next miss, as
                # PyTorch keeps its segment.
                _release_empty_ranges(self, False, 0, _default_range_size(self))
    else:
        b = _alloc_block(self, alloc_size, size, stream, is_small, False, pool)
        if b == NULL and pool == NULL and not uncached and _wait_for_calls_in_flight(self):
            b = _take_cached_again(self, size, stream, is_small)
            if b == NULL:
                b = _alloc_block(self, alloc_size, size, stream, is_small, False, pool)
        if b == NULL and _release_available_cached_blocks(self, size, stream, pool):
            b = _alloc_block(self, alloc_size, size, stream, is_small, False, pool)
        if b == NULL:
            _synchronize_and_free_events(self)
            _release_segments(self, False, False, 0, 0)
            b = _alloc_block(self, alloc_size, size, stream, is_small, True, pool)
    if b == NULL and pool == NULL and not uncached:
        b = _take_from_oom_pools(self, size, stream)     # MemPool(use_on_oom=True)
    if b == NULL:
        oom[0] = True
        return NULL
    # Releasing may have dropped (and _alloc_block made again) the
    # stream's pools, and a Python backend may have run finalizers that
    # took the reservation meanwhile: both are cheap to redo.
    fi = b.index
    if self._reserve_for_alloc(fi) != 0:
        fi_insert(fi, b)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    return self._alloc_found_block(b, fi, _handed_size(b, size), orig_size, by_handle, client)


cdef uintptr_t _before_unusual_malloc(CachingAllocator self, size_t size, uintptr_t stream, bint by_handle,
                                      unsigned char client) except? 0:
    """What c_malloc does first in an unusual state (poisoned, asleep,
    events pending or frees deferred, routed requests): the address when a private pool or
    the cache switch served the request, else 0 (c_malloc goes on)."""
    if self.poisoned:
        self._check_usable()
    if self.sleeping:
        _refuse_asleep(self)
    if self.n_pending_events or not self.deferred_frees.empty():
        if not self.deferred_frees.empty():
            _free_deferred(self)
        self._lock()
        try:
            if self.n_pending_events:
                _process_events(self)
        except BaseException:
            self._unlock()
            raise
        if self.cache_off or not self.routes.empty() or not self.trace_buffer.empty():
            self._unlock()
            self._flush_trace()
        else:
            # served under the lock the answers were committed with: one
            # lock round less for every allocation while events are pending
            return _malloc_locked(self, size, stream, by_handle, client)
    if self.cache_off or not self.routes.empty():
        return _malloc_routed(self, size, stream, by_handle, client)   # 0: not routed
    return 0


cdef uintptr_t _malloc_locked(CachingAllocator self, size_t size, uintptr_t stream, bint by_handle,
                              unsigned char client) except? 0:
    """c_malloc's own steps, the lock held (and let go here)."""
    cdef int status
    cdef Block* b = self._malloc_cached(size, stream, by_handle, client, &status)
    if b == NULL:
        return _malloc_miss(self, size, stream, by_handle, client, status)
    self._unlock()
    if self.unusual:
        _after_malloc(self, b.ptr, size, by_handle)
    return b.ptr


cdef uintptr_t _malloc_miss(CachingAllocator self, size_t size, uintptr_t stream, bint by_handle,
                            unsigned char client, int status) except? 0:
    """c_malloc after a cache miss, the lock held (and let go here): a new
    segment, reclaiming, or out-of-memory."""
    cdef Block* b
    cdef bint oom = False
    cdef size_t tried = 0
    try:
        try:
            if status != 0:
                raise MemoryError("host memory for the allocator's bookkeeping ran out")
            b = _malloc_slow(self, size, stream, by_handle, client, &oom, &tried, NULL, False)
        finally:
            self._unlock()
    except BaseException:
        _drain_inbox(self)
        raise
    if oom:
        if not self.stream_notices.dropped.empty():
            _tell_backend_dropped_streams(self)
        if self.recording:
            self._flush_trace()
        _drain_inbox(self)
        raise self._out_of_memory(size, tried)
    # lock_depth is the allocator's, not this thread's: while any thread
    # holds the lock (a re-entered call, a finalizer elsewhere) the
    # question waits for a later miss, as stream_notices.added stays set
    if self.stream_notices.added and self.lock_depth == 0:
        try:
            _release_abandoned_streams(self, stream)
        except BaseException:       # a Ctrl-C: the caller never saw the block
            self._try_free(b.ptr, by_handle, True)
            raise
    _after_malloc(self, b.ptr, size, by_handle)
    if not self.deferred_frees.empty():
        _drain_inbox_after_malloc(self, b.ptr, by_handle)
    return b.ptr


cdef int _drain_inbox_after_malloc(CachingAllocator self, uintptr_t ptr, bint by_handle) except -1:
    """The frees that went to the inbox during the miss (a finalizer run
    by a backend call the lock was held for) are done before the caller
    has the block. A Ctrl-C there gives the new block back first."""
    try:
        _drain_inbox(self)
    except BaseException:
        self._try_free(ptr, by_handle, True)
        raise
    return 0


cdef int _after_malloc(CachingAllocator self, uintptr_t ptr, size_t size, bint by_handle) except -1:
    """History and debug mode, outside the lock. A Ctrl-C raised in the
    history hook gives the new block back before it reaches the caller,
    who never saw the address."""
    try:
        if not self.stream_notices.dropped.empty():
            _tell_backend_dropped_streams(self)
        if self.recording:
            self._flush_trace()
    except BaseException:
        self._try_free(ptr, by_handle, True)
        raise
    if self.debug_on:
        _debug_after_malloc(self, ptr, size)
    return 0
