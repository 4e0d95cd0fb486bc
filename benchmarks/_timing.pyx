# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Timed loops for the benchmarks, in C: the cost of the core's hot path, of
a backend's raw malloc/free (through the provider ABI), and of glibc's
malloc/free, with no Python between two calls.

Built in place by ``pip install -e .`` / ``python setup.py build_ext
--inplace`` (see setup.py); never part of the installed library.
"""
from cpython.pycapsule cimport PyCapsule_IsValid, PyCapsule_GetPointer
from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport malloc as sys_malloc, free as sys_free
from libcpp.vector cimport vector

from unimem._core cimport CachingAllocator
from unimem._native.arguments cimport check_size, check_stream
from unimem._native.blocks cimport Block, CLIENT_UNIMEM
from unimem._native.provider cimport RawAllocatorAPI, RAW_OK, UM_PROVIDER_CAPSULE, um_now_ns

cdef extern from *:
    """
    // Make the compiler believe a pointer escapes: it may then not remove a
    // malloc/free pair as having no effect.
    static inline void um_escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }
    """
    void um_escape(void* p) nogil


def time_hot_path(CachingAllocator allocator, sizes, Py_ssize_t pairs, stream=0,
                  bint release_gil=False):
    """Time ``pairs`` malloc+free pairs through the allocator's typed entry
    points, with no Python in between; returns nanoseconds per pair. ``sizes``
    is one size or a sequence used in turn. With ``release_gil`` the loop runs
    the cache-hit path alone without the GIL (threads then really contend for
    the allocator's lock)."""
    cdef vector[size_t] cycle
    for n in ([sizes] if isinstance(sizes, int) else sizes):
        cycle.push_back(<size_t>check_size(n))
    cdef uintptr_t s = check_stream(stream)
    cdef Py_ssize_t i
    cdef size_t k = 0, count = cycle.size()
    cdef uintptr_t p
    cdef int64_t t0, elapsed
    for i in range(<Py_ssize_t>count):                 # make sure every size is cached
        allocator.c_free(allocator.c_malloc(cycle[i], s))
    if release_gil:
        if allocator.unusual:
            raise RuntimeError("the GIL-free timing loop needs an allocator without history, "
                               "debug mode or pending events")
        with nogil:
            elapsed = _time_cached_pairs_nogil(allocator, &cycle, pairs, s)
        if elapsed < 0:
            raise RuntimeError("a size was not cached (another thread emptied the cache?)")
        return elapsed / <double>pairs
    t0 = um_now_ns()
    for i in range(pairs):
        p = allocator.c_malloc(cycle[k], s)
        allocator.c_free(p)
        k += 1
        if k == count:
            k = 0
    return (um_now_ns() - t0) / <double>pairs


cdef int64_t _time_cached_pairs_nogil(CachingAllocator allocator, vector[size_t]* cycle,
                                      Py_ssize_t pairs, uintptr_t stream) noexcept nogil:
    """The cache-hit path alone, as c_malloc/c_free take it: nanoseconds for
    ``pairs`` pairs, or -1 when a request missed the cache."""
    cdef int status
    cdef Block* b
    cdef uintptr_t p
    cdef size_t k = 0, count = cycle.size()
    cdef Py_ssize_t i
    cdef int64_t t0 = um_now_ns()
    for i in range(pairs):
        allocator.lock.lock()
        b = allocator._malloc_cached(cycle[0][k], stream, False, CLIENT_UNIMEM, &status)
        if b == NULL:
            allocator.lock.unlock()
            return -1
        p = b.ptr
        allocator.lock.unlock()
        um_escape(<void*>p)
        allocator.lock.lock()
        allocator._free_fast(p, False)
        allocator.lock.unlock()
        k += 1
        if k == count:
            k = 0
    return um_now_ns() - t0


def time_raw_pairs(backend, size_t size, Py_ssize_t pairs, int device=0):
    """Nanoseconds per malloc+free pair of ``size`` bytes straight through a
    backend's provider ABI (its ``_raw_api`` capsule), as the core calls it on
    a cache miss."""
    capsule = getattr(backend, "_raw_api", None)
    if capsule is None or not PyCapsule_IsValid(capsule, UM_PROVIDER_CAPSULE):
        raise TypeError(f"{backend!r} publishes no raw allocator API")
    cdef RawAllocatorAPI* api = <RawAllocatorAPI*>PyCapsule_GetPointer(capsule, UM_PROVIDER_CAPSULE)
    cdef uintptr_t p = 0
    cdef Py_ssize_t i
    cdef int64_t t0 = um_now_ns()
    for i in range(pairs):
        if api.malloc(api.ctx, size, device, 0, &p) != RAW_OK:
            raise MemoryError(f"{backend!r} could not provide {size} bytes")
        api.free(api.ctx, p, size, device, 0)
    return (um_now_ns() - t0) / <double>pairs


def time_libc_pairs(size_t size, Py_ssize_t pairs):
    """Nanoseconds per glibc malloc+free pair (a peer in the benchmarks: a
    general-purpose allocator that caches host memory itself)."""
    cdef void* p
    cdef Py_ssize_t i
    cdef int64_t t0
    with nogil:                        # threads in the benchmarks run at once
        t0 = um_now_ns()
        for i in range(pairs):
            p = sys_malloc(size)
            um_escape(p)               # or the compiler removes the pair
            sys_free(p)
        t0 = um_now_ns() - t0
    return t0 / <double>pairs


ctypedef void* (*capi_malloc_fn)(size_t size, int device, void* stream) noexcept nogil
ctypedef void (*capi_free_fn)(void* ptr, size_t size, int device, void* stream) noexcept nogil


def time_capi_pairs(uintptr_t malloc_address, uintptr_t free_address, size_t size, Py_ssize_t pairs,
                    int device=0):
    """Nanoseconds per malloc+free pair through unimem's C ABI: the exported
    functions at ``malloc_address``/``free_address`` (``unimem_cpu_malloc``/
    ``unimem_cpu_free``, as a C caller or PyTorch calls them), in a loop that
    holds no GIL (the calling thread is then a C thread to the ABI)."""
    cdef capi_malloc_fn malloc_fn = <capi_malloc_fn>malloc_address
    cdef capi_free_fn free_fn = <capi_free_fn>free_address
    cdef void* p
    cdef Py_ssize_t i
    cdef int64_t elapsed
    cdef bint failed = False
    with nogil:
        elapsed = um_now_ns()
        for i in range(pairs):
            p = malloc_fn(size, device, NULL)
            if p == NULL:
                failed = True
                break
            um_escape(p)
            free_fn(p, size, device, NULL)
        elapsed = um_now_ns() - elapsed
    if failed:
        raise MemoryError(f"unimem's C ABI could not provide {size} bytes")
    return elapsed / <double>pairs
