# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""dpctl's C API, reached at run time.

dpctl ships its C interface in ``libDPCTLSyclInterface.so`` and exports
``Memory_Make`` through its Cython capsule table. Taking both at run time
(instead of compiling against dpctl's headers) keeps dpctl out of unimem's
build: the package compiles without it and uses it when it is installed.

Two things live here:

* :class:`USMRawAllocator`: SYCL USM ``malloc_device`` / ``malloc_shared`` /
  ``malloc_host`` and ``free``, published to the caching core as C functions
  (a cache miss calls them without Python and without the GIL).
* :func:`make_usm_memory`: wraps a pool block as a dpctl memory object that
  keeps the block's owner alive, for usm_ndarray buffers.
"""
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_GetPointer, PyCapsule_GetName
from libc.stdint cimport uintptr_t, int64_t
from libcpp.vector cimport vector

from unimem.backends._capi cimport RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY, RAW_ERROR

cdef extern from "_csupport.hpp" nogil:
    int64_t um_now_ns()

ctypedef void* (*usm_malloc_fn)(size_t size, void* queue) noexcept nogil
ctypedef void (*usm_free_fn)(void* ptr, void* queue) noexcept nogil
ctypedef void (*queue_wait_fn)(void* queue) noexcept nogil
ctypedef object (*memory_make_fn)(void* ptr, size_t nbytes, void* queue, object owner)


cdef struct USMContext:
    usm_malloc_fn malloc
    usm_free_fn free
    queue_wait_fn wait
    vector[void*]* default_queues   # device index -> DPCTLSyclQueueRef
    vector[void*]* queues           # stream handle -> DPCTLSyclQueueRef (0: the device's default)
    vector[int64_t]* held           # device index -> bytes currently allocated


cdef inline void* queue_for(USMContext* c, int device, uintptr_t stream) noexcept nogil:
    if stream == 0:
        if device < 0 or <size_t>device >= c.default_queues.size():
            return NULL
        return c.default_queues[0][device]
    if stream >= c.queues.size():
        return NULL
    return c.queues[0][stream]


cdef int usm_malloc(void* ctx, size_t size, int device, uintptr_t stream,
                    uintptr_t* out) noexcept nogil:
    cdef USMContext* c = <USMContext*>ctx
    cdef void* q = queue_for(c, device, stream)
    out[0] = 0
    if q == NULL:
        return RAW_ERROR
    cdef void* p = c.malloc(size, q)
    if p == NULL:
        return RAW_OUT_OF_MEMORY
    out[0] = <uintptr_t>p
    c.held[0][device] += size
    return RAW_OK


cdef int usm_free(void* ctx, uintptr_t ptr, size_t size, int device,
                  uintptr_t stream) noexcept nogil:
    cdef USMContext* c = <USMContext*>ctx
    cdef void* q = queue_for(c, device, stream)
    if q == NULL:
        return RAW_ERROR
    # As PyTorch's XPU allocator does: no kernel may still use the memory
    # when sycl::free runs. Waiting on an idle queue costs next to nothing.
    c.wait(q)
    c.free(<void*>ptr, q)
    c.held[0][device] -= size
    return RAW_OK


cdef class USMRawAllocator:
    """Raw SYCL USM allocations of one kind (``device``, ``shared`` or ``host``).

    Args:
        kind: the USM kind.
        functions: addresses of ``DPCTLmalloc_<kind>``, ``DPCTLfree_with_queue``
            and ``DPCTLQueue_Wait``.
        default_queues: the default ``dpctl.SyclQueue`` of each device.
    """

    cdef USMContext ctx
    cdef list _queue_objects          # keeps every SyclQueue whose ref we hold alive
    cdef readonly str kind
    cdef readonly object _raw_api
    cdef RawAllocatorAPI api

    def __cinit__(self):
        self.ctx.default_queues = new vector[void*]()
        self.ctx.queues = new vector[void*]()
        self.ctx.queues.push_back(NULL)       # handle 0 means "the device's default queue"
        self.ctx.held = new vector[int64_t]()

    def __dealloc__(self):
        del self.ctx.default_queues
        del self.ctx.queues
        del self.ctx.held

    def __init__(self, str kind, uintptr_t malloc_fn, uintptr_t free_fn, uintptr_t wait_fn,
                 list default_queues):
        if not malloc_fn or not free_fn or not wait_fn:
            raise ValueError("dpctl's USM functions were not found")
        self.kind = kind
        self.ctx.malloc = <usm_malloc_fn>malloc_fn
        self.ctx.free = <usm_free_fn>free_fn
        self.ctx.wait = <queue_wait_fn>wait_fn
        self._queue_objects = list(default_queues)
        for q in default_queues:
            self.ctx.default_queues.push_back(<void*><uintptr_t>q.addressof_ref())
            self.ctx.held.push_back(0)
        self.api.ctx = &self.ctx
        self.api.malloc = usm_malloc
        self.api.free = usm_free
        self._raw_api = PyCapsule_New(&self.api, b"unimem.RawAllocatorAPI", NULL)

    def add_queue(self, queue):
        """Register a non-default queue; returns its stream handle."""
        self._queue_objects.append(queue)
        self.ctx.queues.push_back(<void*><uintptr_t>queue.addressof_ref())
        return self.ctx.queues.size() - 1

    def held(self, int device):
        """Bytes allocated on ``device`` through this allocator and not yet freed."""
        return self.ctx.held[0][device]

    def malloc(self, size_t size, int device, uintptr_t stream):
        cdef uintptr_t out = 0
        cdef int rc = usm_malloc(&self.ctx, size, device, stream, &out)
        if rc == RAW_ERROR:
            raise ValueError(f"no SYCL queue for device {device}, stream {stream}")
        if rc != RAW_OK:
            raise MemoryError(f"SYCL malloc_{self.kind} of {size} bytes failed")
        return out

    def free(self, uintptr_t ptr, size_t size, int device, uintptr_t stream):
        if usm_free(&self.ctx, ptr, size, device, stream) != RAW_OK:
            raise ValueError(f"no SYCL queue for device {device}, stream {stream}")

    def _time_raw_pairs(self, size_t size, Py_ssize_t pairs, int device=0):
        """Nanoseconds per USM malloc+free pair, called as C (for the benchmarks)."""
        cdef uintptr_t p = 0
        cdef Py_ssize_t i
        cdef int64_t t0 = um_now_ns()
        for i in range(pairs):
            if usm_malloc(&self.ctx, size, device, 0, &p) != RAW_OK:
                raise MemoryError(f"SYCL malloc_{self.kind} of {size} bytes failed")
            usm_free(&self.ctx, p, size, device, 0)
        return (um_now_ns() - t0) / <double>pairs


cdef memory_make_fn _memory_make = NULL


def bind_memory_make(capsule):
    """Take ``Memory_Make`` from ``dpctl.memory._memory.__pyx_capi__``."""
    global _memory_make
    _memory_make = <memory_make_fn>PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule))


def make_usm_memory(uintptr_t ptr, size_t nbytes, queue, owner):
    """A dpctl ``MemoryUSM*`` object over ``nbytes`` at ``ptr``, bound to
    ``queue``, that keeps ``owner`` alive for as long as it lives."""
    if _memory_make == NULL:
        raise RuntimeError("dpctl's Memory_Make is not bound")
    return _memory_make(<void*>ptr, nbytes, <void*><uintptr_t>queue.addressof_ref(), owner)
