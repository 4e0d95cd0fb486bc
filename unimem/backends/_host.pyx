# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""Page-aligned host memory: the backend of the ``cpu`` device pool, and the
fallback of the pinned host pool when neither CUDA nor SYCL can pin memory.

Its malloc and free are published to the core as C functions (no Python, no
GIL on a cache miss)."""
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport uintptr_t, int64_t
from libc.stdlib cimport free as sys_free
from posix.stdlib cimport posix_memalign

from unimem.backends._capi cimport RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY

import os

cdef extern from "_csupport.hpp" nogil:
    int64_t um_now_ns()

# Page alignment keeps every segment on its own pages (and lets the debug
# mode and madvise work on whole pages).
cdef size_t PAGE = 4096


cdef int host_malloc(void* ctx, size_t size, int device, uintptr_t stream,
                     uintptr_t* out) noexcept nogil:
    cdef void* p = NULL
    if size == 0 or posix_memalign(&p, PAGE, size) != 0 or p == NULL:
        out[0] = 0
        return RAW_OUT_OF_MEMORY
    out[0] = <uintptr_t>p
    return RAW_OK


cdef int host_free(void* ctx, uintptr_t ptr, size_t size, int device,
                   uintptr_t stream) noexcept nogil:
    sys_free(<void*>ptr)
    return RAW_OK


cdef RawAllocatorAPI HOST_API
HOST_API.ctx = NULL
HOST_API.malloc = host_malloc
HOST_API.free = host_free


def _meminfo():
    """(available, total) physical memory in bytes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available, total


cdef class PageAlignedBackend:
    """Plain host memory from ``posix_memalign`` (page aligned, not pinned).

    Args:
        name: what the device is called in messages ("CPU" for the cpu pool).
    """

    cdef readonly str name
    cdef readonly object _raw_api
    cdef readonly bint host_accessible      # debug mode may fill and check it
    cdef readonly bint survives_fork        # plain memory: the child has a copy

    def __init__(self, str name="CPU"):
        self.name = name
        self._raw_api = PyCapsule_New(&HOST_API, b"unimem.RawAllocatorAPI", NULL)
        self.host_accessible = True
        self.survives_fork = True

    def malloc(self, size, int device=0, stream=0):
        cdef uintptr_t out = 0
        cdef size_t n = size
        if host_malloc(NULL, n, device, 0, &out) != RAW_OK:
            raise MemoryError(f"posix_memalign could not provide {n} bytes")
        return out

    def free(self, uintptr_t ptr, size=0, int device=0, stream=0):
        host_free(NULL, ptr, 0, device, 0)

    def device_count(self):
        return 1

    def memory_info(self, int device=0):
        return _meminfo()

    def record_event(self, stream, device):
        return None

    def event_done(self, event):
        return True

    def event_synchronize(self, event):
        pass

    def pinned(self):
        """Whether the memory is page-locked (it is not)."""
        return False

    def _time_raw_pairs(self, size_t size, Py_ssize_t pairs):
        """Nanoseconds per malloc+free pair, called as C (for the benchmarks)."""
        cdef uintptr_t p
        cdef Py_ssize_t i
        cdef int64_t t0 = um_now_ns()
        for i in range(pairs):
            host_malloc(NULL, size, 0, 0, &p)
            host_free(NULL, p, size, 0, 0)
        return (um_now_ns() - t0) / <double>pairs

    def __repr__(self):
        return f"<unimem PageAlignedBackend {self.name}>"
