# Included by _core.pyx: where a request that misses the cache goes in an
# expandable range, and which holes give their pages back first (issue 27).
#
# Each (stream, pool) keeps its unmapped spans by address (FreeIndex.unmapped,
# PyTorch's BlockPool.unmapped), so placing a request looks at the spans, not
# at every block of the range. A request goes where it needs the fewest new
# bytes mapped: after a free block it can extend, or into a hole whose pages
# were unmapped, before the end of the range (with a max_reserved_ratio;
# without one, PyTorch's first span in address order).
#
# With a max_reserved_ratio, mapping more must not take the mapped total above
# the ratio times the high-water mark of memory in use (since empty_cache last
# ran): the free whole pages of holes are unmapped first, the hole that best
# covers the excess first. Measured against the high-water mark, not the
# memory in use at this instant: a working set that shrinks and grows again
# reuses its holes instead of unmapping them at the first miss and mapping
# them again at the next. The peak stays within the ratio all the same (the
# mapped total only grows at a miss). python -m benchmarks memory, random mix
# on the cpu pool: 937 map and 1,408 unmap calls with the instantaneous bound
# and first-fit placement (fe02cf2), 74 and 35 with these rules.
#
# With a max_reserved_ratio, small requests (up to 1 MiB) share the large
# pool's range (CachingAllocator.small_request_max is 0). PyTorch keeps them
# apart so that small blocks do not split large segments; an expandable range
# has no segments to keep whole, and a page of a separate small range stays
# mapped while any of its small blocks lives, where the large requests that
# follow cannot use its free bytes. python -m benchmarks memory, 2 MiB pages:
# creeping sizes 1.354 -> 1.272, random frees 1.527 -> 1.376 (peak reserved /
# peak requested), with fewer map and unmap calls in all (random mix alone
# unmaps more: 36 -> 45 calls, and maps 75 -> 70).
#
# All of this runs on the miss path, with the lock held; the backend calls it
# makes (unmapping holes, recording and asking about their events) let it go
# (_core_expandable.pxi).
#
# A backend whose unmap_pages waits for the device (CUDA: cuMemUnmap does not
# wait for kernels still using the pages, so it synchronizes first) would
# make such a miss wait for every kernel queued. It offers unmap_idle_pages
# instead, and the hole is released stream-ordered: its whole pages are split
# off and held (Block.releasing), an event is recorded on its stream (a free
# block was last used there: other streams' uses were waited for before it
# became free), and the pages are unmapped with unmap_idle_pages once the
# event has completed (at once when the stream is idle; else at a later
# allocation, with the stream events of record_stream frees). Held pages
# count as gone for the bound and as reserved in the statistics until then,
# so reserved_bytes may pass the bound by what the device is still using.
# A map refused for want of memory waits for them first, then for the rest
# (_malloc_slow); empty_cache waits for them as for every event (PyTorch
# waits there too); sleep() leaves them to their own unmap; the allocator's
# teardown unmaps them with unmap_pages.

cdef extern from *:
    """
    #include <map>
    template <class M, class V>
    static inline int um_span_put(M& m, uintptr_t key, V value) {
        try { m[key] = value; return 0; } catch (...) { return -1; }
    }
    """
    # -1 when host memory for the tree node ran out (nothing changed then)
    int _span_put "um_span_put"(cmap[uintptr_t, Block*]& m, uintptr_t key, Block* value) nogil
    cmap[size_t, SizeClass*].iterator _class_prev "um_prev"(cmap[size_t, SizeClass*].iterator it) nogil


cdef inline void _index_span(Block* b) noexcept nogil:
    """Index the unmapped span ``b`` in its pool. Should host memory for the
    entry run out, the span stays out of the index: its address space is then
    not reused for a placement (mapping is always at an indexed span, so an
    unindexed one is never mapped twice); nothing else changes."""
    if not b.lost:
        _span_put(b.index.unmapped, b.ptr, b)


cdef inline void _unindex_span(Block* b) noexcept nogil:
    cdef cmap[uintptr_t, Block*].iterator it = b.index.unmapped.find(b.ptr)
    if it != b.index.unmapped.end() and deref(it).second == b:
        b.index.unmapped.erase(it)


cdef size_t _window_cost(Block* c, size_t size) noexcept nogil:
    """The bytes _expandable_alloc maps to place ``size`` bytes at ``c`` (a
    free block followed by unmapped space, or an unmapped span), taking the
    free and unmapped blocks from ``c`` on; SIZE_MAX when they hold less."""
    cdef size_t left = size
    cdef size_t cost = 0
    cdef size_t n
    while left > 0 and _allocatable(c):
        if c.unmapped:
            n = _round_up(left, c.segment.page)       # as _map_block maps
            if n > c.size:
                n = c.size
            cost += n
        else:
            n = c.size
        left -= n if n < left else left
        c = c.next
    return cost if left == 0 else <size_t>-1


cdef Block* _find_expandable_block(FreeIndex* fi, size_t size, bint fewest,
                                   size_t* new_bytes) noexcept nogil:
    """Where ``size`` bytes go in the pool's ranges: an unmapped span (with
    the free block before it, if any) with room for them; NULL when none has.
    PyTorch takes the first in address order (find_expandable_block): so
    does this without a max_reserved_ratio. With one (``fewest``), the one
    that needs the fewest bytes mapped, the lowest address among equals: no
    new page is mapped at the end of a range while a free block can be
    extended or a hole holds the request with fewer. A span being mapped,
    or pages being unmapped, by a call in flight (_core_expandable.pxi) are
    passed over (``_allocatable``)."""
    cdef cmap[uintptr_t, Block*].iterator it = fi.unmapped.begin()
    cdef Block* b
    cdef Block* c
    cdef Block* best = NULL
    cdef size_t cost
    cdef size_t best_cost = <size_t>-1
    while it != fi.unmapped.end():
        b = deref(it).second
        if _allocatable(b):
            c = b.prev if _allocatable(b.prev) else b
            cost = _window_cost(c, size)
            if cost < best_cost:
                best, best_cost = c, cost
                if not fewest:
                    break
        inc(it)
    new_bytes[0] = best_cost
    return best


cdef inline bint _is_hole(Block* b, uintptr_t lo, uintptr_t hi) noexcept nogil:
    """A mapped free block of a range whose pages may be unmapped: not the
    free end of what its range has mapped (where the range grows, so the
    next request that maps pages there uses it: unmapping it would cost a
    call and map it again) and not inside [lo, hi), where the request that
    asked is about to go."""
    return (b.segment.expandable and _allocatable(b)
            and not (b.next != NULL and b.next.unmapped and b.next.next == NULL)
            and not (b.ptr < hi and b.ptr + b.size > lo))


cdef void _best_hole_in(FreeIndex* fi, size_t need, size_t page, uintptr_t lo, uintptr_t hi,
                        Block** cover, size_t* cover_bytes, Block** largest,
                        size_t* largest_bytes) noexcept nogil:
    """Over one pool's free index: the hole with the fewest whole pages that
    still hold ``need`` bytes (``cover``), and the hole with the most
    (``largest``). A block of ``size`` bytes holds between size - 2 pages
    and size bytes of whole pages, which bounds both searches."""
    cdef cmap[size_t, SizeClass*].iterator it = fi.classes.lower_bound(need)
    cdef SizeClass* sc
    cdef Block* b
    cdef size_t i, n
    while it != fi.classes.end():
        sc = um_second(it)
        if sc.size >= 2 * page and sc.size - 2 * page >= cover_bytes[0]:
            break                       # (cover_bytes starts at SIZE_MAX: no overflow)
        for i in range(sc.heap.size()):
            b = sc.heap[i]
            if _is_hole(b, lo, hi):
                n = _whole_pages(b, page)
                if need <= n < cover_bytes[0]:
                    cover[0], cover_bytes[0] = b, n
        it = um_next(it)
    if cover[0] != NULL:
        return
    it = fi.classes.end()
    while it != fi.classes.begin():
        it = _class_prev(it)
        sc = um_second(it)
        if sc.size <= largest_bytes[0]:
            break
        for i in range(sc.heap.size()):
            b = sc.heap[i]
            if _is_hole(b, lo, hi):
                n = _whole_pages(b, page)
                if n > largest_bytes[0]:
                    largest[0], largest_bytes[0] = b, n


cdef Block* _hole_to_unmap(CachingAllocator self, size_t need, uintptr_t lo, uintptr_t hi) noexcept nogil:
    """The hole, of any stream and pool, whose free whole pages best cover
    ``need`` bytes: the one with the fewest that hold them, else the one with
    the most; NULL when no hole holds a whole page. Found through the free
    indexes, so it is never out of date."""
    cdef Block* cover = NULL
    cdef Block* largest = NULL
    cdef size_t cover_bytes = <size_t>-1
    cdef size_t largest_bytes = 0
    cdef StreamTable.iterator it = self.streams.begin()
    while it != self.streams.end():
        _best_hole_in(deref(it).second.small, need, self.vm_granularity, lo, hi,
                      &cover, &cover_bytes, &largest, &largest_bytes)
        _best_hole_in(deref(it).second.large, need, self.vm_granularity, lo, hi,
                      &cover, &cover_bytes, &largest, &largest_bytes)
        inc(it)
    if cover != NULL:
        return cover
    return largest if largest_bytes >= self.vm_granularity else NULL


cdef bint _unmap_to_ratio(CachingAllocator self, size_t size, size_t new_bytes,
                          uintptr_t lo, uintptr_t hi) except -1:
    """Before mapping ``new_bytes`` for a request of ``size`` placed at
    [lo, hi): while the mapped total would pass max_reserved_ratio times the
    high-water mark of memory in use (the request included), unmap the free
    whole pages (by the backend's page) of the hole that best covers the
    excess. Whether anything was unmapped. Each hole is looked up afresh
    after an unmap, which lets the lock go (see _unmap_held). Maps other
    threads have in flight count as mapped."""
    cdef double in_use = <double>(pool_current(&self.stats, S_ALLOCATED_BYTES) + size)
    cdef double limit
    cdef double excess
    cdef Block* b
    cdef bint unmapped = False
    if in_use > <double>self.in_use_high_water:
        self.in_use_high_water = <size_t>in_use
    limit = self.policy.max_reserved_ratio * <double>self.in_use_high_water
    while True:
        excess = <double>(_held_or_asked(self) - self.releasing_bytes + new_bytes) - limit
        if excess <= 0.0:
            break
        b = _hole_to_unmap(self, <size_t>excess, lo, hi)
        if b == NULL:
            break
        if self._vm_unmap_idle is None:
            _unmap_block(self, b, self.vm_granularity)
        else:
            _release_hole(self, b)
        unmapped = True
    return unmapped


cdef int _release_hole(CachingAllocator self, Block* b) except -1:
    """Unmap the free whole pages of the hole ``b`` stream-ordered: at
    once when the work queued on its stream has completed, else once it has
    (see above). Recording and asking about the event are backend calls,
    made with the lock let go, the pages held meanwhile. Should they fail,
    the pages are unmapped with unmap_pages, which waits for the device, and
    the error is reported as unraisable: the allocation needs no event, and
    one that can never be recorded must not refuse every allocation that
    follows. A Ctrl-C gives the pages back to the free index and reaches
    the caller."""
    cdef Block* held = _split_pages(self, b, self.vm_granularity)
    if held == NULL:
        return 0
    cdef bint done = False
    cdef uint64_t call = _call_out(self, 0)
    event = None
    error = None
    try:
        try:
            event = self.backend.record_event(held.stream, self.device)
            done = _event_done(self, event)
        except BaseException as exc:
            error = exc
    finally:
        _call_back(self, call, 0)
    if error is None and done:
        return _unmap_held(self, held, self._vm_unmap_idle)
    if error is None:
        _add_pending(self, event, held, held.stream)
        return 0
    call = _call_out(self, 0)
    try:
        if isinstance(error, Exception):
            _report_unraisable(error, "unimem: recording a stream event to unmap a hole without waiting "
                                      "(unmapped after waiting for the device instead)")
        if event is not None:
            _release_events(self, [event])
    finally:
        _call_back(self, call, 0)
        if isinstance(error, Exception):
            _unmap_held(self, held, self._vm_unmap)
        else:
            _unsplit(self, held)
    if not isinstance(error, Exception):
        raise error
    return 0


cdef Block* _take_back_held(CachingAllocator self, FreeIndex* fi, size_t size) except? NULL:
    """A miss in ``fi`` (one stream's pool) first takes back every held hole
    of that pool: work queued on that stream runs after the work that used
    them, so they may be reused at once, as any free block is; only
    unmapping them had to wait. Back in the free index they merge with their
    free neighbours, and the request takes the best fit there; what the
    bound still needs is held again (_unmap_to_ratio). Pages held out of
    reach instead, unable to merge with blocks freed beside them, raised the
    reserved peak far above the unbounded policy's while the stream ran
    behind (python -m benchmarks memory, 2 MiB pages, the stream 500 frees
    behind: growing_generation 2.126 against 1.210 unbounded, 1.155 with
    this). Their events stay pending with no block (address 0), waited for
    and dropped as the others. No Python runs. NULL when nothing fits."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef size_t i
    cdef Block* c
    cdef bint taken = False
    while it != self.stream_events.queues.end():
        for i in range(deref(it).second.size()):
            c = <Block*>deref(it).second[i].block
            if c != NULL and c.releasing and c.index == fi:
                deref(it).second[i].block = NULL
                _unsplit(self, c)
                taken = True
        inc(it)
    return self._get_free_block(fi, size) if taken else NULL


cdef bint _event_done(CachingAllocator self, object event) except -1:
    query = getattr(self.backend, "event_done", None)
    return True if query is None else bool(query(event))


cdef int _unsplit(CachingAllocator self, Block* b) except -1:
    """Give the pages _split_pages held back to the free index, unmapped
    never: as a free block merged with its free neighbours."""
    self.releasing_bytes -= b.size
    b.releasing = False
    b.event_count = 0
    self._try_merge(b, b.prev, b.index)
    self._try_merge(b, b.next, b.index)
    fi_insert(b.index, b)
    return 0


cdef int _unmap_released(CachingAllocator self, list held) except -1:
    """Unmap the held pages (block addresses) whose event has completed,
    with unmap_idle_pages."""
    return _unmap_each(self, held, self._vm_unmap_idle)


cdef int _unmap_each(CachingAllocator self, list held, object unmap) except -1:
    """_unmap_held for each of ``held`` (block addresses): every one is
    unmapped (or lost) before the first error is raised."""
    error = None
    for address in held:
        try:
            _unmap_held(self, <Block*><uintptr_t>address, unmap)
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error
    return 0


cdef int _unmap_held_now(CachingAllocator self) except -1:
    """Unmap every held hole whose event is still pending with unmap_pages,
    which waits for the device where it must (the allocator's teardown:
    no other thread can reach it)."""
    cdef cmap[uintptr_t, um_event_queue].iterator it = self.stream_events.queues.begin()
    cdef size_t i
    cdef um_pending_event* e
    held = []
    events = []
    while it != self.stream_events.queues.end():
        i = 0
        while i < deref(it).second.size():
            e = &deref(it).second[i]
            if _is_held(<uintptr_t>e.block) and not e.taken:
                held.append(<uintptr_t>e.block)
                if e.event != NULL:
                    events.append(<object>e.event)
                um_events_erase(self.stream_events, deref(it).second, i)
            else:
                i += 1
        inc(it)
    _prune_empty_queues(self)
    if not held:
        return 0
    _release_events(self, events)
    del events
    _drop_released_events(self)
    self._lock()                  # which _unmap_held lets go around each call
    try:
        return _unmap_each(self, held, self._vm_unmap)
    finally:
        self._unlock()


cdef inline bint _is_held(uintptr_t address) noexcept nogil:
    """Whether a pending event's block is pages held to unmap (0: taken back)."""
    return address != 0 and (<Block*>address).releasing

