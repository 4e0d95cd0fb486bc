# The provider ABI (see provider.h): the C face of a raw-memory backend.
# A contract that backends (layer 1) and the core (layer 2) both compile
# against; it contains no code of either.
from libc.stdint cimport uintptr_t, int64_t

cdef extern from "provider.h" nogil:
    const char* UM_PROVIDER_CAPSULE
    enum: UM_PROVIDER_VERSION
    enum UMRawStatus:
        RAW_OK "UM_RAW_OK"
        RAW_OUT_OF_MEMORY "UM_RAW_OUT_OF_MEMORY"
        RAW_ERROR "UM_RAW_ERROR"
    ctypedef int (*raw_malloc_fn "um_raw_malloc_fn")(void* ctx, size_t size, int device,
                                                     uintptr_t stream, uintptr_t* out) noexcept nogil
    ctypedef int (*raw_free_fn "um_raw_free_fn")(void* ctx, uintptr_t ptr, size_t size, int device,
                                                 uintptr_t stream) noexcept nogil
    ctypedef struct RawAllocatorAPI "UMRawAllocatorAPI":
        int version
        void* ctx
        raw_malloc_fn malloc
        raw_free_fn free
    int64_t um_now_ns()
