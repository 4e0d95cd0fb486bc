"""User-supplied raw allocators (the ``PluggableAllocator`` pattern).

PyTorch's ``CUDAPluggableAllocator`` replaces its caching allocator with the
user's malloc/free. Here the user's functions become the *backend*: they are
called only on a cache miss, and get caching, statistics, stream-ordered reuse
and the out-of-memory retry on top.
"""
from __future__ import annotations

import bisect
import threading
from typing import Callable, Dict, List, Optional, Tuple

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
        # What it handed out and was not given back, on every device: each
        # device's allocator refuses memory overlapping its own segments, but
        # only this object sees all the devices it serves.
        self._live_starts: List[int] = []
        self._live_ends: Dict[int, int] = {}
        self._live_lock = threading.Lock()

    def allocator(self) -> "PluggableAllocator":
        """What ``MemPool(allocator=...)`` takes: this allocator (PyTorch's
        pluggable allocators hand their C allocator out so, and ported code
        writes ``MemPool(allocator.allocator())``)."""
        return self

    def malloc(self, size: int, device: int, stream: int) -> int:
        ptr = self.malloc_fn(size, device, stream)
        if type(ptr) is int and ptr > 0:       # what is no address, the allocator refuses itself
            with self._live_lock:
                self._refuse_overlap(ptr, size, device)
                bisect.insort(self._live_starts, ptr)
                self._live_ends[ptr] = ptr + size
        return ptr

    def _refuse_overlap(self, ptr: int, size: int, device: int) -> None:
        at = bisect.bisect_right(self._live_starts, ptr)
        clash = None
        if at > 0 and self._live_ends[self._live_starts[at - 1]] > ptr:
            clash = self._live_starts[at - 1]
        elif at < len(self._live_starts) and self._live_starts[at] < ptr + size:
            clash = self._live_starts[at]
        if clash is not None:
            raise RuntimeError(
                f"malloc_fn returned {ptr:#x} ({size} bytes) for device {device}, which overlaps memory "
                f"it handed out before and was not given back ({clash:#x}, {self._live_ends[clash] - clash} "
                f"bytes), on this or another device: nothing was allocated")

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        with self._live_lock:                   # given back, even if free_fn raises (it may have freed)
            if self._live_ends.pop(ptr, None) is not None:
                del self._live_starts[bisect.bisect_left(self._live_starts, ptr)]
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
