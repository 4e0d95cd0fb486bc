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
    values[n + 5] = -1 if self.max_split_size == SIZE_UNSET else <int64_t>self.max_split_size
    n += 6
    for k in range(12):      # the "allocated.*" alias of "allocation.*"
        values[n + k] = values[k]
    return values


cdef object _duration_dict(DurationStat d):
    return {"total": d.total, "max": d.max, "min": d.min, "count": d.count,
            "avg": d.total // d.count if d.count else 0}


cdef str _block_state(Block* b):
    if b.allocated:
        return "active_allocated"
    if b.event_count > 0 or b.stream_uses != NULL:
        return "active_pending_free"
    return "inactive"


def _snapshot_segments(CachingAllocator self, pool_id=None):
    """The segments and their blocks, in PyTorch's snapshot layout (sorted by
    address); only private pool ``pool_id``'s when given ((0, 0): all)."""
    cdef Segment* seg
    cdef Block* b
    cdef uint64_t only = _pool_id_number(pool_id)
    segments = []
    self._lock()
    try:
        seg = self.segments
        while seg != NULL:
            if only != 0 and (seg.pool == NULL or seg.pool.id != only):
                seg = seg.next_seg
                continue
            if seg.expandable:
                segments.extend(_expandable_snapshot(self, seg))
                seg = seg.next_seg
                continue
            blocks = []
            allocated_size = active_size = requested_size = 0
            b = seg.head
            while b != NULL:
                state = _block_state(b)
                blocks.append({"address": b.ptr, "size": b.size,
                               "requested_size": b.requested_size,
                               "state": state, "frames": []})
                if b.allocated:
                    allocated_size += b.size
                if state != "inactive":     # as PyTorch: what waits on a stream counts
                    active_size += b.size
                    requested_size += b.requested_size
                b = b.next
            segments.append({
                "device": self.device, "address": seg.base, "total_size": seg.size,
                "allocated_size": allocated_size, "active_size": active_size,
                "requested_size": requested_size, "stream": seg.stream,
                "segment_type": "small" if seg.is_small else "large",
                "segment_pool_id": (0, seg.pool.id if seg.pool != NULL else 0),
                "is_expandable": False,
                "frames": [], "blocks": blocks,
            })
            seg = seg.next_seg
    finally:
        self._unlock()
    segments.sort(key=lambda s: s["address"])
    return segments


def _live_allocations(CachingAllocator self):
    cdef size_t i
    cdef Block* b
    out = {}
    self._lock()
    for i in range(self.active.mask + 1):
        if self.active.keys[i] != 0:
            b = <Block*>self.active.vals[i]
            out[b.ptr] = (b.size, b.requested_size, b.stream)
    self._unlock()
    return out
