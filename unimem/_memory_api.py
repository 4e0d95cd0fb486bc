"""The memory functions every device namespace offers (``unimem.cpu``,
``unimem.xpu``, ``unimem.cuda``), in ``torch.cuda.memory``'s names and wording.

A :class:`MemoryAPI` is bound to one device type; the namespace modules export
its methods as module functions. Its parts live in :mod:`unimem._memory`, one
concern a module (allocation, configuration, statistics, snapshots/history);
this module assembles them and keeps the names the namespaces import.
"""
from __future__ import annotations

from typing import Any, Dict

from ._runtime.registry import namespace_alloc_functions
from ._runtime import devices as _devices
from ._memory.allocation import AllocationAPI
from ._memory.arguments import (ADDRESS_LIMIT, HasArrayInterface, HasCudaArrayInterface, HasPointer,
                                HasSyclUsmArrayInterface, MemoryLike, block_address, check_fraction,
                                numpy_dtype, record_stream_on_pools)
from ._memory.configuration import ConfigurationAPI
from ._memory.history import HistoryAPI
from ._memory.mempool import PrivatePoolAPI
from ._memory.sleep import SleepAPI
from ._memory.statistics import StatisticsAPI, nest_stats
from ._runtime.devices import DeviceLike

__all__ = [
    "MemoryAPI", "PUBLIC_FUNCTIONS", "PUBLIC_CLASSES", "ADDRESS_LIMIT", "HasArrayInterface", "HasCudaArrayInterface",
    "HasPointer", "HasSyclUsmArrayInterface", "MemoryLike", "DeviceLike", "block_address",
    "check_fraction", "numpy_dtype", "record_stream_on_pools", "nest_stats",
]


class MemoryAPI(AllocationAPI, ConfigurationAPI, StatisticsAPI, HistoryAPI, PrivatePoolAPI,
                SleepAPI):
    """The memory functions of one device type (``"cpu"``, ``"xpu"``, ``"cuda"``)."""

    def functions(self) -> Dict[str, Any]:
        """The public functions, by name, for a namespace module to export."""
        exported = {name: getattr(self, name) for name in PUBLIC_FUNCTIONS + PUBLIC_CLASSES}
        if self.type_name == "xpu":          # torch.xpu's takes no device (its 5th argument is clear_history)
            exported["_record_memory_history"] = self._record_xpu_memory_history
        else:                                # torch.cuda's takes include_traces (torch.xpu's does not)
            exported["memory_snapshot"] = self._memory_snapshot_with_traces
        exported.update(self._hot_functions())
        return exported

    def _hot_functions(self) -> Dict[str, Any]:
        """``caching_allocator_alloc``/``delete``, typed in the registry for
        the common call (the current device), these methods for the rest;
        builtin functions with these methods' docstrings and signatures."""
        alloc, delete = namespace_alloc_functions(_devices.types_by_name(), self.type_name,
                                                  self.caching_allocator_alloc, self.caching_allocator_delete)
        return {"caching_allocator_alloc": alloc, "caching_allocator_delete": delete}


PUBLIC_FUNCTIONS = (
    "is_available", "device_count", "current_device", "set_device",
    "caching_allocator_alloc", "caching_allocator_delete", "record_stream",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "empty_cache",
    "change_current_allocator", "get_allocator_backend",
    "use_mem_pool", "caching_allocator_enable", "caching_allocator_disabled",
    "empty_virt_addr_cache",
    "sleep", "wake_up", "is_sleeping",
    "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "memory_allocated_by_client", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved",
    "memory_cached", "max_memory_cached", "get_memory_info", "mem_get_info",
    "memory_snapshot", "memory_summary", "caching_allocator",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
)

# The classes every namespace has (bound to its device type).
PUBLIC_CLASSES = ("MemPool",)
