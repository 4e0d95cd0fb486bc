"""Type stubs for unimem/xpu.py: the memory functions it builds at import
(their signatures are :class:`unimem._memory_api.MemoryAPI`'s) and its dpnp
arrays (``Any`` here: dpnp and dpctl ship no type information)."""
import collections
from contextlib import AbstractContextManager
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

from unimem import _core
from unimem._core import OutOfMemoryError as OutOfMemoryError
from unimem._memory.mempool import MemPool as _MemPool
from unimem._memory_api import MemoryAPI, MemoryLike
from unimem._runtime.devices import DeviceLike
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
    "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
    "asarray", "default_queue", "stream_handle", "allocator_for", "synchronize",
    "set_allocator", "reset_allocator", "using_allocator", "allocator_installed", "allocator_counters",
    "XPUPluggableAllocator", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats",
    "OutOfMemoryError", "device_memory_used", "memory_usage", "graph_pool_handle", "pluggable_allocator",
]

_api: MemoryAPI

is_available = _api.is_available
device_count = _api.device_count
current_device = _api.current_device
set_device = _api.set_device
caching_allocator_alloc = _api.caching_allocator_alloc
caching_allocator_delete = _api.caching_allocator_delete
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
memory_snapshot = _api.memory_snapshot
caching_allocator = _api.caching_allocator
_snapshot = _api._snapshot
_dump_snapshot = _api._dump_snapshot

ShapeLike = Union[int, Sequence[int]]
_UsmType = Literal["device", "shared", "host"]
_Order = Literal["C", "F", "c", "f"]
_AsarrayOrder = Literal["C", "F", "A", "K", "c", "f", "a", "k"]

def record_stream(memory: MemoryLike, stream: Any) -> None: ...
# torch.xpu's arguments, in its order (no device): MemoryAPI._record_xpu_memory_history
def _record_memory_history(enabled: Optional[Literal["state", "all"]] = ...,
                           context: Optional[Literal["state", "alloc", "all"]] = ...,
                           stacks: Literal["python", "all"] = ..., max_entries: int = ...,
                           clear_history: bool = ..., skip_actions: Optional[List[str]] = ...) -> None: ...
def default_queue(device: Any = ...) -> Any: ...
def stream_handle(queue: Any) -> int: ...
def allocator_for(usm_type: _UsmType = ..., device: Any = ...) -> _core.CachingAllocator: ...
def empty(shape: ShapeLike, dtype: Any = ..., *, order: Optional[_Order] = ..., device: Any = ...,
          usm_type: Optional[_UsmType] = ..., sycl_queue: Any = ...) -> Any: ...
def zeros(shape: ShapeLike, dtype: Any = ..., **kwargs: Any) -> Any: ...
def ones(shape: ShapeLike, dtype: Any = ..., **kwargs: Any) -> Any: ...
def full(shape: ShapeLike, fill_value: Any, dtype: Any = ..., **kwargs: Any) -> Any: ...
def empty_like(x: Any, dtype: Any = ..., **kwargs: Any) -> Any: ...
def zeros_like(x: Any, dtype: Any = ..., **kwargs: Any) -> Any: ...
def ones_like(x: Any, dtype: Any = ..., **kwargs: Any) -> Any: ...
def full_like(x: Any, fill_value: Any, dtype: Any = ..., **kwargs: Any) -> Any: ...
def asarray(obj: Any, dtype: Any = ..., *, order: Optional[_AsarrayOrder] = ..., device: Any = ...,
            usm_type: Optional[_UsmType] = ..., sycl_queue: Any = ...) -> Any: ...
def synchronize(device: Any = ...) -> None: ...
def device_memory_used(device: Any = ...) -> int: ...
def memory_usage(device: Any = ...) -> float: ...
def graph_pool_handle() -> Tuple[int, int]: ...
def set_allocator() -> None: ...
def reset_allocator() -> None: ...
def using_allocator() -> AbstractContextManager[None]: ...
def allocator_installed() -> bool: ...
def allocator_counters() -> Dict[str, int]: ...
SHARED_STATS_PREFIX: str
def memory_stats(device: DeviceLike = ...) -> collections.OrderedDict[str, Any]: ...
def memory_summary(device: DeviceLike = ..., abbreviated: bool = ...) -> str: ...


# Backend is a Protocol: its optional members keep their defaults (mypy calls them abstract here)
class XPUPluggableAllocator(SharedLibraryAllocator):  # type: ignore[misc]
    def __init__(self, path_to_lib_file: str, alloc_fn_name: str, free_fn_name: str) -> None: ...

def pluggable_allocator() -> Any: ...
