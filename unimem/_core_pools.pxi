# Included by _core.pyx: private pools (PyTorch's MemPool, use_mem_pool) and
# the cache switch (caching_allocator_enable).
#
# A private pool lives inside the device's allocator, as PyTorch's
# PrivatePool does: its own free indexes by stream (PrivatePool.streams), its
# segments tagged with it (Segment.pool) and used for its allocations only,
# its blocks counted in the device's statistics and under its limits. A
# block's free index (Block.index) is its pool's, so frees and merges need
# nothing more. Use count: the MemPool object plus each use_mem_pool context
# (PyTorch's createOrIncrefPool / releasePool). At none left the pool is
# dead: its free segments go back (now, and at each empty_cache until its
# last block is freed), and then the pool itself goes (_reap_private_pools).
# A pool that dies asleep is woken first where its blocks are still in use
# (_end_dead_pool_sleeps), and its free segments go back without waking.
#
# Routing is per thread: ``routes`` maps a thread to the pools it allocates
# from, innermost last. While any thread routes (or the cache is off),
# ``unusual`` sends c_malloc to _malloc_routed; with no pool in use the hot
# path is untouched.
from cpython.pythread cimport PyThread_get_thread_ident
from libcpp.unordered_map cimport unordered_map

ctypedef unordered_map[unsigned long, vector[PrivatePool*]].iterator RouteIterator


cdef uint64_t _pool_id_number(object pool_id) except? 0:
    """The n of a private pool's id ``(0, n)``; 0 for None or ``(0, 0)``
    (the device's own pools)."""
    if pool_id is None:
        return 0
    if not isinstance(pool_id, tuple) or len(pool_id) != 2 or not all(
            isinstance(part, int) and not isinstance(part, bool) for part in pool_id):
        raise TypeError(f"a memory pool id is a tuple of two ints, got {pool_id!r}")
    if pool_id[0] != 0 or not (0 <= pool_id[1] < 1 << 63):
        raise ValueError(f"{pool_id!r} is not the id of a MemPool (those are (0, n))")
    return pool_id[1]


cdef inline PrivatePool* _find_pool(CachingAllocator self, uint64_t pool_id) noexcept nogil:
    cdef cmap[uint64_t, PrivatePool*].iterator it = self.private_pools.find(pool_id)
    if it == self.private_pools.end():
        return NULL
    return deref(it).second


cdef PrivatePool* _live_pool(CachingAllocator self, object pool_id) except NULL:
    """The private pool ``pool_id`` while it is in use. Lock held."""
    cdef uint64_t n = _pool_id_number(pool_id)
    cdef PrivatePool* pool = _find_pool(self, n) if n != 0 else NULL
    if pool == NULL or pool.use_count == 0:
        raise ValueError(f"memory pool {pool_id!r} is not a live pool of the {self.device_name} "
                         f"allocator of device {self.device} (released, or made for another device)")
    return pool


cdef inline bint _releasable(Segment* seg) noexcept nogil:
    """A segment empty_cache may give back: the device's own, or a dead pool's."""
    return seg.pool == NULL or seg.pool.use_count == 0


cdef inline size_t _handed_size(Block* b, size_t size) noexcept nogil:
    """What a request of ``size`` rounded bytes takes of free block ``b``:
    all of it in a pool that never splits (MemPool(no_split=True))."""
    if b.segment.pool != NULL and b.segment.pool.no_split:
        return b.size
    return size


# ---------------------------------------------------------------------------
# a pool's free indexes and segments
# ---------------------------------------------------------------------------
cdef StreamPools* _pool_stream_pools(PrivatePool* pool, uintptr_t stream) noexcept nogil:
    """Find or make ``pool``'s free indexes of ``stream`` (NULL: no host memory)."""
    cdef StreamTable.iterator it = pool.streams.find(stream)
    if it != pool.streams.end():
        return deref(it).second
    cdef StreamPools* sp = stream_pools_new(stream)
    if sp != NULL:
        pool.streams[stream] = sp
    return sp


cdef void _drop_pool_stream_if_unused(PrivatePool* pool, uintptr_t stream) noexcept nogil:
    """Forget ``pool``'s free indexes of ``stream`` when no segment of the
    pool is on it (a request that failed there made them)."""
    cdef StreamTable.iterator it = pool.streams.find(stream)
    if it != pool.streams.end() and deref(it).second.n_segments == 0:
        stream_pools_delete(deref(it).second)
        pool.streams.erase(it)


cdef FreeIndex* _pool_index(CachingAllocator self, PrivatePool* pool, uintptr_t stream,
                            bint is_small) noexcept nogil:
    cdef StreamPools* sp = _pool_stream_pools(pool, stream)
    if sp == NULL:
        return NULL
    return sp.small if is_small else sp.large


cdef StreamPools* _pool_segment_tables(CachingAllocator self, PrivatePool* pool,
                                       uintptr_t stream) noexcept nogil:
    """The tables a new segment of ``pool`` on ``stream`` goes into: the
    pool's (returned) and the device's own entry of the stream, which
    counts it (n_private_segments) so that the stream is not dropped."""
    if self._stream_pools(stream) == NULL:
        return NULL
    return _pool_stream_pools(pool, stream)


cdef void _count_pool_segment(CachingAllocator self, PrivatePool* pool, uintptr_t stream,
                              int delta) noexcept nogil:
    pool.n_segments += delta
    self._stream_pools(stream).n_private_segments += delta   # made by _pool_segment_tables


cdef void _forget_pool_segment(CachingAllocator self, Segment* seg) noexcept nogil:
    """A private pool's segment left the allocator (_detach_segment)."""
    cdef PrivatePool* pool = seg.pool
    cdef StreamTable.iterator it = pool.streams.find(seg.stream)
    cdef StreamPools* sp
    if it != pool.streams.end():
        sp = deref(it).second
        sp.n_segments -= 1
        if sp.n_segments == 0:
            pool.streams.erase(it)
            stream_pools_delete(sp)
    _count_pool_segment(self, pool, seg.stream, -1)
    self._drop_stream_if_unused(self._stream_pools(seg.stream))


cdef object _pool_free_fn(CachingAllocator self, PrivatePool* pool):
    """The free of the allocator a pool's segments come from (None: the backend's)."""
    if pool == NULL or not pool.has_backend:
        return None
    return self.pool_backends[pool.id].free


cdef object _segment_free_fn(CachingAllocator self, Segment* seg):
    return _pool_free_fn(self, seg.pool)


cdef size_t _private_free_block_count(CachingAllocator self) noexcept nogil:
    cdef size_t n = 0
    cdef pair[uint64_t, PrivatePool*] entry
    cdef pair[uintptr_t, StreamPools*] table
    for entry in self.private_pools:
        for table in entry.second.streams:
            n += table.second.small.n_blocks + table.second.large.n_blocks
    return n


cdef void _delete_pool(CachingAllocator self, PrivatePool* pool) noexcept nogil:
    cdef pair[uintptr_t, StreamPools*] table
    for table in pool.streams:
        stream_pools_delete(table.second)
    del pool


cdef void _delete_private_pools(CachingAllocator self) noexcept nogil:
    """__dealloc__: every pool's C structures (their memory went in __del__)."""
    cdef pair[uint64_t, PrivatePool*] entry
    for entry in self.private_pools:
        _delete_pool(self, entry.second)
    self.private_pools.clear()


cdef int _reap_private_pools(CachingAllocator self) except -1:
    """Forget dead pools with no segment left. Lock held once only: an
    outer call of this thread (a finalizer runs inside one) may hold a pool."""
    cdef pair[uint64_t, PrivatePool*] entry
    cdef vector[uint64_t] dead
    cdef uint64_t pool_id
    if self.lock_depth != 1:
        return 0
    for entry in self.private_pools:
        if entry.second.use_count == 0 and entry.second.n_segments == 0:
            dead.push_back(entry.first)
    for pool_id in dead:
        _delete_pool(self, _find_pool(self, pool_id))
        self.private_pools.erase(pool_id)
        self.pool_backends.pop(pool_id, None)
    return 0


cdef int _empty_dead_pool(CachingAllocator self, PrivatePool* pool) except -1:
    """A pool just died (PyTorch's ~MemPool calls emptyCache(id)): its free
    segments go back now, unless this thread is inside another allocator
    call (a finalizer): then at the next empty_cache. Lock held."""
    cdef vector[Segment*] victims
    cdef Segment* seg
    if self.lock_depth != 1:
        return 0
    try:
        _end_dead_pool_sleeps(self, pool)     # one that dies asleep: _core_sleep.pxi
        # read after it: it runs Python, whose finalizers may release segments
        seg = self.segments
        while seg != NULL:
            if seg.pool == pool and _segment_is_free(self, seg):
                victims.push_back(seg)
            seg = seg.next_seg
        _release(self, victims)
    finally:
        _reap_private_pools(self)
    return 0


cdef Block* _take_from_oom_pools(CachingAllocator self, size_t size, uintptr_t stream) noexcept nogil:
    """A request of the device's own pools about to fail takes a free block
    of a MemPool(use_on_oom=True), first made first (PyTorch's
    try_mempool_fallback): cached memory only, no new segment. The block,
    taken off its free index, or NULL. Lock held."""
    cdef pair[uint64_t, PrivatePool*] entry
    cdef StreamTable.iterator it
    cdef FreeIndex* fi
    cdef Block* b
    for entry in self.private_pools:
        if not entry.second.use_on_oom or entry.second.use_count == 0:
            continue
        it = entry.second.streams.find(stream)
        if it == entry.second.streams.end():
            continue
        fi = deref(it).second.small if size <= K_SMALL_SIZE else deref(it).second.large
        b = self._get_free_block(fi, size)
        if b != NULL:
            return b
    return NULL


# ---------------------------------------------------------------------------
# the Python-facing operations (CachingAllocator's methods call these)
# ---------------------------------------------------------------------------
def check_pool_allocator(backend):
    """Refuse (TypeError) a private pool's allocator without callable
    ``malloc`` and ``free``; None (the device's own backend) passes. MemPool
    calls it before it takes an id, as PyTorch's argument conversion refuses
    before the pool's constructor counts one."""
    if backend is not None and not (callable(getattr(backend, "malloc", None))
                                    and callable(getattr(backend, "free", None))):
        raise TypeError(f"a pool's allocator needs malloc and free methods, got {type(backend).__name__}")


cdef int _create_pool(CachingAllocator self, object pool_id, object backend, bint use_on_oom,
                      bint no_split) except -1:
    cdef uint64_t n = _pool_id_number(pool_id)
    cdef PrivatePool* pool
    if n == 0:
        raise ValueError("(0, 0) names the device's own pools, not a MemPool")
    check_pool_allocator(backend)
    self._lock()
    try:
        if _find_pool(self, n) != NULL:
            raise ValueError(f"memory pool {pool_id!r} already exists on this allocator")
        pool = new PrivatePool()
        pool.id = n
        pool.use_count = 1
        pool.use_on_oom = use_on_oom
        pool.no_split = no_split
        pool.has_backend = backend is not None
        pool.sleeping = False
        if backend is not None:
            self.pool_backends[n] = backend
        self.private_pools[n] = pool
    finally:
        self._unlock()
    return 0


cdef int _drop_pool_use(CachingAllocator self, PrivatePool* pool) except -1:
    """One use of ``pool`` ends (PyTorch's releasePool). Lock held."""
    pool.use_count -= 1
    if pool.use_count == 0:
        pool.use_on_oom = False
        _empty_dead_pool(self, pool)
    return 0


cdef int _release_pool(CachingAllocator self, object pool_id) except -1:
    cdef PrivatePool* pool
    self._lock()
    try:
        pool = _live_pool(self, pool_id)
        pool.use_on_oom = False       # ~MemPool: no longer a fallback, even if a context lasts
        _drop_pool_use(self, pool)
    finally:
        self._unlock()
    self._after_free()
    return 0


cdef int _begin_pool(CachingAllocator self, object pool_id) except -1:
    cdef PrivatePool* pool
    cdef unsigned long thread = PyThread_get_thread_ident()
    self._lock()
    try:
        pool = _live_pool(self, pool_id)
        self.routes[thread].push_back(pool)     # may raise MemoryError: nothing changed then
        pool.use_count += 1
        self._update_unusual()
    finally:
        self._unlock()
    return 0


cdef PrivatePool* _end_route(CachingAllocator self, RouteIterator it, uint64_t n) noexcept nogil:
    """Take the innermost use of pool ``n`` off the routes of ``it``'s
    thread (and the thread off ``routes`` when none is left): the pool, or
    NULL when the thread has no use of it. Lock held."""
    cdef PrivatePool* pool = NULL
    cdef size_t i = deref(it).second.size()
    while i > 0:
        i -= 1
        if deref(it).second[i].id == n:
            pool = deref(it).second[i]
            deref(it).second.erase(deref(it).second.begin() + i)
            break
    if deref(it).second.empty():
        self.routes.erase(it)
    return pool


cdef void _forget_other_threads_routes(CachingAllocator self) noexcept:
    """After fork(): only this thread lives on, so the other threads' uses of
    pools end (their use_mem_pool contexts will never exit; a thread the
    child starts may get one of their idents). A pool left with no use dies
    at the next empty_cache (no backend call here)."""
    cdef unsigned long thread = PyThread_get_thread_ident()
    cdef RouteIterator it = self.routes.begin()
    cdef size_t i
    while it != self.routes.end():
        if deref(it).first == thread:
            inc(it)
            continue
        for i in range(deref(it).second.size()):
            deref(it).second[i].use_count -= 1
            if deref(it).second[i].use_count == 0:
                deref(it).second[i].use_on_oom = False
        it = self.routes.erase(it)
    self._update_unusual()


cdef int _end_pool(CachingAllocator self, object pool_id) except -1:
    cdef uint64_t n = _pool_id_number(pool_id)
    cdef unsigned long thread = PyThread_get_thread_ident()
    cdef PrivatePool* pool = NULL
    cdef RouteIterator it
    self._lock()
    try:
        it = self.routes.find(thread)
        if it != self.routes.end():
            pool = _end_route(self, it, n)
        if pool == NULL:
            # PyTorch's endAllocateToPool ends a use of the pool whatever
            # thread began it: a use_mem_pool context entered in a generator
            # on one thread may be closed on another.
            it = self.routes.begin()
            while it != self.routes.end():
                pool = _end_route(self, it, n)    # erases ``it`` only when it found the pool
                if pool != NULL:
                    break
                inc(it)
        if pool == NULL:
            raise ValueError(f"no thread is allocating from memory pool {pool_id!r} "
                             f"on device {self.device}")
        self._update_unusual()
        _drop_pool_use(self, pool)
    finally:
        self._unlock()
    self._after_free()
    return 0


cdef int _pool_use_count(CachingAllocator self, object pool_id) except -1:
    cdef uint64_t n = _pool_id_number(pool_id)
    cdef PrivatePool* pool
    self._lock()
    pool = _find_pool(self, n) if n != 0 else NULL
    count = pool.use_count if pool != NULL else 0
    self._unlock()
    return count


cdef int _set_caching(CachingAllocator self, bint enabled) except -1:
    """caching_allocator_enable: off, every allocation is a segment of its
    own and every free gives its segment back; what is cached now goes back."""
    self._lock()
    try:
        self.cache_off = not enabled
        self._update_unusual()
        if not enabled:
            _release_every_free_segment(self)
    finally:
        self._unlock()
    self._after_free()
    return 0


cdef int _release_every_free_segment(CachingAllocator self) except -1:
    """What the cache holds goes back (the cache is off): every wholly free
    segment of the device's own pools and of dead private pools, and with
    expandable segments every free whole page. Lock held."""
    if self.expandable:
        _unmap_free_pages(self, False, 0)
    _release_segments(self, False, False, 0, 0)
    self._drop_unused_streams()
    return 0


# ---------------------------------------------------------------------------
# allocation and free while routing or with the cache off
# ---------------------------------------------------------------------------
cdef uintptr_t _malloc_routed(CachingAllocator self, size_t size, uintptr_t stream,
                              bint by_handle, unsigned char client) except? 0:
    """c_malloc for this thread's pool (the innermost use_mem_pool), or with
    the cache off (a new segment, whatever pool is in use). 0: this thread
    allocates from the device's own pools: c_malloc goes on."""
    cdef PrivatePool* pool = NULL
    cdef Block* b = NULL
    cdef FreeIndex* fi
    cdef bint oom = False
    cdef size_t tried = 0
    cdef size_t rounded
    cdef RouteIterator it
    self._lock()
    if not self.cache_off:
        it = self.routes.find(PyThread_get_thread_ident())
        if it == self.routes.end():
            self._unlock()
            return 0
        pool = deref(it).second.back()
        # This request's own use of the pool: a reclaim below lets the lock go
        # around backend calls, whose Python may end the thread's use_mem_pool
        # and the MemPool itself; the pool must outlive the request.
        pool.use_count += 1
    try:
        try:
            _refuse_if_asleep(self, pool)
            if pool != NULL:
                rounded = self._round_size(size)
                fi = _pool_index(self, pool, stream, rounded <= K_SMALL_SIZE)
                if fi == NULL or self._reserve_for_alloc(fi) != 0:
                    raise MemoryError("host memory for the allocator's bookkeeping ran out")
                b = self._get_free_block(fi, rounded)
                if b != NULL:
                    b = self._alloc_found_block(b, fi, _handed_size(b, rounded), size, by_handle, client)
            if b == NULL:
                b = _malloc_slow(self, size, stream, by_handle, client, &oom, &tried, pool, self.cache_off)
        finally:
            try:
                if pool != NULL:
                    if b == NULL:
                        _drop_pool_stream_if_unused(pool, stream)    # made by _pool_index for this request
                    _drop_pool_use(self, pool)     # the last use, if the MemPool ended meanwhile
            finally:
                self._unlock()
    except BaseException:
        _drain_inbox(self)
        raise
    if oom:
        self._after_free()          # history, and the streams the retries dropped
        _drain_inbox(self)
        raise self._out_of_memory(size, tried)
    _after_malloc(self, b.ptr, size, by_handle)
    if not self.deferred_frees.empty():
        _drain_inbox_after_malloc(self, b.ptr, by_handle)
    return b.ptr


cdef int _give_back_segment_at(CachingAllocator self, uintptr_t ptr) except -1:
    """With the cache off, after the free of the block at ``ptr``: its
    segment goes back to the backend if wholly free (not from inside another
    allocator call of this thread: then at the next empty_cache)."""
    cdef vector[uintptr_t] freed
    if _exiting or not self.cache_off:
        return 0
    freed.push_back(ptr)
    self._lock()
    try:
        _give_back_segments_of(self, freed)
    finally:
        self._unlock()
    return 0


cdef int _give_back_segments_of(CachingAllocator self, vector[uintptr_t]& freed) except -1:
    """With the cache off: the segments holding the blocks at ``freed``
    (just freed: by a call, or once their stream events completed) go back
    to the backend where wholly free, as every free gives its memory back
    then. Lock held; only when held once (the backend is called with it let
    go): from inside another allocator call of this thread the segments
    wait for the next empty_cache."""
    cdef cmap[uintptr_t, Segment*].iterator it
    cdef Segment* seg
    cdef vector[Segment*] victims
    if freed.empty() or not self.cache_off or self.lock_depth != 1 or _exiting:
        return 0
    if self.expandable:
        _unmap_free_pages(self, False, 0)
    for ptr in freed:               # plain segments (a private pool's, with expandable segments)
        it = self.segments_by_base.upper_bound(ptr)
        if it == self.segments_by_base.begin():
            continue
        seg = deref(_map_prev(it)).second
        if ptr < seg.base + seg.size and _segment_is_free(self, seg) and _releasable(seg):
            victims.push_back(seg)
    if victims.empty():
        return 0
    # one entry a segment: two blocks freed in one may name it twice
    cpp_sort(victims.begin(), victims.end())
    victims.erase(cpp_unique(victims.begin(), victims.end()), victims.end())
    _release(self, victims)
    self._drop_unused_streams()
    return 0
