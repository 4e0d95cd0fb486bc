# cython: language_level=3
"""``unimem.cuda.allocator`` in C: the function every ``cupy.empty`` calls
once ``cupy.cuda.set_allocator(unimem.cuda.allocator)`` is installed.

The same steps as the Python version it replaced, without its frames. On
an H200 (2026-11-27, ``benchmarks/results/gpu/allocator_ab.json``),
``cupy.empty`` + free took 1.15-1.23x CuPy's own pool through the Python
function and 1.04-1.09x through this one; a variant holding device 0's
allocator, with no registry lookups, read 0.89-0.95x. What the function
does is unimem.cuda's; this module only holds the hot path, over the
runtime's device types and the CuPy classes of
:mod:`unimem._integrations.cupy_memory` (so it needs nothing of unimem.cuda,
which exports it: reached first, unpickled in a fresh process say, it works).
"""
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject

from unimem._core cimport Allocation

from unimem import _core
from unimem._integrations import cupy_memory as _cupy_memory
from unimem._runtime import devices as _devices
from unimem.backends import cuda as _backend

cdef object _device_types = _devices._types   # the device types made so far (mutated, never rebound)
cdef object _get_type = _devices.get_type
# -> (PooledMemory, EmptyMemory, MemoryPointer), and unimem.cuda.OutOfMemoryError (also CuPy's)
cdef object _make_memory_classes = _cupy_memory.memory_classes
cdef object _out_of_memory_class = _cupy_memory.out_of_memory_class
cdef object _memory_classes = None
# The stream function a CUDA registry has unless one was given: requests on
# a one-GPU registry with it take the short way (same key, same allocator).
cdef object _cupy_stream_key = _backend.cupy_current_stream_key
cdef object _OutOfMemoryError = _core.OutOfMemoryError
cdef str _CUDA = "cuda"
cdef long long _PER_THREAD = _backend.CUDA_STREAM_PER_THREAD


cdef inline object _current_stream_key():
    """``cupy_current_stream_key(0)``, inline: CuPy's current stream's
    ``ptr``, with ``cudaStreamPerThread`` keyed per thread."""
    get = _backend._get_current_stream
    if get is None:
        get = _backend._bind_get_current_stream()
    ptr = get(0).ptr
    if ptr == _PER_THREAD:
        return _backend.per_thread_stream_key()
    return ptr


def allocator(size):
    """Allocate ``size`` bytes for CuPy on its current device and stream.

    Install with ``cupy.cuda.set_allocator(unimem.cuda.allocator)``. Returns a
    ``cupy.cuda.MemoryPointer`` whose memory goes back to unimem's pool when
    CuPy lets go of it. Its ``mem`` is a :class:`PooledMemory` (the block's
    rounded size, ``free()`` to give it back early), as from CuPy's pool; for
    0 bytes, a CuPy ``Memory`` at address 0.
    """
    cdef PyObject* found = PyDict_GetItem(_device_types, _CUDA)
    return memory_pointer((<object>found if found is not NULL else _get_type(_CUDA)).registry, size)


cpdef object memory_pointer(object registry, object size):
    """A ``cupy.cuda.MemoryPointer`` to a new block of ``registry``'s pool on
    CuPy's current device and stream, holding it until CuPy lets go."""
    global _memory_classes
    cdef Allocation allocation
    cdef object only = registry.only          # the allocator of a one-device registry, once made
    try:
        if only is not None and registry.current_stream_fn is _cupy_stream_key:
            allocation = only.allocate(size, _current_stream_key(), "cupy")
        else:
            allocation = registry.allocate_current(size, "cupy")
    except _OutOfMemoryError as error:
        raise _out_of_memory_class()(error) from None
    if _memory_classes is None:
        _memory_classes = _make_memory_classes()
    pooled, empty, pointer = _memory_classes
    cdef int device = allocation.allocator.device
    if allocation.ptr == 0:
        return pointer(empty(device), 0)
    return pointer(pooled(allocation.ptr, allocation.block_size, allocation, device), 0)
