# The statistics' storage and the trace event; what the core counts, and how.
# Names and semantics: PyTorch's DeviceStats (c10/core/CachingDeviceAllocator.h).
from libc.stdint cimport int64_t, uintptr_t

# What the hot path stores of a statistic is less than what it reports; the
# rest is derived where it is read (stat_values), which saves the free path
# two of its three writes per statistic:
# * ``freed`` is ``allocated - (current - base)``: every decrease of
#   ``current`` is an amount freed, and ``base`` is ``current`` at the last
#   reset of the accumulated counts;
# * a core statistic's "all" pool is the sum of its small and large pools
#   (PyTorch updates the three alike), except its peak, kept by each increase.
#   Only ``peak`` of a ``core[k][POOL_ALL]`` entry is stored.
cdef struct Stat:
    int64_t current
    int64_t peak
    int64_t allocated
    int64_t base

# A statistic as memory_stats reports it.
cdef struct StatValues:
    int64_t current
    int64_t peak
    int64_t allocated
    int64_t freed

cdef struct DurationStat:
    int64_t total
    int64_t max
    int64_t min
    int64_t count

# Indices of the core statistics; each exists for all/small/large pools.
cdef enum:
    S_ALLOCATION = 0
    S_SEGMENT
    S_ACTIVE
    S_INACTIVE_SPLIT
    S_ALLOCATED_BYTES
    S_RESERVED_BYTES
    S_ACTIVE_BYTES
    S_INACTIVE_SPLIT_BYTES
    S_REQUESTED_BYTES
    N_STATS

cdef enum:
    POOL_ALL = 0
    POOL_SMALL = 1
    POOL_LARGE = 2

cdef struct DeviceStats:
    Stat core[N_STATS][3]
    Stat oversize_allocations
    Stat oversize_segments
    int64_t num_alloc_retries
    int64_t num_ooms
    int64_t num_sync_all_streams
    int64_t num_device_alloc
    int64_t num_device_free
    DurationStat device_alloc_time
    DurationStat device_free_time

cdef inline void stat_increase(Stat* s, int64_t amount) noexcept nogil:
    s.current += amount
    if s.current > s.peak:
        s.peak = s.current
    s.allocated += amount

cdef inline void stat_decrease(Stat* s, int64_t amount) noexcept nogil:
    s.current -= amount

cdef inline int64_t pool_current(const DeviceStats* st, int which) noexcept nogil:
    """The current value of a core statistic over both pools ("all")."""
    return st.core[which][POOL_SMALL].current + st.core[which][POOL_LARGE].current

cdef inline void pool_increase(DeviceStats* st, int which, bint is_small, int64_t amount) noexcept nogil:
    stat_increase(&st.core[which][POOL_SMALL if is_small else POOL_LARGE], amount)
    cdef int64_t total = pool_current(st, which)
    if total > st.core[which][POOL_ALL].peak:
        st.core[which][POOL_ALL].peak = total

cdef inline void pool_decrease(DeviceStats* st, int which, bint is_small, int64_t amount) noexcept nogil:
    st.core[which][POOL_SMALL if is_small else POOL_LARGE].current -= amount

cdef inline void pool_increase_without_peak(DeviceStats* st, int which, bint is_small, int64_t amount) noexcept nogil:
    """An increase that no peak may see (memory counted again only for a
    release to take it off at once)."""
    cdef Stat* s = &st.core[which][POOL_SMALL if is_small else POOL_LARGE]
    s.current += amount
    s.allocated += amount

cdef inline StatValues stat_values(const Stat* s) noexcept nogil:
    cdef StatValues v
    v.current = s.current
    v.peak = s.peak
    v.allocated = s.allocated
    v.freed = s.allocated - (s.current - s.base)
    return v

cdef inline StatValues pool_values(const DeviceStats* st, int which, int pool) noexcept nogil:
    """A core statistic of one pool (POOL_ALL, POOL_SMALL, POOL_LARGE) as reported."""
    if pool != POOL_ALL:
        return stat_values(&st.core[which][pool])
    cdef StatValues small = stat_values(&st.core[which][POOL_SMALL])
    cdef StatValues large = stat_values(&st.core[which][POOL_LARGE])
    small.current += large.current
    small.peak = st.core[which][POOL_ALL].peak
    small.allocated += large.allocated
    small.freed += large.freed
    return small

cdef inline void duration_add(DurationStat* d, int64_t amount) noexcept nogil:
    d.total += amount
    d.count += 1
    if amount > d.max:
        d.max = amount
    if d.min == 0 or amount < d.min:
        d.min = amount

cdef inline void stat_reset_peak(Stat* s) noexcept nogil:
    s.peak = s.current

cdef inline void stat_reset_accumulated(Stat* s) noexcept nogil:
    s.allocated = 0
    s.base = s.current


# Trace events for memory history (recorded only while a hook is installed)
cdef enum TraceAction:
    T_ALLOC = 0
    T_FREE_REQUESTED
    T_FREE_COMPLETED
    T_SEGMENT_ALLOC
    T_SEGMENT_FREE
    T_OOM
    T_SEGMENT_MAP                  # expandable segments: pages mapped, unmapped
    T_SEGMENT_UNMAP

TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc",
                 "segment_free", "oom", "segment_map", "segment_unmap")

cdef struct TraceEvent:
    int action
    unsigned char client           # a block's event: its Client (blocks.pxd); else CLIENT_NONE
    uintptr_t addr
    size_t size
    uintptr_t stream
    int64_t time_ns


cdef inline void stats_reset_peak(DeviceStats* st) noexcept nogil:
    """Every "peak" back to its current value (and the timing extremes)."""
    cdef int k
    for k in range(N_STATS):
        stat_reset_peak(&st.core[k][POOL_SMALL])
        stat_reset_peak(&st.core[k][POOL_LARGE])
        st.core[k][POOL_ALL].peak = pool_current(st, k)
    stat_reset_peak(&st.oversize_allocations)
    stat_reset_peak(&st.oversize_segments)
    st.device_alloc_time.max = 0
    st.device_alloc_time.min = 0
    st.device_free_time.max = 0
    st.device_free_time.min = 0


cdef inline void stats_reset_accumulated(DeviceStats* st) noexcept nogil:
    """The "allocated"/"freed" histories, the event counters and the timing totals to 0."""
    cdef int k
    for k in range(N_STATS):
        stat_reset_accumulated(&st.core[k][POOL_SMALL])
        stat_reset_accumulated(&st.core[k][POOL_LARGE])
    stat_reset_accumulated(&st.oversize_allocations)
    stat_reset_accumulated(&st.oversize_segments)
    st.num_alloc_retries = 0
    st.num_ooms = 0
    st.num_sync_all_streams = 0
    st.num_device_alloc = 0
    st.num_device_free = 0
    st.device_alloc_time.total = 0
    st.device_alloc_time.count = 0
    st.device_free_time.total = 0
    st.device_free_time.count = 0
