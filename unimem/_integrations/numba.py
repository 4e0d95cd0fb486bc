"""unimem as Numba's CUDA memory manager: ``numba.cuda`` device arrays from
unimem's CUDA pools, beside CuPy's arrays and PyTorch's tensors.

An External Memory Management plugin (Numba's EMM interface, version 1), as
RMM's ``RMMNumbaManager``: ``numba.cuda.set_memory_manager(UnimemNumbaManager)``
(what ``unimem.install_allocators(numba=True)`` does), or
``NUMBA_CUDA_MEMORY_MANAGER=unimem._integrations.numba`` in the environment.
Numba picks the manager when it makes a device's context: set it before
Numba's first use of the GPU. Device memory only (pinned host memory and
mapped memory stay Numba's own); a block goes back to the pool when Numba's
``MemoryPointer`` dies (or at its context's reset). Blocks are reused in the
order of Numba's default stream: the legacy default stream, or the calling
thread's per-thread default stream under ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM``.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, Tuple

from numba.cuda import HostOnlyCUDAMemoryManager, MemoryPointer
from numba.cuda.cudadrv import driver as _driver
from numba.cuda.cudadrv.driver import GetIpcHandleMixin, MemoryInfo

from .._runtime import devices as _devices
from ..backends.cuda import CUDA_STREAM_PER_THREAD, stream_key

#: The EMM interface version this plugin implements.
INTERFACE_VERSION = 1


def _default_stream_key() -> int:
    """The pool key of the stream Numba works on when it names none."""
    try:
        from numba.cuda.core import config
    except ImportError:                  # Numba's own numba.cuda (before numba-cuda)
        from numba.core import config    # type: ignore[no-redef]
    return stream_key(CUDA_STREAM_PER_THREAD if config.CUDA_PER_THREAD_DEFAULT_STREAM else 0)


def _device_pointer(address: int) -> Any:
    """``address`` as Numba's MemoryPointer holds one: a ``CUdeviceptr`` of
    NVIDIA's bindings (numba-cuda always; Numba's own numba.cuda with
    NUMBA_CUDA_USE_NVIDIA_BINDING), else a ``ctypes.c_void_p``."""
    binding = getattr(_driver, "binding", None)
    if getattr(_driver, "USE_NV_BINDING", True) and binding is not None:
        return binding.CUdeviceptr(address)
    return ctypes.c_void_p(address)


def _releaser(allocations: Dict[int, Any], ptr: int) -> Callable[[], None]:
    """The finalizer of one MemoryPointer: its Allocation goes (and its block
    back to the pool). After a context reset the table is empty already."""
    def release() -> None:
        allocation = allocations.pop(ptr, None)
        if allocation is not None:
            allocation.release()
    return release


class UnimemNumbaManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):  # type: ignore[misc]
    """Numba's device allocations from unimem's CUDA pool of the context's device."""

    def initialize(self) -> None:
        # The pool is made at the first allocation (reading UNIMEM_ALLOC_CONF then).
        pass

    def memalloc(self, size: int) -> MemoryPointer:
        """A block of ``size`` bytes on the context's device."""
        if size == 0:
            return MemoryPointer(self.context, _device_pointer(0), 0)
        allocator = _devices.get_type("cuda").allocator(self.context.device.id)
        allocation = allocator.allocate(size, _default_stream_key(), "numba")
        # self.allocations (HostOnlyCUDAMemoryManager's) is cleared at the
        # context's reset, which frees every block still held.
        self.allocations[allocation.ptr] = allocation
        return MemoryPointer(self.context, _device_pointer(allocation.ptr), size,
                             finalizer=_releaser(self.allocations, allocation.ptr))

    def get_memory_info(self) -> Tuple[int, int]:
        """``(free, total)`` bytes of the device, as ``unimem.cuda.mem_get_info``
        reads them (the pool's cached blocks count as used)."""
        free, total = _devices.get_type("cuda").backend.memory_info(self.context.device.id)
        return MemoryInfo(free=free, total=total)

    @property
    def interface_version(self) -> int:
        return INTERFACE_VERSION


# NUMBA_CUDA_MEMORY_MANAGER=unimem._integrations.numba reads this name.
_numba_memory_manager = UnimemNumbaManager


def numba_contexts_made() -> bool:
    """Whether Numba made a CUDA context already (its manager is then fixed)."""
    from numba.cuda.cudadrv import driver
    devices = getattr(driver.driver, "devices", {})
    return any(getattr(device, "primary_context", None) is not None for device in list(devices.values()))


def install() -> Callable[[], None]:
    """``numba.cuda.set_memory_manager(UnimemNumbaManager)``; returns what
    puts Numba's previous manager back. ``RuntimeError`` (changing nothing)
    once Numba made a context: its arrays would stay with Numba's manager."""
    from numba import cuda
    from numba.cuda.cudadrv import driver
    if numba_contexts_made():
        raise RuntimeError("Numba has made its CUDA context already, with its own memory manager: set "
                           "unimem's first (unimem.install_allocators(numba=True) before Numba's first use of "
                           "the GPU, or NUMBA_CUDA_MEMORY_MANAGER=unimem._integrations.numba)")
    previous = driver._memory_manager
    cuda.set_memory_manager(UnimemNumbaManager)

    def undo() -> None:
        if previous is None:
            driver._memory_manager = None      # Numba picks its own again (or the environment's)
        else:
            cuda.set_memory_manager(previous)
    return undo


def installed() -> bool:
    """Whether Numba's memory manager is unimem's."""
    from numba.cuda.cudadrv import driver
    return driver._memory_manager is UnimemNumbaManager
