# Included by _core.pyx: the statistics as Python sees them (memory_stats'
# keys and values, the snapshot's segments and blocks). Off the hot path:
# each call takes the lock once and copies what it reports.

# The names of the trace's actions (TraceAction), as PyTorch's snapshots spell them.
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc",
                 "segment_free", "oom", "segment_map", "segment_unmap")

# The flat key names of memory_stats(), in PyTorch's spelling. The order of
# _STAT_KEYS is the order in which _stat_values() produces the numbers;
# memory_stats() returns them sorted by key, as torch does.
_CORE_STAT_NAMES = ("allocation", "segment", "active", "inactive_split",
                    "allocated_bytes", "reserved_bytes", "active_bytes",
                    "inactive_split_bytes", "requested_bytes")
_POOL_NAMES = ("all", "small_pool", "large_pool")
_METRICS = ("current", "peak", "allocated", "freed")


def _build_stat_keys():
    keys = []
    for name in _CORE_STAT_NAMES:
        for pool in _POOL_NAMES:
            for metric in _METRICS:
                keys.append(f"{name}.{pool}.{metric}")
    for name in ("oversize_allocations", "oversize_segments"):
        for metric in _METRICS:
            keys.append(f"{name}.{metric}")
    keys += ["num_alloc_retries", "num_ooms", "num_sync_all_streams",
             "num_device_alloc", "num_device_free", "max_split_size"]
    # The seeds (and torch's Python docs) call the allocation count
    # "allocated"; PyTorch's C++ core emits "allocation". Both are served.
    for pool in _POOL_NAMES:
        for metric in _METRICS:
            keys.append(f"allocated.{pool}.{metric}")
    return tuple(keys)


_STAT_KEYS = _build_stat_keys()
#: Every key of CachingAllocator.memory_stats(), sorted.
MEMORY_STATS_KEYS = tuple(sorted(_STAT_KEYS))
_SORTED_ORDER = tuple(sorted(range(len(_STAT_KEYS)), key=lambda i: _STAT_KEYS[i]))
_SORTED_KEYS = tuple(_STAT_KEYS[i] for i in _SORTED_ORDER)
cdef int N_STAT_VALUES = len(_STAT_KEYS)


cdef list _stat_values(CachingAllocator self):
    cdef DeviceStats st
    self._lock()
    st = self.stats
    self._unlock()
    cdef list values = [0] * N_STAT_VALUES
    cdef int k, p, n = 0
    cdef StatValues s
    for k in range(N_STATS):
        for p in (POOL_ALL, POOL_SMALL, POOL_LARGE):
            s = pool_values(&st, k, p)
            values[n] = s.current
            values[n + 1] = s.peak
            values[n + 2] = s.allocated
            values[n + 3] = s.freed
            n += 4
    for k in range(2):
        s = stat_values(&st.oversize_allocations if k == 0 else &st.oversize_segments)
        values[n] = s.current
        values[n + 1] = s.peak
        values[n + 2] = s.allocated
        values[n + 3] = s.freed
        n += 4
    values[n] = st.num_alloc_retries
    values[n + 1] = st.num_ooms
    values[n + 2] = st.num_sync_all_streams
    values[n + 3] = st.num_device_alloc
    values[n + 4] = st.num_device_free
    values[n + 5] = -1 if self.policy.max_split_size == SIZE_UNSET else <int64_t>self.policy.max_split_size
    n += 6
    for k in range(12):      # the "allocated.*" alias of "allocation.*"
        values[n + k] = values[k]
    return values


cdef object _duration_dict(DurationStat d):
    return {"total": d.total, "max": d.max, "min": d.min, "count": d.count,
            "avg": d.total // d.count if d.count else 0}


# A snapshot is copied into these plain records under the lock, and its
# Python objects are made after: making them can run the garbage collector,
# whose finalizers may free blocks or empty the cache of this allocator on
# this thread (the lock is recursive), under a walk of its raw pointers.
cdef struct SnapshotSegment:
    uintptr_t address
    size_t total_size
    uintptr_t stream
    uint64_t pool_id
    bint is_small
    bint expandable
    size_t first_block                 # its blocks in the copy's block list
    size_t n_blocks

cdef struct SnapshotBlock:
    uintptr_t address
    size_t size
    size_t requested_size
    int state                          # an index into _BLOCK_STATES
    unsigned char client               # its Client (_core_clients.pxi)


_BLOCK_STATES = ("inactive", "active_allocated", "active_pending_free")


cdef inline int _block_state(Block* b) noexcept nogil:
    if b.allocated:
        return 1
    if b.releasing:                    # free pages waiting to be unmapped
        return 0
    if b.event_count > 0 or b.stream_uses != NULL:
        return 2
    return 0


cdef void _copy_blocks(vector[SnapshotSegment]* segments, vector[SnapshotBlock]* blocks,
                       SnapshotSegment entry, Block* b, Block* end) noexcept nogil:
    """Copy the blocks from ``b`` up to ``end`` (exclusive) as one segment entry."""
    cdef SnapshotBlock copy
    entry.first_block = blocks.size()
    entry.n_blocks = 0
    while b != end:
        copy.address = b.ptr
        copy.size = b.size
        copy.requested_size = b.requested_size
        copy.state = _block_state(b)
        copy.client = b.client
        blocks.push_back(copy)
        entry.n_blocks += 1
        b = b.next
    segments.push_back(entry)


cdef void _copy_segments(CachingAllocator self, uint64_t only, vector[SnapshotSegment]* segments,
                         vector[SnapshotBlock]* blocks) noexcept nogil:
    """The segments (only private pool ``only``'s unless 0) and their blocks,
    copied. Lock held. PyTorch reports an expandable segment as one segment
    per run of mapped blocks (unmapped spans are not memory)."""
    cdef Segment* seg = self.segments
    cdef SnapshotSegment entry
    cdef Block* b
    cdef Block* run
    while seg != NULL:
        if only == 0 or (seg.pool != NULL and seg.pool.id == only):
            entry.stream = seg.stream
            entry.is_small = seg.is_small
            entry.expandable = seg.expandable
            entry.pool_id = seg.pool.id if seg.pool != NULL else 0
            if not seg.expandable:
                entry.address = seg.base
                entry.total_size = seg.size
                _copy_blocks(segments, blocks, entry, seg.head, NULL)
            else:
                entry.pool_id = 0
                b = seg.head
                while b != NULL:
                    if b.unmapped:
                        b = b.next
                        continue
                    run = b
                    entry.address = b.ptr
                    entry.total_size = 0
                    while b != NULL and not b.unmapped:
                        entry.total_size += b.size
                        b = b.next
                    _copy_blocks(segments, blocks, entry, run, b)
        seg = seg.next_seg


cdef list _segments_of_copy(CachingAllocator self, vector[SnapshotSegment]* segments,
                            vector[SnapshotBlock]* blocks):
    """The copy in PyTorch's snapshot layout, sorted by address."""
    cdef SnapshotSegment seg
    cdef SnapshotBlock b
    cdef size_t i, j
    out = []
    for i in range(segments.size()):
        seg = segments[0][i]
        listed = []
        allocated_size = active_size = requested_size = 0
        for j in range(seg.first_block, seg.first_block + seg.n_blocks):
            b = blocks[0][j]
            # (a free block has no client: what it last held is gone)
            listed.append({"address": b.address, "size": b.size, "requested_size": b.requested_size,
                           "state": _BLOCK_STATES[b.state], "frames": [],
                           "client": _CLIENT_NAMES[b.client] if b.state != 0 else None})
            if b.state == 1:
                allocated_size += b.size
            if b.state != 0:                # as PyTorch: what waits on a stream counts
                active_size += b.size
                requested_size += b.requested_size
        out.append({
            "device": self.device, "address": seg.address, "total_size": seg.total_size,
            "allocated_size": allocated_size, "active_size": active_size,
            "requested_size": requested_size, "stream": seg.stream,
            "segment_type": "small" if seg.is_small else "large",
            "segment_pool_id": (0, seg.pool_id),
            "is_expandable": bool(seg.expandable),
            "frames": [], "blocks": listed,
        })
    out.sort(key=lambda s: s["address"])
    return out


def _snapshot_segments(CachingAllocator self, pool_id=None):
    """The segments and their blocks, in PyTorch's snapshot layout (sorted by
    address); only private pool ``pool_id``'s when given ((0, 0): all)."""
    cdef uint64_t only = _pool_id_number(pool_id)
    cdef vector[SnapshotSegment] segments
    cdef vector[SnapshotBlock] blocks
    self._lock()
    _copy_segments(self, only, &segments, &blocks)
    self._unlock()
    return _segments_of_copy(self, &segments, &blocks)


cdef struct LiveBlock:
    uintptr_t address
    size_t size
    size_t requested_size
    uintptr_t stream


def _live_allocations(CachingAllocator self):
    """Every live block: address -> (size, requested size, stream), copied
    under the lock and made into Python objects after it (see above)."""
    cdef size_t i
    cdef Block* b
    cdef LiveBlock copy
    cdef vector[LiveBlock] live
    self._lock()
    for i in range(self.active.mask + 1):
        if self.active.keys[i] != 0:
            b = <Block*>self.active.vals[i]
            copy.address = b.ptr
            copy.size = b.size
            copy.requested_size = b.requested_size
            copy.stream = b.stream
            live.push_back(copy)
    self._unlock()
    return {c.address: (c.size, c.requested_size, c.stream) for c in live}
