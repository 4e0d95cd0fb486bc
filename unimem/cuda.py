"""``unimem.cuda``: PyTorch's CUDA caching allocator for CuPy users.

::

    import cupy, unimem
    cupy.cuda.set_allocator(unimem.cuda.allocator)             # every CuPy array from unimem
    cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)
    a = cupy.ones((4096, 4096)); b = a @ a
    print(unimem.cuda.memory_summary(0))

The memory functions of ``torch.cuda.memory`` (``memory_stats``,
``memory_allocated``, ``empty_cache``, ...), :func:`allocator` for
``cupy.cuda.set_allocator``, :func:`record_stream`, and :class:`MemoryPool`,
a drop-in for ``cupy.cuda.MemoryPool``. Blocks are reused in stream order,
keyed by CuPy's current stream; ``cudaStreamPerThread`` is keyed per thread,
as in CuPy (see :func:`unimem.backends.cuda.stream_key`).

Without a usable GPU this module still imports; functions that need a device
raise ``RuntimeError`` naming the cause (``device_count()`` is 0).
"""
from __future__ import annotations

import functools
import operator
import os
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from . import _core
from ._integrations import cupy as _cupy_allocator, cupy_memory as _cupy_memory
from ._runtime.registry import DeviceRegistry
from ._runtime import devices as _devices
from ._runtime.config import settings_from_env
from ._runtime.devices import DeviceLike, device_index, get_type, new_allocator
from ._memory import telemetry as _telemetry
from ._memory.device_type import synchronize_device
from ._memory.mempool import generate_graph_pool_handle
from ._runtime.pools import Pool, PoolKind
from ._memory_api import PUBLIC_CLASSES, PUBLIC_FUNCTIONS, MemoryAPI
from .backends.base import Backend, forward_to_inner
from .backends.cuda import CUDABackend, OnDevice, _is_out_of_memory, cuda_stream_of, stream_key
from .backends.shared_library import SharedLibraryAllocator
# torch.cuda's pinned (host) memory statistics: unimem.host's pool, the same functions
from .host import (host_memory_stats, host_memory_stats_as_nested_dict, reset_accumulated_host_memory_stats,
                   reset_peak_host_memory_stats)

_api = MemoryAPI("cuda")
globals().update(_api.functions())

__all__ = list(PUBLIC_FUNCTIONS) + list(PUBLIC_CLASSES) + [
    "allocator", "MemoryPool", "OutOfMemoryError", "PooledMemory", "CUDAPluggableAllocator",
    "list_gpu_processes", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats",
    "synchronize", "ipc_collect", "graph_pool_handle", "device_memory_used", "memory_usage",
]


def __getattr__(name: str) -> Any:
    if name == "OutOfMemoryError":
        return _cupy_memory.out_of_memory_class()
    if name == "PooledMemory":
        return _cupy_memory.memory_classes()[0]
    raise AttributeError(f"module 'unimem.cuda' has no attribute '{name}'")


# pickles made before the classes moved to the CuPy glue name it here
_restore_out_of_memory_error = _cupy_memory.restore_out_of_memory_error

# Every cupy.empty calls unimem.cuda.allocator: it is typed Cython
# (unimem/_integrations/cupy.pyx), the same steps without Python frames.
allocator = _cupy_allocator.allocator
allocator.__module__ = __name__          # pickled as unimem.cuda.allocator (Dask's client.run, spawn)


@forward_to_inner(intercepted={"malloc", "free", "_raw_api", "_raw_owner", "host_accessible"})
class _CupyAllocatorBackend(Backend):
    """Raw memory from a CuPy-style allocator (``size -> MemoryPointer``, such
    as ``cupy.cuda.malloc_managed``), kept alive until given back. Everything
    else (devices, memory info, stream events, fork) is the CUDA backend's,
    ``inner``. Whether the host can read the memory is not known: not assumed."""

    def __init__(self, raw_allocator: Any, cuda_backend: CUDABackend) -> None:
        self.raw_allocator = raw_allocator
        self.inner = cuda_backend
        self._held: Dict[int, Any] = {}

    def malloc(self, size: int, device: int, stream: int) -> int:
        try:
            with OnDevice(self.inner.runtime, device):   # as cupy.cuda.Device(device) does
                pointer = self.raw_allocator(size)
        except Exception as error:
            if _is_out_of_memory(error):   # cudaErrorMemoryAllocation: the core frees its cache and retries,
                raise MemoryError(str(error)) from None    # as CuPy's pool does
            raise
        self._held[pointer.ptr] = pointer
        return pointer.ptr

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        del self._held[ptr]


def _cupy_policy_allocator(pool: Pool, backend: Backend, index: int) -> _core.CachingAllocator:
    """An allocator for a pool of its own, with CuPy's segment policy (a miss
    takes a segment of just the rounded request), so that CuPy's numbers
    (``total_bytes``, ``n_free_blocks``, ``set_limit``) hold.
    ``expandable_segments:True`` in ``UNIMEM_ALLOC_CONF`` is for the device's
    own pools: a segment here is the request, which is not a growing range
    (a CuPy raw allocator maps no pages), so the option is left out, and the
    bound it brings by default with it."""
    settings = settings_from_env()
    options: Dict[str, Any] = {"exact_segments": True}
    if settings.expandable_segments:
        options.update(expandable_segments=False, max_reserved_ratio=settings.max_reserved_ratio or 0.0)
    allocator = new_allocator(pool, backend, index, **options)
    # CuPy's SingleDeviceMemoryPool starts with the limit CUPY_GPU_MEMORY_LIMIT
    # asks for: bytes, or a percentage of the device's memory.
    limit = os.environ.get("CUPY_GPU_MEMORY_LIMIT")
    if limit is not None:
        if limit.endswith("%"):
            _set_limit(allocator, fraction=float(limit[:-1]) / 100.0)
        else:
            _set_limit(allocator, size=int(limit))
    return allocator


def _set_limit(allocator: _core.CachingAllocator, size: Optional[int] = None,
               fraction: Optional[float] = None) -> None:
    """CuPy's ``set_limit`` on one allocator: ``size`` bytes, or ``fraction``
    of the device's memory; 0 (or neither) removes the limit."""
    if size is not None and fraction is not None:
        raise ValueError("size and fraction cannot be specified at one time")
    if fraction is not None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"memory limit fraction out of range: {fraction}")
        _, total = allocator.backend.memory_info(allocator.device)
        size = int(total * fraction)
    if size is None:
        size = 0
    if not isinstance(size, bool) and hasattr(type(size), "__index__"):
        size = operator.index(size)          # a NumPy integer too, as CuPy's size_t takes it
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"memory limit size must be a non-negative int, got {size!r}")
    allocator.set_memory_limit(size)


def _own_pool(owner: "MemoryPool") -> Pool:
    """The :class:`Pool` of a ``MemoryPool`` with allocators of its own. It
    reaches the registry through ``owner`` weakly: the allocators hold their
    pool, and must not keep the ``MemoryPool`` alive."""
    owner_ref = weakref.ref(owner)

    def existing_registry() -> Optional[DeviceRegistry]:
        found = owner_ref()
        return None if found is None else found._registry

    def registry() -> DeviceRegistry:
        found = existing_registry()
        if found is None:
            raise RuntimeError("the unimem.cuda.MemoryPool of this allocator is gone")
        return found

    return Pool(PoolKind.CUPY_POOL, "cuda", "cuda-pool", "GPU", registry, existing_registry)


def _cuda_stream_functions() -> Tuple[Optional[Callable[[int], int]], Callable[[Any], int]]:
    """How unimem.cuda finds the current stream's key, and turns a stream into
    one; without CUDA (a pool on a simulated device), every request is on stream 0."""
    if not _devices.is_available("cuda"):
        return None, stream_key
    registry = get_type("cuda").registry
    return registry.current_stream_fn, registry.stream_handle_fn


class MemoryPool:
    """A drop-in for ``cupy.cuda.MemoryPool``, backed by unimem's caching
    allocators: unimem's statistics behind CuPy's API.

    ``cupy.cuda.set_allocator(unimem.cuda.MemoryPool().malloc)`` works as with
    CuPy's pool. Every method applies to the current device, as CuPy's do.
    Blocks are reused in stream order, as in CuPy's pool: a block freed on a
    stream goes at once only to requests on that stream (CuPy's current
    stream when the request is made; ``cudaStreamPerThread`` is a different
    stream in each thread, see :func:`unimem.backends.cuda.stream_key`).

    Args:
        allocator: like CuPy's: a raw allocator (``size -> MemoryPointer``,
            for example ``cupy.cuda.malloc_managed``) the pool draws segments
            from. The pool then has its own allocators, with CuPy's segment
            policy (a miss takes a segment of just the rounded request).
            By default, the pool is unimem's CUDA allocators, shared (with
            their statistics and PyTorch's policy) with :mod:`unimem.cuda`.
        backend: instead, any unimem backend (for tests: a simulated
            device), with the pool's own allocators as for ``allocator``.

    A pool with allocators of its own starts with the limit
    ``CUPY_GPU_MEMORY_LIMIT`` asks for (bytes, or ``"25%"`` of the device), as
    CuPy's; the shared one is :mod:`unimem.cuda`'s, whose limit is
    :func:`set_per_process_memory_fraction`'s.
    """

    def __init__(self, allocator: Any = None, *, backend: Optional[Backend] = None) -> None:
        if allocator is not None and backend is not None:
            raise ValueError("give a CuPy allocator or a unimem backend, not both")
        current_device_fn = None
        if allocator is not None:
            cuda = get_type("cuda")
            backend = _CupyAllocatorBackend(allocator, cuda.backend)
            current_device_fn = cuda.registry.current_device_fn
        if backend is None:
            self._registry = get_type("cuda").registry
        else:
            current_stream_fn, stream_handle_fn = _cuda_stream_functions()
            pool = _own_pool(self)
            self._registry = DeviceRegistry(
                pool.name, backend.device_count(),
                functools.partial(_cupy_policy_allocator, pool, backend),
                current_device_fn=current_device_fn, current_stream_fn=current_stream_fn,
                stream_handle_fn=stream_handle_fn)

    def _current(self) -> _core.CachingAllocator:
        return self._registry.get(self._registry.current_index())

    def malloc(self, size: int) -> Any:
        """Allocate ``size`` bytes on the current device (and stream); returns
        a ``cupy.cuda.MemoryPointer``."""
        return _cupy_allocator.memory_pointer(self._registry, size)

    def free_all_blocks(self, stream: Any = None) -> None:
        """Releases free blocks.

        Args:
            stream (cupy.cuda.Stream): Release free blocks in the arena of the
                given stream. The default releases blocks in all arenas.
        """
        self._current().empty_cache(None if stream is None else stream_key(stream))

    def free_all_free(self) -> None:
        """(Deprecated) Use :meth:`free_all_blocks` instead."""
        warnings.warn("free_all_free is deprecated. Use free_all_blocks instead.", DeprecationWarning)
        self.free_all_blocks()

    def n_free_blocks(self) -> int:
        """The number of free blocks the pool caches."""
        return self._current().free_block_count()

    def used_bytes(self) -> int:
        """The bytes handed out and not yet given back."""
        return self._current().memory_allocated()

    def free_bytes(self) -> int:
        """The bytes held in the cache, free for reuse."""
        allocator = self._current()
        return allocator.memory_reserved() - allocator.memory_allocated()

    def total_bytes(self) -> int:
        """The bytes the pool holds from the device (used and free)."""
        return self._current().memory_reserved()

    def set_limit(self, size: Optional[int] = None, fraction: Optional[float] = None) -> None:
        """Limit the bytes the pool may hold on the current device: ``size``
        in bytes, or ``fraction`` of the device's memory; 0 removes the limit."""
        _set_limit(self._current(), size, fraction)

    def get_limit(self) -> int:
        """The limit in bytes on the current device (0: none)."""
        return self._current().get_memory_limit()


def memory_snapshot(mempool_id: Optional[Tuple[int, int]] = None,
                    include_traces: bool = True) -> "list[Dict[str, Any]]":
    r"""Return a snapshot of the CUDA memory allocator state across all devices.

    Interpreting the output of this function requires familiarity with the
    memory allocator internals.

    Args:
        mempool_id: Optional memory pool ID to get snapshot for a specific pool
        include_traces: accepted for PyTorch's signature: the segments of a
            snapshot carry no trace entries (``_snapshot()`` has them).
    """
    return _api._memory_snapshot_with_traces(mempool_id, include_traces)


# ---------------------------------------------------------------------------
# torch.cuda.memory: CUDAPluggableAllocator, list_gpu_processes
# ---------------------------------------------------------------------------
class CUDAPluggableAllocator(SharedLibraryAllocator):
    r"""CUDA memory allocator loaded from a so file.

    Memory allocators are compiled in .so files and loaded dynamically using ctypes.
    To change the active allocator use :func:`change_current_allocator`.

    Args:
        path_to_so_file(str): Path in the filesystem to the `.so` file containing
            the allocator functions
        alloc_fn_name(str): Name of the function to perform the memory allocation
            in the so file. The signature must be:
            void* alloc_fn_name(ssize_t size, int device, cudaStream_t stream);
        free_fn_name(str): Name of the function to perform the memory release
            in the so file. The signature must be:
            void free_fn_name(void* ptr, size_t size, int device, cudaStream_t stream);

    Unlike PyTorch's, the functions are called on a cache miss only: unimem's
    caching allocator stays on top (blocks are reused, statistics kept). A
    ``NULL`` return is out of memory: the cache is released and the request
    retried once. ``mem_get_info`` still reads ``cudaMemGetInfo``.

    .. warning::
        This is currently supported only in unix OSs
    """

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        # mem_get_info keeps asking the device (cudaMemGetInfo), where there is one
        try:
            memory_info_fn = get_type("cuda").backend.memory_info
        except RuntimeError:
            memory_info_fn = None
        super().__init__(path_to_so_file, alloc_fn_name, free_fn_name,
                         stream_pointer=lambda stream, device: cuda_stream_of(stream),
                         memory_info_fn=memory_info_fn)


# ---------------------------------------------------------------------------
# torch.cuda: synchronize, ipc_collect, graph_pool_handle, NVML telemetry
# ---------------------------------------------------------------------------
def synchronize(device: DeviceLike = None) -> None:
    r"""Wait for all kernels in all streams on a CUDA device to complete.

    Args:
        device (torch.device or int, optional): device for which to synchronize.
            It uses the current device, given by :func:`~unimem.cuda.current_device`,
            if :attr:`device` is ``None`` (default).

    ``cudaDeviceSynchronize`` through CuPy's runtime; then the pools take back
    the blocks whose streams' work has finished. Without a usable GPU,
    ``RuntimeError`` saying why.
    """
    dtype = get_type("cuda")
    synchronize_device(dtype, device_index(device, dtype))


def ipc_collect() -> None:
    r"""Force collects GPU memory after it has been released by CUDA IPC.

    .. note::
        Checks if any sent CUDA tensors could be cleaned from the memory. Force
        closes shared memory file used for reference counting if there is no
        active counters. Useful when the producer process stopped actively sending
        tensors and want to release unused memory.

    unimem's pools send no block to another process through CUDA IPC, so
    there is never such memory to collect: this only checks, as PyTorch's
    initialisation of CUDA does, that CUDA can be used here (``RuntimeError``
    saying why not).
    """
    get_type("cuda")


#: torch.cuda's name for it (its graph pools share the ids of MemPool objects).
graph_pool_handle = generate_graph_pool_handle
device_memory_used = _telemetry.cuda_device_memory_used
memory_usage = _telemetry.cuda_memory_usage
list_gpu_processes = _telemetry.list_gpu_processes


# PyTorch's CUDAPluggableAllocator over unimem's pools (the other way round from CUDAPluggableAllocator above)
from ._integrations.torch import namespace_pluggable_allocator  # noqa: E402
pluggable_allocator = namespace_pluggable_allocator("cuda")
__all__.append("pluggable_allocator")
