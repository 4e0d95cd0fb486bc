# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""Page-aligned host memory: the backend of the ``cpu`` device pool, and the
fallback of the pinned host pool when neither CUDA nor SYCL can pin memory.

Segments come straight from the operating system (``mmap``) and go back to it
(``munmap``), as device memory goes back to a device: ``empty_cache()`` really
returns host memory, which glibc's malloc would keep in its heap. Its malloc
and free are published to the core as C functions (no Python, no GIL on a
cache miss)."""
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport uintptr_t
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MAP_FAILED

from unimem._native.provider cimport (RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY, RAW_ERROR,
                                      UM_PROVIDER_CAPSULE, UM_PROVIDER_VERSION)

import os

cdef int host_malloc(void* ctx, size_t size, int device, uintptr_t stream,
                     uintptr_t* out) noexcept nogil:
    cdef void* p
    out[0] = 0
    if size == 0:
        return RAW_OUT_OF_MEMORY
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        return RAW_OUT_OF_MEMORY
    out[0] = <uintptr_t>p
    return RAW_OK


cdef int host_free(void* ctx, uintptr_t ptr, size_t size, int device,
                   uintptr_t stream) noexcept nogil:
    return RAW_OK if munmap(<void*>ptr, size) == 0 else RAW_ERROR


cdef RawAllocatorAPI HOST_API
HOST_API.version = UM_PROVIDER_VERSION
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
    """Plain host memory from ``mmap`` (page aligned, not pinned).

    Args:
        name: what the device is called in messages ("CPU" for the cpu pool).
    """

    cdef readonly str name
    cdef readonly object _raw_api
    cdef readonly bint host_accessible      # debug mode may fill and check it
    cdef readonly bint survives_fork        # plain memory: the child has a copy

    def __init__(self, str name="CPU"):
        self.name = name
        self._raw_api = PyCapsule_New(&HOST_API, UM_PROVIDER_CAPSULE, NULL)
        self.host_accessible = True
        self.survives_fork = True

    def malloc(self, size, int device=0, stream=0):
        cdef uintptr_t out = 0
        cdef size_t n = size
        if host_malloc(NULL, n, device, 0, &out) != RAW_OK:
            raise MemoryError(f"mmap could not provide {n} bytes")
        return out

    def free(self, uintptr_t ptr, size_t size, int device=0, stream=0):
        """Give ``size`` bytes at ``ptr`` (as allocated) back to the system."""
        if host_free(NULL, ptr, size, device, 0) != RAW_OK:
            raise OSError(f"munmap({ptr:#x}, {size}) failed")

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

    # The rest of the Backend protocol (unimem.backends.base), with its
    # defaults: plain memory has no queues, events or allocation limit.
    def max_allocation_size(self, int device=0):
        return 0

    def check_stream(self, stream, device):
        pass

    def release_stream(self, stream, device):
        pass

    def release_event(self, event):
        pass

    def synchronize(self, device):
        pass

    def pinned_host_backend(self):
        """The pinned pool of a host-only machine: page-aligned memory too."""
        return PageAlignedBackend("host")

    @property
    def api_name(self):
        return None

    @property
    def explicit_device_count(self):
        return None

    @property
    def pinning(self):
        return "page-aligned"

    @property
    def _raw_owner(self):
        return self         # the capsule's functions need no context

    def __repr__(self):
        return f"<unimem PageAlignedBackend {self.name}>"

