# Included by _core.pyx: expandable segments (expandable_segments:True), as
# PyTorch's ExpandableSegment (c10/cuda/CUDACachingAllocator.cpp) does them.
#
# A segment is then a reserved range of address space, one per (stream, pool)
# until it is full, with memory mapped into it page by page. Its blocks tile
# the whole range: mapped blocks (allocated or free, free ones in the free
# index as usual) and unmapped spans (``Block.unmapped``, indexed by address
# in their pool's ``FreeIndex.unmapped``). A miss maps pages at an unmapped
# span that, with the free block before it, holds the request (this file);
# ``empty_cache`` unmaps every whole free page, in the middle of a segment
# too, and ``empty_virt_addr_cache`` releases ranges with no page mapped
# (_core_expandable_unmap.pxi); where a miss goes and which holes are
# unmapped first: _core_holes.pxi. Statistics as PyTorch keeps them for
# expandable segments: ``reserved_bytes`` counts mapped bytes, ``segment``
# does not count ranges, ``num_device_alloc``/``num_device_free`` count
# map/unmap calls, and ``inactive_split`` leaves expandable blocks out.
#
# The backend's virtual-memory calls (reserve_address_range, map_pages,
# unmap_pages, unmap_idle_pages, release_address_range: Python methods) are
# made with the core's lock let go, as _alloc_block asks for a plain
# segment: decided under the lock, called outside it, committed or undone
# under it again. Meanwhile other threads' cache hits, frees and misses go
# on, and a free the call's own Python makes (a finalizer) is an ordinary
# one. What a call is about is marked so that no path (another thread's, or
# that Python's) hands it out, merges it, maps, unmaps or releases it; this
# is the one "call in flight" state:
#   * a span being mapped is an unmapped span marked allocated (undone by
#     _unmark_span): placements pass it over (_allocatable), it merges with
#     no unmapped neighbour (_merge_unmapped), and its range is not empty
#     (_range_is_empty);
#   * pages being unmapped are held as _split_pages holds them (releasing,
#     event_count 1): off the free index, never merged (block_mergeable), and
#     in no event queue meanwhile (_take_back_held takes back only pages
#     still waiting for their stream's event);
#   * a range being reserved or released is in no table at all: a new one is
#     linked once reserved, an empty one unlinked before it goes.
# The range of a span in flight holds its stream's pools (n_segments), so
# the span's free index outlives the call. A map's bytes count against the
# limits while it is in flight (in_flight_bytes), so that two misses cannot
# pass a memory fraction together; every call here is noted as in flight
# (_call_out), and a miss refused meanwhile, or one that would reserve a
# range while another thread's call may make room, waits for them and looks
# again (_wait_for_calls_in_flight), as it would have had it waited for the
# lock. After a call, what may have changed is read again: the blocks beside
# the span (freed, merged away, taken), and a sleep() that came in (the new
# pages go back and the request is refused, as _alloc_block does). A call
# made while this thread holds the lock more than once (re-entered from a
# backend call still made under the lock) keeps it held: the marks then
# guard against that call's Python alone, whose frees take the (recursive)
# lock again, or go to the inbox where they need stream events recorded.
#
# The hot path only asks ``self.expandable`` where PyTorch's policy differs.

# PyTorch sizes each range at 1 1/8 of the device's memory, so that a segment
# can grow to the whole device even when some of its pages had to be
# unmapped in the middle and others mapped at its end. Address space costs
# nothing until mapped (CUDA VA space is 2**47 bytes and more; host mmap of
# PROT_NONE reserves no memory). When the capacity is not known: 64 GiB.
cdef size_t DEFAULT_RANGE_SIZE = <size_t>64 << 30
# Pages are mapped by 2 MiB (the CUDA granularity), or by the backend's
# granularity if larger, in both pools. PyTorch maps the small pool by 2 MiB
# (kSmallBuffer) and the large pool by 20 MiB (kLargeBuffer); 2 MiB keeps
# reserved memory within a page of what is in use per range. On a backend
# with smaller pages (4 KiB host pages) mapping the small pool page by page
# cost a map call for nearly every miss (python -m benchmarks memory: 840
# map calls on the random-frees trace, 212 with 2 MiB); holes are still
# unmapped by the backend's page (_core_holes.pxi).
cdef size_t LARGE_PAGE = <size_t>2 << 20


cdef inline size_t _default_range_size(CachingAllocator self) noexcept nogil:
    """The size of a new range, unless a request needs more."""
    return self.capacity + self.capacity // 8 if self.capacity else DEFAULT_RANGE_SIZE


cdef int _setup_expandable(CachingAllocator self, object backend, int device, str name) except -1:
    """Check that ``backend`` can reserve address space and map memory into
    it (a non-zero ``virtual_memory_granularity(device)``) and keep its four
    calls. Raises NotImplementedError naming the backend when it cannot."""
    ask = getattr(backend, "virtual_memory_granularity", None)
    reason = ""
    granularity = 0
    if ask is not None:
        try:
            granularity = as_integer(ask(device), "virtual_memory_granularity()")
        except NotImplementedError as exc:     # a backend that says why it cannot
            reason = str(exc)
            granularity = 0
    if granularity == 0:
        raise NotImplementedError(
            f"expandable_segments:True needs a backend that can reserve address space and map "
            f"memory into it; the {name} backend ({type(backend).__name__}) cannot on device {device}"
            + (f": {reason}" if reason else ""))
    if granularity < 0 or granularity & (granularity - 1) or granularity > LARGE_PAGE * 512:
        raise ValueError(f"the {name} backend's virtual_memory_granularity({device}) must be a "
                         f"power of two, got {granularity}")
    self._vm_reserve = backend.reserve_address_range
    self._vm_map = backend.map_pages
    self._vm_unmap = backend.unmap_pages
    self._vm_release = backend.release_address_range
    # A backend whose unmap_pages waits for the device (CUDA) offers an unmap
    # for pages no queued work uses: holes are then released stream-ordered.
    if getattr(backend, "record_event", None) is not None:
        self._vm_unmap_idle = getattr(backend, "unmap_idle_pages", None)
    self.vm_granularity = granularity
    self.expandable = True
    return 0


cdef inline size_t _page_of(CachingAllocator self, bint is_small) noexcept nogil:
    """What a range of either pool maps by (see LARGE_PAGE)."""
    return self.vm_granularity if self.vm_granularity >= LARGE_PAGE else LARGE_PAGE


cdef inline size_t _round_up(size_t n, size_t page) noexcept nogil:
    return (n + page - 1) // page * page


cdef inline bint _allocatable(Block* b) noexcept nogil:
    """Free (mapped or not) and waiting for nothing: PyTorch's ``allocatable``."""
    return (b != NULL and not b.allocated and b.event_count == 0 and b.stream_uses == NULL
            and not b.lost)


cdef inline size_t _expandable_size(Block* b) noexcept nogil:
    """What a free block can grow to without moving: its size and the
    unmapped span after it (PyTorch's ``expandable_size``)."""
    if b.next != NULL and b.next.unmapped and not b.next.lost:
        return b.size + b.next.size
    return b.size


cdef Block* _next_in_size_order(FreeIndex* fi, Block* b, SizeClass** found) noexcept nogil:
    """The free block after ``b`` in (size, address) order: PyTorch's
    ``pool.blocks`` iterator, over the size classes of the free index."""
    cdef SizeClass* sc = <SizeClass*>um_find(&fi.by_size, b.size)
    cdef Block* best = NULL
    cdef Block* c
    cdef size_t i
    for i in range(sc.heap.size()):
        c = sc.heap[i]
        if c.ptr > b.ptr and (best == NULL or c.ptr < best.ptr):
            best = c
    if best != NULL:
        found[0] = sc
        return best
    cdef cmap[size_t, SizeClass*].iterator it = fi.classes.upper_bound(b.size)
    while it != fi.classes.end():
        sc = um_second(it)
        if not sc.heap.empty():
            found[0] = sc
            return sc.heap[0]
        it = um_next(it)
    return NULL


cdef Block* _prefer_unexpandable(FreeIndex* fi, Block* b, SizeClass** found) noexcept nogil:
    """PyTorch's get_free_block with expandable segments: a block followed by
    unmapped space counts as the size it can grow to, so the best fit moves on
    while the next block in (size, address) order can grow to less. This
    keeps the end of a segment for requests that need it to grow."""
    cdef SizeClass* sc
    cdef Block* nxt = _next_in_size_order(fi, b, &sc)
    while nxt != NULL and _expandable_size(nxt) < _expandable_size(b):
        b = nxt
        found[0] = sc
        nxt = _next_in_size_order(fi, b, &sc)
    return b


cdef Block* _new_range(CachingAllocator self, size_t size, uintptr_t stream, bint is_small) except? NULL:
    """Reserve a new range for (stream, pool), big enough for ``size``:
    its one block, unmapped. NULL when the backend has no address space left.
    Reserved with the lock let go: the range joins the allocator (and the
    stream's pools, which may have been dropped meanwhile, are looked up)
    only after."""
    cdef size_t page = _page_of(self, is_small)
    cdef size_t range_size = _default_range_size(self)
    if range_size < size:
        range_size = size
    range_size = _round_up(range_size, page)
    cdef uintptr_t base = 0
    cdef uint64_t call = _call_out(self, 0)
    try:
        try:
            address = self._vm_reserve(range_size, self.device)
        except MemoryError:
            address = None
        if address is not None:
            base = as_integer(address, "reserve_address_range()")
    finally:
        _call_back(self, call, 0)
    if address is None:
        return NULL
    if base == 0 or base % self.vm_granularity:
        raise RuntimeError(f"the {self.device_name} backend reserved {base:#x}, which is not "
                           f"aligned to its granularity ({self.vm_granularity} bytes): a backend error")
    _check_new_segment(self, base, range_size)
    cdef Segment* seg = <Segment*>calloc(1, sizeof(Segment))
    cdef Block* b = block_new(&self.slab)
    cdef StreamPools* sp = self._stream_pools(stream) if seg != NULL and b != NULL else NULL
    if sp == NULL or _span_put((sp.small if is_small else sp.large).unmapped, base, b) != 0:
        sys_free(seg)
        if b != NULL:
            block_delete(&self.slab, b)
        call = _call_out(self, 0)
        try:
            self._vm_release(base, range_size, self.device)
        finally:
            _call_back(self, call, 0)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    seg.base = base
    seg.size = range_size
    seg.stream = stream
    seg.is_small = is_small
    seg.head = b
    seg.expandable = True
    seg.page = page
    seg.mapped = 0
    self._link_segment(seg)
    sp.n_segments += 1
    b.ptr = base
    b.size = range_size
    b.stream = stream
    b.segment = seg
    b.is_small = is_small
    b.index = sp.small if is_small else sp.large
    b.unmapped = True
    return b


cdef uint64_t _call_out(CachingAllocator self, size_t mapped_bytes) noexcept:
    """Let the lock go for a backend call that maps ``mapped_bytes`` (0: one
    that maps nothing): they count against the limits until _call_back, and
    misses refused meanwhile wait for the call (_wait_for_calls_in_flight).
    Its number, for _call_back. What the call is about is marked first."""
    cdef uint64_t number = _note_call_in_flight(self, mapped_bytes)
    self._unlock()
    return number


cdef void _call_back(CachingAllocator self, uint64_t number, size_t mapped_bytes) noexcept:
    """Take the lock again after the call ``number``: its bytes are no
    longer in flight (what it mapped is counted by its commit)."""
    self._lock()
    # (never below 0: a fork in the call's own Python zeroed it in the child)
    self.in_flight_bytes = self.in_flight_bytes - mapped_bytes if self.in_flight_bytes > mapped_bytes else 0
    _forget_call_in_flight(self, number)


cdef inline void _splice_after(Block* b, Block* rest) noexcept nogil:
    rest.prev = b
    rest.next = b.next
    if b.next != NULL:
        b.next.prev = rest
    b.next = rest


cdef int _map_block(CachingAllocator self, Block* b, size_t size) except -1:
    """Map the pages covering the first ``size`` bytes of the unmapped span
    ``b``, which then becomes a free block merged with its free neighbours
    (PyTorch's map_block). 1: done; 0: the device is full (nothing changed).
    The span is marked allocated while the backend maps it with the lock let
    go (see above), its bytes counted against the limits."""
    cdef Segment* seg = b.segment
    cdef size_t n = _round_up(size, seg.page)
    cdef FreeIndex* fi = b.index
    if n > b.size:        # a span left in a hole is whole backend pages only
        n = b.size
    cdef Block* rest = NULL
    cdef int64_t took = 0
    cdef bint fine = False
    cdef uint64_t call
    # A call made before this one let the lock go: a sleep() may have come in.
    _refuse_if_asleep(self, NULL)
    if self.set_fraction and _held_or_asked(self) + n > self.allowed_memory_maximum:
        # Under CuPy's byte limit a request that fits is not refused for the
        # large page the range maps by (as its segment would be just the
        # request): map by the backend's page (4 KiB host pages) and unmap by
        # it from now on (_unmap_page). PyTorch's fraction keeps its pages.
        if not self.limit_in_bytes:
            return 0
        n = min(_round_up(size, self.vm_granularity), b.size)
        if _held_or_asked(self) + n > self.allowed_memory_maximum:
            return 0
        fine = True
    if _held_or_asked(self) + n > MAX_RESERVED:
        return 0
    if n < b.size:
        rest = block_new(&self.slab)
        if rest == NULL:
            raise MemoryError("host memory for the allocator's bookkeeping ran out")
    b.allocated = True                  # being mapped: a call in flight
    call = _call_out(self, n)
    try:
        try:
            took = um_now_ns()
            self._vm_map(b.ptr, n, self.device)
            took = um_now_ns() - took
        finally:
            _call_back(self, call, n)
    except MemoryError:
        _unmark_span(self, b)
        if rest != NULL:
            block_delete(&self.slab, rest)
        return 0
    except BaseException:
        _unmark_span(self, b)
        if rest != NULL:
            block_delete(&self.slab, rest)
        raise
    if self.sleeping or um_reserve(&fi.by_size, fi.by_size.count + 1) != 0:
        # A whole-device sleep came in meanwhile (it leaves no page mapped),
        # or no host memory is left for the free block's size class: the
        # pages go back, and the request is refused.
        _unmap_unkept(self, b, n, rest)
        _refuse_if_asleep(self, NULL)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    duration_add(&self.stats.device_alloc_time, took // 1000)
    if fine:                       # only once it is mapped: a refused map changes nothing
        seg.finely_mapped = True
    b.allocated = False
    _unindex_span(b)
    if rest != NULL:
        _split_span(self, b, n, rest)
    b.unmapped = False
    if self.debug_on:
        memset(<void*>b.ptr, DEBUG_FILL, n)
    # Its neighbours as they are now: freed, taken or merged away meanwhile.
    self._try_merge(b, b.prev, fi)
    self._try_merge(b, b.next, fi)
    fi_insert(fi, b)          # its size class was reserved above
    seg.mapped += n
    self.total_allocated_memory += n
    pool_increase(&self.stats, S_RESERVED_BYTES, seg.is_small, n)
    self.stats.num_device_alloc += 1
    if self.recording:
        self._trace(T_SEGMENT_MAP, b.ptr, n, b.stream)
    return 1


cdef void _split_span(CachingAllocator self, Block* b, size_t n, Block* rest) noexcept nogil:
    """The span ``b`` (out of the span index) keeps its first ``n`` bytes;
    ``rest`` becomes the unmapped span of the others, after it, merged with
    an unmapped span after that (one an unmap committed beside ``b`` while
    it was being mapped, which could not merge with it), and indexed."""
    rest.ptr = b.ptr + n
    rest.size = b.size - n
    rest.stream = b.stream
    rest.segment = b.segment
    rest.index = b.index
    rest.is_small = b.is_small
    rest.unmapped = True
    _splice_after(b, rest)
    _merge_unmapped(self, rest, rest.next)
    _index_span(rest)
    b.size = n


cdef int _unmap_unkept(CachingAllocator self, Block* b, size_t n, Block* rest) except -1:
    """The ``n`` bytes just mapped at the start of the span ``b`` (still
    marked, never counted) cannot be kept: they are unmapped again with the
    lock let go, and ``b`` is an unmapped span as before. An unmap that
    raises loses them (they may still be mapped: never mapped, counted or
    released again; in lost_segments), and its error is raised."""
    cdef uint64_t call = _call_out(self, 0)
    try:
        try:
            self._vm_unmap(b.ptr, n, self.device)
        finally:
            _call_back(self, call, 0)
    except BaseException:
        b.allocated = False
        _unindex_span(b)
        if rest != NULL:
            _split_span(self, b, n, rest)
        b.lost = True
        self.lost_segment_count += 1
        self.lost_segment_bytes += n
        raise
    if rest != NULL:
        block_delete(&self.slab, rest)
    _unmark_span(self, b)
    return 0


cdef Block* _expandable_alloc(CachingAllocator self, size_t size, uintptr_t stream, bint is_small,
                              bint is_retry) except? NULL:
    """A free block of at least ``size`` bytes made by mapping pages
    (PyTorch's try_allocate_expandable_block), taken off the free index;
    NULL when the device (or address space) is full. Pages mapped before a
    refused map stay mapped and cached, as in PyTorch. With a
    max_reserved_ratio, holes are unmapped first (_unmap_to_ratio)."""
    if is_retry:
        self.stats.num_alloc_retries += 1
    _refuse_if_asleep(self, NULL)      # as _alloc_block: a reclaim before may have let a sleep() in
    cdef FreeIndex* fi = self._pool(stream, is_small)
    if fi == NULL:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    cdef bint fewest = self.policy.max_reserved_ratio != 0.0
    cdef size_t new_bytes = 0
    cdef Block* c = _find_expandable_block(fi, size, fewest, &new_bytes)
    cdef Block* nxt
    if self.policy.max_reserved_ratio:
        if c == NULL:
            new_bytes = _round_up(size, _page_of(self, is_small))
        if _unmap_to_ratio(self, size, new_bytes, c.ptr if c != NULL else 0,
                           c.ptr + size if c != NULL else 0):
            # The unmaps let the lock go: the blocks may have changed (even
            # the stream's pools been dropped and made again): look again.
            fi = self._pool(stream, is_small)
            if fi == NULL:
                raise MemoryError("host memory for the allocator's bookkeeping ran out")
            c = _find_expandable_block(fi, size, fewest, &new_bytes)
    if c == NULL and _wait_for_calls_in_flight(self):
        # No room, while other threads' calls were in flight: a span they
        # map was passed over, and what they map may hold the request. Once
        # they are done it looks again, as it would have had it waited for
        # the lock, before reserving a range of its own.
        c = _take_cached_again(self, size, stream, is_small)
        if c != NULL:
            return c
        fi = self._pool(stream, is_small)
        if fi == NULL:
            raise MemoryError("host memory for the allocator's bookkeeping ran out")
        c = _find_expandable_block(fi, size, fewest, &new_bytes)
    if c == NULL:
        c = _new_range(self, size, stream, is_small)
        if c == NULL:
            return NULL
    if c.unmapped and not _map_block(self, c, c.size if c.size < size else size):
        return NULL
    while c.size < size:
        # c is free and mapped, followed by unmapped space: map some of it,
        # which merges c into it. The map lets the lock go: another thread
        # (or a finalizer the call runs) may take c meanwhile, so that what
        # follows the newly mapped block is no longer unmapped: then the
        # request looks for its place again (the pages mapped stay cached).
        nxt = c.next
        if nxt == NULL or not nxt.unmapped or nxt.allocated or nxt.lost:
            return _expandable_alloc(self, size, stream, is_small, False)
        if not _map_block(self, nxt, nxt.size if nxt.size < size - c.size else size - c.size):
            return NULL
        c = nxt
    fi_remove(c.index, c)
    return c


cdef void _unmark_span(CachingAllocator self, Block* b) noexcept nogil:
    """The unmapped span ``b`` was not mapped after all (or its pages went
    back): no longer marked, it joins the unmapped neighbours made while the
    map was in flight (a free block unmapped by empty_cache or to stay under
    the ratio, which could not merge with a span being mapped)."""
    b.allocated = False
    if ((b.prev != NULL and b.prev.unmapped and not b.prev.lost and not b.prev.allocated)
            or (b.next != NULL and b.next.unmapped and not b.next.lost and not b.next.allocated)):
        _unindex_span(b)
        _merge_unmapped(self, b, b.prev)
        _merge_unmapped(self, b, b.next)
        _index_span(b)


cdef void _merge_unmapped(CachingAllocator self, Block* dst, Block* src) noexcept nogil:
    """Merge the unmapped span ``src`` into its neighbour ``dst`` (not yet
    indexed). A span being mapped (marked allocated by _map_block while the
    backend maps it with the lock let go) is left where it is."""
    if src == NULL or not src.unmapped or src.lost or src.allocated:
        return
    _unindex_span(src)
    if dst.prev == src:
        dst.ptr = src.ptr
        dst.prev = src.prev
        if dst.prev != NULL:
            dst.prev.next = dst
        else:
            dst.segment.head = dst
    else:
        dst.next = src.next
        if dst.next != NULL:
            dst.next.prev = dst
    dst.size += src.size
    block_delete(&self.slab, src)


