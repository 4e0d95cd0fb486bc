# Included by _core.pyx: expandable segments (expandable_segments:True), as
# PyTorch's ExpandableSegment (c10/cuda/CUDACachingAllocator.cpp) does them.
#
# A segment is then a reserved range of address space, one per (stream, pool)
# until it is full, with memory mapped into it page by page. Its blocks tile
# the whole range: mapped blocks (allocated or free, free ones in the free
# index as usual) and unmapped spans (``Block.unmapped``, indexed by address
# in their pool's ``FreeIndex.unmapped``). A miss maps pages at an unmapped
# span that, with the free block before it, holds the request; ``empty_cache``
# unmaps every whole free page, in the
# middle of a segment too; ``empty_virt_addr_cache`` releases ranges with no
# page mapped (where a miss goes and which holes are unmapped first:
# _core_holes.pxi). Statistics as PyTorch keeps them for expandable segments:
# ``reserved_bytes`` counts mapped bytes, ``segment`` does not count ranges,
# ``num_device_alloc``/``num_device_free`` count map/unmap calls, and
# ``inactive_split`` leaves expandable blocks out.
#
# All of this is on the miss path or in empty_cache (the backend's Python
# methods are called with the GIL and the lock held, as a Python malloc is);
# the hot path only asks ``self.expandable`` where PyTorch's policy differs.

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
    its one block, unmapped. NULL when the backend has no address space left."""
    cdef size_t page = _page_of(self, is_small)
    cdef size_t range_size = _default_range_size(self)
    if range_size < size:
        range_size = size
    range_size = _round_up(range_size, page)
    cdef Segment* seg = <Segment*>calloc(1, sizeof(Segment))
    cdef Block* b = block_new(&self.slab)
    if seg == NULL or b == NULL:
        sys_free(seg)
        if b != NULL:
            block_delete(&self.slab, b)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    cdef uintptr_t base = 0
    try:
        try:
            address = self._vm_reserve(range_size, self.device)
        except MemoryError:
            address = None
        if address is not None:
            base = as_integer(address, "reserve_address_range()")
            if base == 0 or base % self.vm_granularity:
                raise RuntimeError(f"the {self.device_name} backend reserved {base:#x}, which is not "
                                   f"aligned to its granularity ({self.vm_granularity} bytes): a backend error")
            _check_new_segment(self, base, range_size)
    except BaseException:
        sys_free(seg)
        block_delete(&self.slab, b)
        raise
    if base == 0:
        sys_free(seg)
        block_delete(&self.slab, b)
        return NULL
    cdef StreamPools* sp = self._stream_pools(stream)
    if sp == NULL or _span_put((sp.small if is_small else sp.large).unmapped, base, b) != 0:
        sys_free(seg)
        block_delete(&self.slab, b)
        self._vm_release(base, range_size, self.device)
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


cdef inline void _splice_after(Block* b, Block* rest) noexcept nogil:
    rest.prev = b
    rest.next = b.next
    if b.next != NULL:
        b.next.prev = rest
    b.next = rest


cdef int _map_block(CachingAllocator self, Block* b, size_t size) except -1:
    """Map the pages covering the first ``size`` bytes of the unmapped span
    ``b``, which then becomes a free block merged with its free neighbours
    (PyTorch's map_block). 1: done; 0: the device is full (nothing changed)."""
    cdef Segment* seg = b.segment
    cdef size_t n = _round_up(size, seg.page)
    cdef FreeIndex* fi = b.index
    if n > b.size:        # a span left in a hole is whole backend pages only
        n = b.size
    cdef Block* rest = NULL
    cdef int64_t t0
    cdef bint fine = False
    if self.set_fraction and self.total_allocated_memory + n > self.allowed_memory_maximum:
        # Under CuPy's byte limit a request that fits is not refused for the
        # large page the range maps by (as its segment would be just the
        # request): map by the backend's page (4 KiB host pages) and unmap by
        # it from now on (_unmap_page). PyTorch's fraction keeps its pages.
        if not self.limit_in_bytes:
            return 0
        n = min(_round_up(size, self.vm_granularity), b.size)
        if self.total_allocated_memory + n > self.allowed_memory_maximum:
            return 0
        fine = True
    if self.total_allocated_memory + n > MAX_RESERVED:
        return 0
    if um_reserve(&fi.by_size, fi.by_size.count + 1) != 0:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    if n < b.size:
        rest = block_new(&self.slab)
        if rest == NULL:
            raise MemoryError("host memory for the allocator's bookkeeping ran out")
    # The backend's map may run Python that re-enters the allocator: the span
    # is marked as handed out meanwhile, so that a re-entered miss neither
    # maps it too nor counts it as room (see _unmap_block).
    b.allocated = True
    t0 = um_now_ns()
    try:
        self._vm_map(b.ptr, n, self.device)
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
    b.allocated = False
    duration_add(&self.stats.device_alloc_time, (um_now_ns() - t0) // 1000)
    if fine:                       # only once it is mapped: a refused map changes nothing
        seg.finely_mapped = True
    _unindex_span(b)
    if rest != NULL:
        rest.ptr = b.ptr + n
        rest.size = b.size - n
        rest.stream = b.stream
        rest.segment = seg
        rest.index = fi
        rest.is_small = b.is_small
        rest.unmapped = True
        _splice_after(b, rest)
        _index_span(rest)
        b.size = n
    b.unmapped = False
    if self.debug_on:
        memset(<void*>b.ptr, DEBUG_FILL, n)
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
    cdef size_t new_bytes = 0
    cdef Block* c = _find_expandable_block(fi, size, self.policy.max_reserved_ratio != 0.0, &new_bytes)
    cdef Block* nxt
    if self.policy.max_reserved_ratio:
        if c == NULL:
            new_bytes = _round_up(size, _page_of(self, is_small))
        if _unmap_to_ratio(self, size, new_bytes, c.ptr if c != NULL else 0,
                           c.ptr + size if c != NULL else 0):
            # The unmap ran Python, which may have changed the blocks (even
            # dropped and remade the stream's pools): look again.
            fi = self._pool(stream, is_small)
            if fi == NULL:
                raise MemoryError("host memory for the allocator's bookkeeping ran out")
            c = _find_expandable_block(fi, size, self.policy.max_reserved_ratio != 0.0, &new_bytes)
    if c == NULL:
        c = _new_range(self, size, stream, is_small)
        if c == NULL:
            return NULL
    if c.unmapped and not _map_block(self, c, c.size if c.size < size else size):
        return NULL
    while c.size < size:
        # c is free and mapped, followed by unmapped space: map some of it,
        # which merges c into it. A map runs the backend (Python), which may
        # re-enter the allocator (a finalizer) and take c, so that what
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
    """The unmapped span ``b`` was not mapped after all: no longer handed
    out, it joins the unmapped neighbours a call re-entered from the map
    made meanwhile (a free block unmapped to stay under the ratio, which
    could not merge with a span marked handed out)."""
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
    backend's map runs Python, which may re-enter) is left where it is."""
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


cdef Block* _free_piece(CachingAllocator self, Block* like, uintptr_t ptr, size_t size) noexcept nogil:
    """A Block from the slab for a free mapped piece of ``like``'s segment."""
    cdef Block* piece = block_new(&self.slab)
    if piece == NULL:
        return NULL
    piece.ptr = ptr
    piece.size = size
    piece.stream = like.stream
    piece.segment = like.segment
    piece.index = like.index
    piece.is_small = like.is_small
    return piece


cdef inline size_t _whole_pages(Block* b, size_t page) noexcept nogil:
    """Bytes of the whole ``page``-sized pages inside ``b``."""
    cdef Segment* seg = b.segment
    cdef size_t begin = _round_up(b.ptr - seg.base, page)
    cdef size_t end = (b.ptr + b.size - seg.base) // page * page
    return end - begin if end > begin else 0


cdef Block* _split_pages(CachingAllocator self, Block* b, size_t page) except? NULL:
    """Take the whole ``page``-sized pages inside the free block ``b`` off
    the free index, held (``releasing``, event_count 1) so that no path
    hands them out, merges them or unmaps them meanwhile: ``b`` itself,
    shrunk to them. What is left before and after them stays a free block
    (merged with whatever is beside it). NULL when ``b`` holds no whole page."""
    cdef Segment* seg = b.segment
    cdef FreeIndex* fi = b.index
    cdef uintptr_t begin = seg.base + _round_up(b.ptr - seg.base, page)
    cdef uintptr_t end = seg.base + (b.ptr + b.size - seg.base) // page * page
    cdef Block* before = NULL
    cdef Block* after = NULL
    if begin >= end:
        return NULL
    if um_reserve(&fi.by_size, fi.by_size.count + 2) != 0:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    if begin > b.ptr:
        before = _free_piece(self, b, b.ptr, begin - b.ptr)
    if end < b.ptr + b.size:
        after = _free_piece(self, b, end, b.ptr + b.size - end)
    if (begin > b.ptr and before == NULL) or (end < b.ptr + b.size and after == NULL):
        if before != NULL:
            block_delete(&self.slab, before)
        if after != NULL:
            block_delete(&self.slab, after)
        raise MemoryError("host memory for the allocator's bookkeeping ran out")
    fi_remove(fi, b)
    b.releasing = True
    b.event_count = 1
    # The pieces go back to the free index (room for their size classes was
    # reserved above).
    if before != NULL:
        before.prev = b.prev
        before.next = b
        if b.prev != NULL:
            b.prev.next = before
        else:
            seg.head = before
        b.prev = before
        self._try_merge(before, before.prev, fi)
        fi_insert(fi, before)
    if after != NULL:
        _splice_after(b, after)
        self._try_merge(after, after.next, fi)
        fi_insert(fi, after)
    b.ptr = begin
    b.size = end - begin
    self.releasing_bytes += b.size
    return b


cdef int _unmap_held(CachingAllocator self, Block* b, object unmap) except -1:
    """Unmap the pages _split_pages held in ``b`` with ``unmap`` (the
    backend's unmap_pages, or unmap_idle_pages once the work queued before
    the split has completed); ``b`` becomes an unmapped span.
    An unmap that raises may or may not have given the memory back: the
    span is then lost (never mapped or reserved again), counted in
    lost_segments, and the error raised once the state is consistent.

    The backend's unmap may run Python with the lock held (this thread's
    lock is recursive): a finalizer run by garbage collection may free a
    neighbouring block, which merges with its free neighbours, or allocate.
    ``b`` stays held meanwhile (neither merged away nor handed out)."""
    cdef Segment* seg = b.segment
    cdef size_t n = b.size
    cdef int64_t t0
    error = None
    t0 = um_now_ns()
    try:
        unmap(b.ptr, n, self.device)
    except BaseException as exc:
        error = exc
    duration_add(&self.stats.device_free_time, (um_now_ns() - t0) // 1000)
    self.releasing_bytes -= n
    b.releasing = False
    b.event_count = 0
    b.unmapped = True
    seg.mapped -= n
    self.total_allocated_memory -= n
    pool_decrease(&self.stats, S_RESERVED_BYTES, seg.is_small, n)
    self.stats.num_device_free += 1
    if self.recording:
        self._trace(T_SEGMENT_UNMAP, b.ptr, n, b.stream)
    if error is not None:
        b.lost = True
        self.lost_segment_count += 1
        self.lost_segment_bytes += n
        raise error
    _merge_unmapped(self, b, b.prev)
    _merge_unmapped(self, b, b.next)
    _index_span(b)
    return 0


cdef int _unmap_block(CachingAllocator self, Block* b, size_t page) except -1:
    """Unmap the whole ``page``-sized pages inside the free block ``b``
    (PyTorch's unmap_block, by the segment's page; the hole reclaim unmaps
    by the backend's granularity) with the backend's unmap_pages, which
    waits for the device where it must: what is left before and after them
    stays a free block."""
    cdef Block* held = _split_pages(self, b, page)
    if held != NULL:
        _unmap_held(self, held, self._vm_unmap)
    return 0


cdef inline size_t _unmap_page(CachingAllocator self, Segment* seg) noexcept nogil:
    """What empty_cache unmaps by: the segment's page, as PyTorch; with a
    max_reserved_ratio, whose hole reclaim unmaps by the backend's page
    (so a range's mapped spans need not be whole large pages), or once a
    memory limit made _map_block map by the backend's page, that."""
    return self.vm_granularity if self.policy.max_reserved_ratio or seg.finely_mapped else seg.page


cdef Block* _next_to_unmap(CachingAllocator self, bint has_stream, uintptr_t stream,
                           vector[uintptr_t]* refused) noexcept nogil:
    """A mapped free block holding a whole page (of ``stream``'s segments,
    when given) whose unmap was not refused for want of host memory, or NULL."""
    cdef Segment* seg = self.segments
    cdef Block* b
    cdef size_t i
    while seg != NULL:
        if seg.expandable and not (has_stream and seg.stream != stream):
            b = seg.head
            while b != NULL:
                if not b.unmapped and _allocatable(b) and _whole_pages(b, _unmap_page(self, seg)):
                    for i in range(refused.size()):
                        if refused[0][i] == b.ptr:
                            break
                    else:
                        return b
                b = b.next
        seg = seg.next_seg
    return NULL


cdef int _unmap_free_pages(CachingAllocator self, bint has_stream, uintptr_t stream) except -1:
    """Unmap every whole free page of the expandable segments (of ``stream``
    only, when given): PyTorch's release_blocks for expandable segments.
    The first backend error is raised after the other blocks were tried.
    The blocks are looked up afresh after each unmap: a free re-entered from
    the backend's unmap may have merged a block found before it away."""
    cdef vector[uintptr_t] refused
    cdef Block* b
    if not has_stream:
        # The whole cache is emptied: max_reserved_ratio's high-water mark
        # starts again from what is in use now (_core_holes.pxi).
        self.in_use_high_water = <size_t>pool_current(&self.stats, S_ALLOCATED_BYTES)
    b = _next_to_unmap(self, has_stream, stream, &refused)
    first_error = None
    while b != NULL:
        try:
            _unmap_block(self, b, _unmap_page(self, b.segment))
        except MemoryError as exc:
            # b is either left as it was (no host memory for the pieces) or
            # lost and unmapped (the backend raised): never tried twice.
            if not b.unmapped:
                refused.push_back(b.ptr)
            if first_error is None:
                first_error = exc
        except BaseException as exc:
            if first_error is None:
                first_error = exc
        b = _next_to_unmap(self, has_stream, stream, &refused)
    if first_error is not None:
        raise first_error
    return 0


cdef inline bint _range_is_empty(Segment* seg) noexcept nogil:
    """A range with no page mapped, and none being mapped (_map_block marks
    the span it maps allocated while the backend's map runs)."""
    return (seg.expandable and seg.head.next == NULL and seg.head.unmapped and not seg.head.lost
            and not seg.head.allocated)


cdef inline size_t _default_range_size(CachingAllocator self) noexcept nogil:
    """The size of a new range, unless a request needs more."""
    return self.capacity + self.capacity // 8 if self.capacity else DEFAULT_RANGE_SIZE


cdef int _release_empty_ranges(CachingAllocator self, bint has_stream, uintptr_t stream,
                               size_t larger_than=0) except -1:
    """Give back the ranges that hold no mapped page (of ``stream`` only,
    when given; larger than ``larger_than`` bytes only). They leave the
    allocator under the lock and go back to the backend outside it, as
    segments do; a release that raises forgets the range (its address space
    may be gone) and is raised after the others."""
    cdef vector[Segment*] empty
    cdef Segment* seg = self.segments
    cdef StreamPools* sp
    cdef size_t i
    while seg != NULL:
        if (_range_is_empty(seg) and not (has_stream and seg.stream != stream)
                and seg.size > larger_than):
            empty.push_back(seg)
        seg = seg.next_seg
    if empty.empty():
        return 0
    for i in range(empty.size()):
        seg = empty[i]
        _unindex_span(seg.head)
        self._unlink_segment(seg)
        sp = self._stream_pools(seg.stream)
        if sp != NULL:
            sp.n_segments -= 1
            self._drop_stream_if_unused(sp)
    cdef bint outside = self.lock_depth == 1
    first_error = None
    if outside:
        self._unlock()
    try:
        for i in range(empty.size()):
            try:
                self._vm_release(empty[i].base, empty[i].size, self.device)
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
    finally:
        if outside:
            self._lock()
        for i in range(empty.size()):
            block_delete(&self.slab, empty[i].head)
            sys_free(empty[i])
    if first_error is not None:
        raise first_error
    return 0


cdef bint _expandable_teardown(CachingAllocator self, Segment* seg):
    """At the allocator's death: unmap and release a range none of whose
    blocks is in use. Whether it went (False: it stays, with its blocks)."""
    cdef Block* b = seg.head
    while b != NULL:
        if b.allocated or b.event_count > 0 or b.stream_uses != NULL or b.lost:
            return False
        b = b.next
    try:
        b = seg.head
        while b != NULL:
            if not b.unmapped:
                self._vm_unmap(b.ptr, b.size, self.device)
            b = b.next
        self._vm_release(seg.base, seg.size, self.device)
    except BaseException as exc:
        _report_unraisable(exc, "unimem allocator teardown")
    return True


cdef object _empty_virt_addr_cache(CachingAllocator self):
    """CachingAllocator.empty_virt_addr_cache."""
    self._check_usable()
    self._lock()
    try:
        if self.expandable:
            _release_empty_ranges(self, False, 0)
            self._drop_unused_streams()
    finally:
        self._unlock()
    _tell_backend_dropped_streams(self)
    self._flush_trace()


cdef object _reserved_address_space(CachingAllocator self):
    """CachingAllocator.reserved_address_space."""
    cdef Segment* seg
    ranges = size = 0
    self._lock()
    seg = self.segments
    while seg != NULL:
        if seg.expandable:
            ranges += 1
            size += seg.size
        seg = seg.next_seg
    self._unlock()
    return {"ranges": ranges, "bytes": size}
