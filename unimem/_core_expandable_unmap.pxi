# Included by _core.pyx: expandable segments giving memory back (see
# _core_expandable.pxi): the whole free pages empty_cache unmaps (PyTorch's
# release_blocks for expandable segments) and the hole reclaim of
# _core_holes.pxi holds and unmaps, the ranges empty_virt_addr_cache
# releases, and what goes at the allocator's death. Every backend call is
# made with the lock let go, what it is about held meanwhile (pages being
# unmapped) or out of the allocator already (ranges being released).


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

    The backend is called with the lock let go. ``b`` stays held meanwhile
    (neither merged away, handed out nor unmapped twice), while the blocks
    beside it may be freed, merged, taken or unmapped: they are looked at
    only after, when ``b`` joins the unmapped spans beside it."""
    cdef Segment* seg = b.segment
    cdef size_t n = b.size
    cdef int64_t took = 0
    cdef uint64_t call = _call_out(self, 0)
    error = None
    try:
        took = um_now_ns()
        try:
            unmap(b.ptr, n, self.device)
        except BaseException as exc:
            error = exc
        took = um_now_ns() - took
    finally:
        _call_back(self, call, 0)
    duration_add(&self.stats.device_free_time, took // 1000)
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
    The blocks are looked up afresh after each unmap, which lets the lock
    go: a free meanwhile may have merged a block found before it away."""
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
    """A range with no page mapped, and none being mapped (a span in flight
    is marked allocated, see _core_expandable.pxi)."""
    return (seg.expandable and seg.head.next == NULL and seg.head.unmapped and not seg.head.lost
            and not seg.head.allocated)


cdef int _release_empty_ranges(CachingAllocator self, bint has_stream, uintptr_t stream,
                               size_t larger_than=0) except -1:
    """Give back the ranges that hold no mapped page (of ``stream`` only,
    when given; larger than ``larger_than`` bytes only). They leave the
    allocator under the lock and go back to the backend with it let go, as
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
    cdef uint64_t call = _call_out(self, 0)
    first_error = None
    try:
        for i in range(empty.size()):
            try:
                self._vm_release(empty[i].base, empty[i].size, self.device)
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
    finally:
        _call_back(self, call, 0)
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
