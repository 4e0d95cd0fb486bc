# The allocation policy's constants: PyTorch's CUDACachingAllocator values.
# Header-only (a verbatim C block), so every use is a compile-time constant.
from libc.stdint cimport uint64_t

cdef extern from "csupport.hpp" nogil:
    int um_floor_log2(uint64_t x)

cdef extern from *:
    """
    #define K_MIN_BLOCK ((size_t)512)            /* every size is a multiple of this */
    #define K_SMALL_SIZE ((size_t)1048576)       /* largest small request: 1 MiB */
    #define K_SMALL_BUFFER ((size_t)2097152)     /* small segments: 2 MiB */
    #define K_LARGE_BUFFER ((size_t)20971520)    /* requests under 10 MiB get 20 MiB */
    #define K_MIN_LARGE_ALLOC ((size_t)10485760)
    #define K_ROUND_LARGE ((size_t)2097152)      /* larger segments round to 2 MiB */
    #define K_ROUNDUP_INTERVALS 16               /* 1 MiB .. 64 GiB, one per power of 2 */
    /* A request above this (4 PiB) can never be served by a real device; it
       skips the arithmetic and goes straight to out-of-memory. */
    #define MAX_REQUEST ((size_t)1 << 52)
    /* The most memory one allocator holds from its backend (64 PiB): with every
       segment at most MAX_REQUEST, no byte statistic can overflow int64 even if a
       backend that reports no capacity hands out all it is asked for. */
    #define MAX_RESERVED ((size_t)1 << 56)
    """
    const size_t K_MIN_BLOCK
    const size_t K_SMALL_SIZE
    const size_t K_SMALL_BUFFER
    const size_t K_LARGE_BUFFER
    const size_t K_MIN_LARGE_ALLOC
    const size_t K_ROUND_LARGE
    enum: K_ROUNDUP_INTERVALS
    const size_t MAX_REQUEST
    const size_t MAX_RESERVED


cdef struct Policy:
    # One allocator's settings of PyTorch's policy (PYTORCH_CUDA_ALLOC_CONF),
    # fixed at its creation: read by the hot path (round_size, should_split)
    # and the miss path. Embedded in the core, so reading one costs what a
    # field of its own did.
    size_t max_split_size
    size_t max_non_split_rounding
    size_t roundup_divisions[K_ROUNDUP_INTERVALS]
    double gc_threshold                   # garbage_collection_threshold; 0: off
    double max_reserved_ratio             # 0: off (PyTorch's policy)
    size_t small_request_max              # the largest request of the small pool (_core_holes.pxi)
    bint exact_segments                   # CuPy's policy: a segment is the rounded request


cdef inline size_t roundup_power2_next_division(size_t size, size_t divisions) noexcept nogil:
    """PyTorch's roundup_power2_next_division: ``size`` rounded up to the next
    of ``divisions`` equal steps between two powers of two."""
    if (size & (size - 1)) == 0:
        return size
    cdef size_t power2_floor = (<size_t>1) << um_floor_log2(size)
    cdef size_t power2_division = power2_floor >> um_floor_log2(divisions)
    if power2_division == 0:
        return power2_floor << 1
    cdef size_t round_floor = size & ~(power2_division - 1)
    return size if round_floor == size else round_floor + power2_division

