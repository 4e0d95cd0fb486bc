"""Type stubs for unimem/cuda.py: the memory functions it builds at import
(their signatures are :class:`unimem._memory_api.MemoryAPI`'s), CuPy's
allocator hook and its memory pool."""
from typing import Any, Dict, List, Optional, Tuple

from unimem import _core
from unimem._memory.mempool import MemPool as _MemPool
from unimem._memory_api import MemoryAPI
from unimem._runtime.devices import DeviceLike
from unimem.backends.base import Backend
from unimem.backends.shared_library import SharedLibraryAllocator
from unimem.host import (host_memory_stats as host_memory_stats,  # unimem.host's functions
                         host_memory_stats_as_nested_dict as host_memory_stats_as_nested_dict,
                         reset_accumulated_host_memory_stats as reset_accumulated_host_memory_stats,
                         reset_peak_host_memory_stats as reset_peak_host_memory_stats)

__all__ = [
    "is_available", "device_count", "current_device", "set_device", "caching_allocator_alloc",
    "caching_allocator_delete", "record_stream", "set_per_process_memory_fraction",
    "get_per_process_memory_fraction", "empty_cache", "change_current_allocator", "get_allocator_backend",
    "MemPool", "use_mem_pool", "caching_allocator_enable", "caching_allocator_disabled",
    "empty_virt_addr_cache", "sleep", "wake_up", "is_sleeping", "memory_stats", "memory_stats_as_nested_dict",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_max_memory_cached", "memory_allocated", "memory_allocated_by_client", "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved", "memory_cached", "max_memory_cached", "get_memory_info", "mem_get_info",
    "memory_snapshot", "memory_summary", "caching_allocator", "_record_memory_history", "_snapshot",
    "_dump_snapshot",
    "allocator", "MemoryPool", "OutOfMemoryError", "PooledMemory", "CUDAPluggableAllocator",
    "list_gpu_processes", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats",
    "synchronize", "ipc_collect", "graph_pool_handle", "device_memory_used", "memory_usage",
    "pluggable_allocator",
]

_api: MemoryAPI

is_available = _api.is_available
device_count = _api.device_count
current_device = _api.current_device
set_device = _api.set_device
caching_allocator_alloc = _api.caching_allocator_alloc
caching_allocator_delete = _api.caching_allocator_delete
record_stream = _api.record_stream
set_per_process_memory_fraction = _api.set_per_process_memory_fraction
get_per_process_memory_fraction = _api.get_per_process_memory_fraction
empty_cache = _api.empty_cache
change_current_allocator = _api.change_current_allocator
get_allocator_backend = _api.get_allocator_backend
use_mem_pool = _api.use_mem_pool
caching_allocator_enable = _api.caching_allocator_enable
caching_allocator_disabled = _api.caching_allocator_disabled

class MemPool(_MemPool): ...

empty_virt_addr_cache = _api.empty_virt_addr_cache
sleep = _api.sleep
wake_up = _api.wake_up
is_sleeping = _api.is_sleeping
memory_stats = _api.memory_stats
memory_stats_as_nested_dict = _api.memory_stats_as_nested_dict
reset_accumulated_memory_stats = _api.reset_accumulated_memory_stats
reset_peak_memory_stats = _api.reset_peak_memory_stats
reset_max_memory_allocated = _api.reset_max_memory_allocated
reset_max_memory_cached = _api.reset_max_memory_cached
memory_allocated = _api.memory_allocated
memory_allocated_by_client = _api.memory_allocated_by_client
max_memory_allocated = _api.max_memory_allocated
memory_reserved = _api.memory_reserved
max_memory_reserved = _api.max_memory_reserved
memory_cached = _api.memory_cached
max_memory_cached = _api.max_memory_cached
get_memory_info = _api.get_memory_info
mem_get_info = _api.mem_get_info
def memory_snapshot(mempool_id: Optional[Tuple[int, int]] = None,
                    include_traces: bool = True) -> List[Dict[str, Any]]: ...
memory_summary = _api.memory_summary
caching_allocator = _api.caching_allocator
_record_memory_history = _api._record_memory_history
_snapshot = _api._snapshot
_dump_snapshot = _api._dump_snapshot

def allocator(size: int) -> Any: ...

class OutOfMemoryError(_core.OutOfMemoryError):
    """Also ``cupy.cuda.memory.OutOfMemoryError`` at runtime (made when CuPy is imported)."""
    def __init__(self, error: _core.OutOfMemoryError) -> None: ...

class PooledMemory:
    """A ``cupy.cuda.memory.UnownedMemory`` at runtime (made when CuPy is imported)."""
    ptr: int
    size: int
    device_id: int
    @property
    def allocation(self) -> _core.Allocation: ...
    def free(self) -> None: ...

class MemoryPool:
    def __init__(self, allocator: Any = ..., *, backend: Optional[Backend] = ...) -> None: ...
    def malloc(self, size: int) -> Any: ...
    def free_all_blocks(self, stream: Any = ...) -> None: ...
    def free_all_free(self) -> None: ...
    def n_free_blocks(self) -> int: ...
    def used_bytes(self) -> int: ...
    def free_bytes(self) -> int: ...
    def total_bytes(self) -> int: ...
    def set_limit(self, size: Optional[int] = ..., fraction: Optional[float] = ...) -> None: ...
    def get_limit(self) -> int: ...


# Backend is a Protocol: its optional members keep their defaults (mypy calls them abstract here)
class CUDAPluggableAllocator(SharedLibraryAllocator):  # type: ignore[misc]
    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None: ...

def list_gpu_processes(device: DeviceLike = ...) -> str: ...
def synchronize(device: DeviceLike = ...) -> None: ...
def ipc_collect() -> None: ...
def graph_pool_handle() -> Tuple[int, int]: ...
def device_memory_used(device: DeviceLike = ...) -> int: ...
def memory_usage(device: DeviceLike = ...) -> int: ...
def pluggable_allocator() -> Any: ...
