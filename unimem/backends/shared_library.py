"""Raw memory from C functions in a shared library, as PyTorch's
``CUDAPluggableAllocator`` / ``XPUPluggableAllocator`` load them.

The library exports ``void* alloc(ssize_t size, int device, void* stream)``
and ``void free(void* ptr, size_t size, int device, void* stream)``, where
``stream`` is the device's own stream object (a ``cudaStream_t``, a
``sycl::queue*``). The functions are called on a cache miss only, through
ctypes: the caching allocator stays on top, as for :class:`PluggableAllocator`.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional, Tuple, Union

from .pluggable import PluggableAllocator

#: ``stream_pointer(stream, device)``: the pointer the C functions get for
#: the pool's stream handle ``stream`` on ``device``.
StreamPointer = Callable[[int, int], int]

_ALLOC_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class MissingFunctionError(AttributeError, ValueError):
    """A function name the shared library does not export: PyTorch's
    pluggable allocators raise ctypes' ``AttributeError`` for it; unimem's
    is also the ``ValueError`` of a bad argument."""


def _function(library: ctypes.CDLL, path: str, name: str, prototype: type) -> Callable[..., object]:
    """The function ``name`` of ``library``, called as ``prototype``."""
    if not isinstance(name, str):
        raise TypeError(f"expected a function name (str), got {type(name).__name__}")
    try:
        address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        raise MissingFunctionError(f"{path} exports no function {name!r}") from None
    return prototype(address)


class SharedLibraryAllocator(PluggableAllocator):
    """A :class:`PluggableAllocator` whose malloc and free are C functions of
    a shared library (``path_to_so_file``), loaded with ctypes.

    Args:
        path_to_so_file: the library (``ctypes.CDLL`` loads it).
        alloc_fn_name: ``void* alloc(ssize_t size, int device, void* stream)``;
            ``NULL`` means out of memory (the cache is released and the
            request retried once, then :class:`unimem.OutOfMemoryError`).
        free_fn_name: ``void free(void* ptr, size_t size, int device, void* stream)``.
        stream_pointer: turns the pool's stream handle into what the functions
            get as ``stream`` (the handle itself by default).
        memory_info_fn: optional ``(free, total)`` of a device, as for
            :class:`PluggableAllocator`.
    """

    def __init__(self, path_to_so_file: Union[str, "os.PathLike[str]"], alloc_fn_name: str, free_fn_name: str,
                 *, stream_pointer: Optional[StreamPointer] = None,
                 memory_info_fn: Optional[Callable[[int], Tuple[int, int]]] = None,
                 device_count: Optional[int] = None) -> None:
        path = os.fspath(path_to_so_file)
        library = ctypes.CDLL(path)
        alloc = _function(library, path, alloc_fn_name, _ALLOC_TYPE)
        free = _function(library, path, free_fn_name, _FREE_TYPE)
        to_pointer = stream_pointer if stream_pointer is not None else (lambda stream, device: stream)

        def malloc_fn(size: int, device: int, stream: int) -> int:
            return int(alloc(size, device, to_pointer(stream, device)) or 0)   # NULL: out of memory

        def free_fn(ptr: int, size: int, device: int, stream: int) -> None:
            free(ptr, size, device, to_pointer(stream, device))

        super().__init__(malloc_fn, free_fn, memory_info_fn=memory_info_fn, device_count=device_count)
        self.library = library
