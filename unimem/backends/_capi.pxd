# The C-level face of a raw-memory backend.
#
# A backend written in Cython may publish one of these (in a PyCapsule named
# "unimem.RawAllocatorAPI", as the attribute ``_raw_api``) so that the caching
# core calls its malloc and free directly, without the GIL and without a
# Python call. Backends written in Python simply leave it out; the core then
# calls their ``malloc``/``free`` methods. The struct's ``ctx`` must stay
# valid while the object named by the backend's ``_raw_owner`` attribute (the
# backend itself when there is none) lives: the core keeps a reference to it.
from libc.stdint cimport uintptr_t

cdef enum RawStatus:
    RAW_OK = 0
    RAW_OUT_OF_MEMORY = 1
    RAW_ERROR = 2          # anything else; the core then asks the Python method

ctypedef int (*raw_malloc_fn)(void* ctx, size_t size, int device, uintptr_t stream,
                              uintptr_t* out) noexcept nogil
ctypedef int (*raw_free_fn)(void* ctx, uintptr_t ptr, size_t size, int device,
                            uintptr_t stream) noexcept nogil

cdef struct RawAllocatorAPI:
    void* ctx
    raw_malloc_fn malloc
    raw_free_fn free
