"""User-supplied raw allocators (the ``PluggableAllocator`` pattern).

PyTorch's ``CUDAPluggableAllocator`` replaces its caching allocator with the
user's malloc/free. Here the user's functions become the *backend*: they are
called only on a cache miss, and get caching, statistics, stream-ordered reuse
and the out-of-memory retry on top.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from .base import Backend

MallocFn = Callable[[int, int, int], int]
FreeFn = Callable[[int, int, int, int], None]


class PluggableAllocator(Backend):
    """Raw memory from user-supplied Python callables.

    Args:
        malloc_fn: ``malloc_fn(size, device, stream) -> int`` returns an address.
            Returning 0 or raising ``MemoryError`` means out of memory: the
            allocator then releases its cache, retries once, and finally
            raises :class:`unimem.OutOfMemoryError`.
        free_fn: ``free_fn(ptr, size, device, stream)`` gives memory back.
        memory_info_fn: optional ``memory_info_fn(device) -> (free, total)``;
            needed for memory fractions and capacity checks.
        device_count: how many devices it serves (default: as many as the
            device type it replaces).
        name: what the device is called in messages.
    """

    def __init__(self, malloc_fn: MallocFn, free_fn: FreeFn, *,
                 memory_info_fn: Optional[Callable[[int], Tuple[int, int]]] = None,
                 device_count: Optional[int] = None, name: Optional[str] = None) -> None:
        if not callable(malloc_fn) or not callable(free_fn):
            raise TypeError("PluggableAllocator needs callable malloc_fn and free_fn")
        if memory_info_fn is not None and not callable(memory_info_fn):
            raise TypeError("memory_info_fn must be callable")
        if device_count is not None and (not isinstance(device_count, int) or device_count < 1):
            raise ValueError(f"device_count must be a positive int, got {device_count!r}")
        self.malloc_fn = malloc_fn
        self.free_fn = free_fn
        self.memory_info_fn = memory_info_fn
        self._device_count = device_count
        if name is not None:
            self.name = name

    def malloc(self, size: int, device: int, stream: int) -> int:
        return self.malloc_fn(size, device, stream)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.free_fn(ptr, size, device, stream)

    def device_count(self) -> int:
        return self._device_count if self._device_count is not None else 1

    @property
    def explicit_device_count(self) -> Optional[int]:
        return self._device_count

    def memory_info(self, device: int) -> Tuple[int, int]:
        if self.memory_info_fn is None:
            raise NotImplementedError("this PluggableAllocator was given no memory_info_fn")
        free, total = self.memory_info_fn(device)
        return int(free), int(total)
