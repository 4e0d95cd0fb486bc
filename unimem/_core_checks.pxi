# Included by _core.pyx: checks off the hot path. The policy options given to
# CachingAllocator(); a new segment from the backend, which must not overlap
# memory the allocator already holds; and, for the tests, the whole
# allocator's consistency (segments, free index, statistics).

cdef int _check_new_segment(CachingAllocator self, uintptr_t ptr, size_t size) except -1:
    """A backend that hands out memory this allocator already holds would
    give two owners the same bytes: refuse it (the memory is not given
    back, since freeing it could free the live segment)."""
    if ptr > <uintptr_t>-1 - size:
        raise RuntimeError(f"the {self.device_name} backend returned {ptr:#x} for {size} bytes: "
                           f"that range wraps around the address space (a backend error)")
    cdef Segment* clash = _segment_clash(self, ptr, size)
    if clash != NULL:
        raise RuntimeError(
            f"the {self.device_name} backend returned {ptr:#x} ({size} bytes), which overlaps "
            f"memory it already gave this allocator ({clash.base:#x}, {clash.size} bytes): "
            f"a backend error; nothing was allocated")
    return 0


cdef Segment* _segment_clash(CachingAllocator self, uintptr_t ptr, size_t size) noexcept nogil:
    """A segment of this allocator that [ptr, ptr + size) overlaps, or NULL
    (the range must not wrap around the address space)."""
    cdef cmap[uintptr_t, Segment*].iterator it = self.segments_by_base.upper_bound(ptr)
    if it != self.segments_by_base.end() and deref(it).first < ptr + size:
        return deref(it).second
    if it != self.segments_by_base.begin():
        it = _map_prev(it)
        if deref(it).second.base + deref(it).second.size > ptr:
            return deref(it).second
    return NULL


def _check_invariants(CachingAllocator self):
    """Verify the allocator's internal consistency (for tests): segments
    tile their memory, the free index holds exactly the free blocks, and
    every statistic equals what the blocks say. Raises AssertionError."""
    cdef Segment* seg
    cdef Block* b
    cdef FreeIndex* fi
    cdef SizeClass* sc
    cdef StatValues s
    cdef size_t k
    cdef int p
    cdef StreamTable.iterator it
    expect = {name: [0, 0, 0] for name in _CORE_STAT_NAMES}
    segment_streams = []
    stream_use_count = {}
    n_free_blocks = 0
    n_unmapped_spans = 0
    self._lock()
    try:
        # asleep (_core_sleep.pxi): memory given back is not reserved, and
        # the held blocks that were free are free all the same
        given_back, held_free = _sleep_accounting(self)
        waiting = set(_pending_blocks(self))
        recording = {<uintptr_t>self.stream_events.recording[k] for k in range(self.stream_events.recording.size())}
        releasing = 0
        seg = self.segments
        reserved = 0
        while seg != NULL:
            asleep_bytes = given_back.get(<uintptr_t>seg, 0)
            assert seg.head.prev == NULL and seg.head.ptr == seg.base, "segment head"
            segment_streams.append((seg.pool.id if seg.pool != NULL else 0, seg.stream))
            assert self.segments_by_base[seg.base] == seg, "segment indexed by its base"
            p = POOL_SMALL if seg.is_small else POOL_LARGE
            if not seg.expandable:      # a range is no segment; its mapped pages are reserved
                for pool in (POOL_ALL, p):
                    expect["segment"][pool] += 1
                    expect["reserved_bytes"][pool] += seg.size - asleep_bytes
                reserved += seg.size - asleep_bytes
            mapped = 0
            b = seg.head
            cursor = seg.base
            while b != NULL:
                assert b.ptr == cursor, "blocks must tile their segment"
                assert b.segment == seg and b.is_small == seg.is_small and b.stream == seg.stream
                assert b.size > 0 and b.size % K_MIN_BLOCK == 0
                assert b.client < N_CLIENTS, "a block's client is one of CLIENTS"
                assert b.allocated or b.event_count > 0 or b.unmapped or b.client == CLIENT_NONE, \
                    "a free block has no client"
                if b.next != NULL:
                    assert b.next.prev == b
                cursor += b.size
                if b.unmapped or b.lost:
                    assert seg.expandable and b.unmapped and not b.allocated and b.event_count == 0, \
                        "only expandable segments have unmapped spans, never in use"
                    assert (b.ptr - seg.base) % self.vm_granularity == 0 and b.size % self.vm_granularity == 0, \
                        "unmapped spans are whole backend pages"
                    if not b.lost:
                        assert b.prev == NULL or not b.prev.unmapped or b.prev.lost, "unmapped spans merge"
                        assert (b.index.unmapped.count(b.ptr) == 1 and b.index.unmapped[b.ptr] == b
                                and b.index == (self._stream_pools(b.stream).small if b.is_small
                                                else self._stream_pools(b.stream).large)), \
                            "an unmapped span is indexed by its address in its stream's pool"
                        n_unmapped_spans += 1
                    b = b.next
                    continue
                if seg.expandable:
                    mapped += b.size
                    if b.prev == NULL or b.prev.unmapped:
                        assert (b.ptr - seg.base) % self.vm_granularity == 0, "mapped memory starts at a page"
                    if b.next == NULL or b.next.unmapped:
                        assert (b.ptr + b.size - seg.base) % self.vm_granularity == 0, "mapped memory ends at a page"
                    for pool in (POOL_ALL, p):
                        expect["reserved_bytes"][pool] += b.size
                split = seg.head.next != NULL and not seg.expandable
                for pool in (POOL_ALL, p):
                    if b.allocated:
                        expect["allocation"][pool] += 1
                        expect["allocated_bytes"][pool] += b.size
                    if b.allocated or (b.event_count > 0 and not b.releasing
                                       and <uintptr_t>b not in held_free):
                        expect["active"][pool] += 1
                        expect["active_bytes"][pool] += b.size
                        expect["requested_bytes"][pool] += b.requested_size
                    elif split:
                        expect["inactive_split"][pool] += 1
                        expect["inactive_split_bytes"][pool] += b.size
                if b.stream_uses != NULL:
                    for k in range(b.stream_uses.size()):
                        use = b.stream_uses[0][k]
                        stream_use_count[use] = stream_use_count.get(use, 0) + 1
                if b.releasing:
                    assert seg.expandable and not b.allocated and b.event_count == 1, "held pages wait for one event"
                    assert <uintptr_t>b in waiting, "held pages wait for an event"
                    releasing += b.size
                if b.allocated and <uintptr_t>b in recording:
                    assert um_find(&self.active, b.ptr) == NULL, "a block whose events are recorded is not indexed"
                elif b.allocated:
                    assert um_find(&self.active, b.ptr) == <void*>b, "allocated block is indexed"
                elif b.event_count == 0:
                    n_free_blocks += 1
                    fi = self._pool_of(b)
                    sc = <SizeClass*>um_find(&fi.by_size, b.size)
                    assert sc != NULL and b.size_class == sc and b.heap_pos < sc.heap.size() and sc.heap[b.heap_pos] == b, \
                        "free block is in its size class"
                    assert b.prev == NULL or b.prev.allocated or b.prev.event_count > 0 or b.prev.unmapped, \
                        "free neighbours merge"
                b = b.next
            assert cursor == seg.base + seg.size, "blocks cover their segment"
            if seg.expandable:
                assert mapped == seg.mapped, "a range counts its mapped bytes"
                reserved += mapped - asleep_bytes
                for pool in (POOL_ALL, p):
                    expect["reserved_bytes"][pool] -= asleep_bytes
            seg = seg.next_seg
        assert reserved == self.total_allocated_memory
        assert releasing == self.releasing_bytes, "the allocator counts the pages held to unmap"
        indexed = 0
        indexed_spans = 0
        it = self.streams.begin()
        while it != self.streams.end():
            indexed += deref(it).second.small.n_blocks + deref(it).second.large.n_blocks
            indexed_spans += deref(it).second.small.unmapped.size() + deref(it).second.large.unmapped.size()
            segments_of_stream = deref(it).second.n_segments
            stream = deref(it).first
            assert deref(it).second.n_stream_uses == stream_use_count.get(stream, 0), \
                "each stream's table entry counts the live blocks that record_stream named it on"
            assert segments_of_stream == segment_streams.count((0, stream)), \
                "each stream's pools count its segments"
            assert deref(it).second.n_private_segments == sum(
                1 for pool, seg_stream in segment_streams if pool != 0 and seg_stream == stream), \
                "each stream's entry counts the private pools' segments on it"
            inc(it)
        indexed += _check_private_pools(self, segment_streams)
        for _, stream in set(segment_streams):
            assert self.streams.find(stream) != self.streams.end(), "every segment's stream has pools"
        assert self.segments_by_base.size() == len(segment_streams), "the segment index holds the segments"
        assert indexed == n_free_blocks, f"free index holds {indexed} blocks, segments {n_free_blocks}"
        assert indexed_spans == n_unmapped_spans, \
            f"the unmapped-span indexes hold {indexed_spans} spans, the ranges {n_unmapped_spans}"
        for k in range(N_STATS):
            name = _CORE_STAT_NAMES[k]
            for p in range(3):
                s = pool_values(&self.stats, k, p)
                assert s.current == expect[name][p], f"{name}[{p}] is {s.current}, blocks say {expect[name][p]}"
                assert s.peak >= s.current, f"{name}[{p}] peak below current"
    finally:
        self._unlock()


cdef int _set_policy(CachingAllocator self, object max_split_size, object max_non_split_rounding,
                     object roundup_power2_divisions, double garbage_collection_threshold,
                     double max_reserved_ratio) except -1:
    """Check the policy options of CachingAllocator() and store them; a
    ValueError names the first one out of range (nothing is stored then)."""
    cdef int i
    if max_split_size is not None and max_split_size < K_LARGE_BUFFER:
        raise ValueError(f"max_split_size must be at least {K_LARGE_BUFFER} bytes (20 MiB), got {max_split_size}")
    if max_non_split_rounding < K_LARGE_BUFFER:
        raise ValueError(f"max_non_split_rounding must be at least {K_LARGE_BUFFER} bytes (20 MiB)")
    if roundup_power2_divisions is None:
        divisions = [0] * K_ROUNDUP_INTERVALS
    else:
        divisions = list(roundup_power2_divisions)
        if len(divisions) != K_ROUNDUP_INTERVALS:
            raise ValueError(f"roundup_power2_divisions needs {K_ROUNDUP_INTERVALS} values, got {len(divisions)}")
    for d in divisions:
        if d < 0 or (d & (d - 1)) != 0:
            raise ValueError(f"roundup_power2_divisions must be powers of 2 (or 0), got {d}")
    if not (0.0 <= garbage_collection_threshold < 1.0):
        raise ValueError("garbage_collection_threshold must be in [0.0, 1.0)")
    if max_reserved_ratio != 0.0 and not (1.0 <= max_reserved_ratio < float("inf")):
        raise ValueError(f"max_reserved_ratio must be a finite number of at least 1.0 (or 0: off), "
                         f"got {max_reserved_ratio}")
    self.policy.max_split_size = SIZE_UNSET if max_split_size is None else max_split_size
    self.policy.max_non_split_rounding = max_non_split_rounding
    for i in range(K_ROUNDUP_INTERVALS):
        self.policy.roundup_divisions[i] = divisions[i]
    self.policy.gc_threshold = garbage_collection_threshold
    self.policy.max_reserved_ratio = max_reserved_ratio
    return 0


cdef size_t _check_private_pools(CachingAllocator self, list segment_streams) except? 0:
    """The private pools' part of _check_invariants: each pool's tables
    count its segments; returns how many free blocks they index."""
    cdef pair[uint64_t, PrivatePool*] entry
    cdef pair[uintptr_t, StreamPools*] table
    cdef size_t indexed = 0
    for entry in self.private_pools:
        pool_id = entry.first
        assert entry.second.use_count >= 0, "a pool's use count is never negative"
        assert entry.second.n_segments == sum(1 for pool, _ in segment_streams if pool == pool_id), \
            "a private pool counts its segments"
        for table in entry.second.streams:
            indexed += table.second.small.n_blocks + table.second.large.n_blocks
            assert table.second.n_segments == segment_streams.count((pool_id, table.first)) > 0, \
                "a private pool's stream tables count its segments there, and go with the last"
    for pool_id, stream in segment_streams:
        if pool_id != 0:
            assert self.private_pools.count(pool_id) == 1, "a segment's private pool exists"
    return indexed
