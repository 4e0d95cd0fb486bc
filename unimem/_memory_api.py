"""The memory functions every device namespace offers (``unimem.cpu``,
``unimem.xpu``, ``unimem.cuda``), in ``torch.cuda.memory``'s names and wording.

A :class:`MemoryAPI` is bound to one device type; the namespace modules export
its methods as module functions.
"""
from __future__ import annotations

import collections
import functools
import numbers
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

from . import _core
from ._observe import history as _history
from ._runtime import devices as _devices
from ._runtime.config import settings_from_env
from ._runtime.devices import DISPLAY_NAMES, DeviceLike, DeviceType, device_index, get_type
from ._observe.summary import memory_summary_table


def nest_stats(flat: Dict[str, Any]) -> Dict[str, Any]:
    """``{"a.b.c": v}`` -> ``{"a": {"b": {"c": v}}}``."""
    nested: Dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def check_fraction(fraction: Any) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:   # also refuses NaN
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    return fraction


class MemoryAPI:
    """The memory functions of one device type (``"cpu"``, ``"xpu"``, ``"cuda"``)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    # -- plumbing ---------------------------------------------------------
    def _type(self) -> DeviceType:
        return get_type(self.type_name)

    def _index(self, device: DeviceLike) -> int:
        return device_index(device, self._type())

    def _existing(self, device: DeviceLike) -> Optional[_core.CachingAllocator]:
        dtype = self._type()
        return dtype.registry.peek(device_index(device, dtype))

    def caching_allocator(self, device: DeviceLike = None) -> _core.CachingAllocator:
        """The caching allocator of ``device`` (created if needed)."""
        dtype = self._type()
        return dtype.allocator(device_index(device, dtype))

    # -- devices ----------------------------------------------------------
    def is_available(self) -> bool:
        r"""Return a bool indicating if this device type is available."""
        try:
            return self._type().device_count > 0
        except RuntimeError:
            return False

    def device_count(self) -> int:
        r"""Return the number of devices of this type available (0 if none)."""
        try:
            return self._type().device_count
        except RuntimeError:
            return 0

    def current_device(self) -> int:
        r"""Return the index of the currently selected device."""
        return self._type().current_index()

    def set_device(self, device: DeviceLike) -> None:
        r"""Set the current device."""
        dtype = self._type()
        dtype.set_current_index(device_index(device, dtype, optional=False))

    # -- allocation -------------------------------------------------------
    def caching_allocator_alloc(self, size: int, device: DeviceLike = None, stream: Any = None) -> int:
        r"""Perform a memory allocation using the caching allocator.

        Memory is allocated for a given device and a stream, this
        function is intended to be used for interoperability with other
        frameworks. Allocated memory is released through
        :func:`caching_allocator_delete`.

        Args:
            size (int): number of bytes to be allocated.
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
            stream (int or stream object, optional): selected stream. If is ``None`` then
                the default stream for the selected device is used.
        """
        dtype = self._type()
        index = None if device is None else device_index(device, dtype)
        return dtype.registry.alloc(size, index, stream)

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        r"""Delete memory allocated using the caching allocator.

        Memory allocated with :func:`caching_allocator_alloc`.
        is freed here. The associated device and stream are tracked inside
        the allocator.

        Args:
            mem_ptr (int): memory address to be freed by the allocator.
        """
        self._type().registry.delete(mem_ptr)

    def record_stream(self, ptr: int, stream: Any) -> None:
        r"""Mark the memory at ``ptr`` as used by ``stream``: once freed, it is
        reused only after the work queued on ``stream`` up to then has completed
        (``torch.Tensor.record_stream``)."""
        registry = self._type().registry
        owner = registry.find_owner(ptr)
        if owner is None:
            raise ValueError(f"pointer {ptr!r} is not a live allocation of the {self.type_name} allocator")
        owner.record_stream(ptr, registry.stream_handle_of(stream, owner.device))

    def set_per_process_memory_fraction(self, fraction: float, device: DeviceLike = None) -> None:
        r"""Set memory fraction for a process.

        The fraction is used to limit the caching allocator to allocated memory on a device.
        The allowed value equals the total visible memory multiplied fraction.
        If trying to allocate more than the allowed value in a process, will raise an out of
        memory error in allocator.

        Args:
            fraction(float): Range: 0~1. Allowed memory equals total_memory * fraction.
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
        """
        dtype = self._type()
        index = device_index(device, dtype)
        # PyTorch takes a float and nothing else (an int 1 is a TypeError).
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        fraction = check_fraction(fraction)
        dtype.allocator(index).set_memory_fraction(fraction)

    def get_per_process_memory_fraction(self, device: DeviceLike = None) -> float:
        r"""Get memory fraction for a process.

        Args:
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
        Returns:
            memory fraction, in range 0~1. Allowed memory equals total_memory * fraction.
            Before the first allocation on the device, the fraction its
            allocator will start with (``per_process_memory_fraction`` of
            ``UNIMEM_ALLOC_CONF``, else 1.0), as PyTorch reads its config.
        """
        allocator = self._existing(device)
        if allocator is not None:
            return allocator.get_memory_fraction()
        configured = settings_from_env().per_process_memory_fraction
        return 1.0 if configured is None else configured

    def empty_cache(self) -> None:
        r"""Release all unoccupied cached memory currently held by the caching
        allocator so that those can be used in other application.

        .. note:: This function is a no-op if the memory allocator has not been initialized.
        """
        try:
            allocators = self._type().registry.initialized()
        except RuntimeError:
            return
        for allocator in allocators.values():
            allocator.empty_cache()

    # -- statistics -------------------------------------------------------
    def memory_stats(self, device: DeviceLike = None) -> "collections.OrderedDict[str, Any]":
        r"""Return a dictionary of memory allocator statistics for a given device.

        The return value of this function is a dictionary of statistics, each of
        which is a non-negative integer.

        Core statistics:

        - ``"allocated.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          number of allocation requests received by the memory allocator
          (also served as ``"allocation.*"``, the name PyTorch's C++ core uses).
        - ``"allocated_bytes.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          amount of allocated memory.
        - ``"segment.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          number of reserved segments from device memory allocation.
        - ``"reserved_bytes.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          amount of reserved memory.
        - ``"active.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          number of active memory blocks.
        - ``"active_bytes.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          amount of active memory.
        - ``"inactive_split.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          number of inactive, non-releasable memory blocks.
        - ``"inactive_split_bytes.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          amount of inactive, non-releasable memory.
        - ``"requested_bytes.{all,large_pool,small_pool}.{current,peak,allocated,freed}"``:
          memory requested by client code (before rounding).

        For these core statistics, values are broken down as follows.

        Pool type:

        - ``all``: combined statistics across all memory pools.
        - ``large_pool``: statistics for the large allocation pool (> 1 MiB).
        - ``small_pool``: statistics for the small allocation pool (<= 1 MiB).

        Metric type:

        - ``current``: current value of this metric.
        - ``peak``: maximum value of this metric.
        - ``allocated``: historical total increase in this metric.
        - ``freed``: historical total decrease in this metric.

        In addition to the core statistics, we also provide some simple event
        counters:

        - ``"num_alloc_retries"``: number of failed device memory allocation calls that
          result in a cache flush and retry.
        - ``"num_ooms"``: number of out-of-memory errors thrown.
        - ``"num_sync_all_streams"``: number of ``synchronize_and_free_events`` calls.
        - ``"num_device_alloc"``: number of device memory allocation calls.
        - ``"num_device_free"``: number of device memory free calls.

        And the oversize statistics (``"oversize_allocations.*"``,
        ``"oversize_segments.*"``: blocks of at least ``max_split_size``) and
        ``"max_split_size"`` itself (-1 when unlimited).

        Returns an empty ``OrderedDict`` before the first allocation on the device.
        """
        allocator = self._existing(device)
        if allocator is None:
            return collections.OrderedDict()
        return allocator.memory_stats()

    def memory_stats_as_nested_dict(self, device: DeviceLike = None) -> Dict[str, Any]:
        r"""Return the result of :func:`memory_stats` as a nested dictionary."""
        return nest_stats(self.memory_stats(device))

    def reset_accumulated_memory_stats(self, device: DeviceLike = None) -> None:
        r"""Reset the "accumulated" (historical) stats tracked by the memory allocator.

        Accumulated stats correspond to the `"allocated"` and `"freed"` keys in each
        individual stat dict, as well as `"num_alloc_retries"` and `"num_ooms"`.
        """
        allocator = self._existing(device)
        if allocator is not None:
            allocator.reset_accumulated_stats()

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        r"""Reset the "peak" stats tracked by the memory allocator.

        Peak stats correspond to the `"peak"` key in each individual stat dict.
        """
        allocator = self._existing(device)
        if allocator is not None:
            allocator.reset_peak_stats()

    def reset_max_memory_allocated(self, device: DeviceLike = None) -> None:
        r"""Reset the starting point in tracking maximum memory occupied by tensors for a given device.

        .. warning::
            This function now calls :func:`reset_peak_memory_stats`, which resets
            /all/ peak memory stats.
        """
        warnings.warn("reset_max_memory_allocated now calls reset_peak_memory_stats, "
                      "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
        self.reset_peak_memory_stats(device)

    def reset_max_memory_cached(self, device: DeviceLike = None) -> None:
        r"""Reset the starting point in tracking maximum memory managed by the caching allocator.

        .. warning::
            This function now calls :func:`reset_peak_memory_stats`, which resets
            /all/ peak memory stats.
        """
        warnings.warn("reset_max_memory_cached now calls reset_peak_memory_stats, "
                      "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
        self.reset_peak_memory_stats(device)

    def memory_allocated(self, device: DeviceLike = None) -> int:
        r"""Return the current memory occupied by tensors in bytes for a given device."""
        dtype = self._type()
        return dtype.registry.memory_allocated(device_index(device, dtype))

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        r"""Return the maximum memory occupied by tensors in bytes for a given device.

        By default, this returns the peak allocated memory since the beginning of
        this program. :func:`reset_peak_memory_stats` can be used to
        reset the starting point in tracking this metric.
        """
        allocator = self._existing(device)
        return 0 if allocator is None else allocator.max_memory_allocated()

    def memory_reserved(self, device: DeviceLike = None) -> int:
        r"""Return the current memory managed by the caching allocator in bytes for a given device."""
        allocator = self._existing(device)
        return 0 if allocator is None else allocator.memory_reserved()

    def max_memory_reserved(self, device: DeviceLike = None) -> int:
        r"""Return the maximum memory managed by the caching allocator in bytes for a given device.

        By default, this returns the peak cached memory since the beginning of this
        program. :func:`reset_peak_memory_stats` can be used to reset
        the starting point in tracking this metric.
        """
        allocator = self._existing(device)
        return 0 if allocator is None else allocator.max_memory_reserved()

    def memory_cached(self, device: DeviceLike = None) -> int:
        r"""Deprecated; see :func:`memory_reserved`."""
        warnings.warn("memory_cached has been renamed to memory_reserved", FutureWarning, stacklevel=2)
        return self.memory_reserved(device)

    def max_memory_cached(self, device: DeviceLike = None) -> int:
        r"""Deprecated; see :func:`max_memory_reserved`."""
        warnings.warn("max_memory_cached has been renamed to max_memory_reserved", FutureWarning, stacklevel=2)
        return self.max_memory_reserved(device)

    def get_memory_info(self, device: DeviceLike = None) -> Tuple[int, int]:
        r"""Return the current device memory information for a given device.

        Returns:
            tuple[int, int]: a tuple of two integers (free_memory, total_memory) in bytes.
            The first value is the free memory on the device (available across all
            processes and applications), the second value is the device's total
            hardware memory capacity.
        """
        dtype = self._type()
        free, total = dtype.backend.memory_info(device_index(device, dtype))
        return int(free), int(total)

    mem_get_info = get_memory_info

    # -- state ------------------------------------------------------------
    def memory_snapshot(self) -> List[Dict[str, Any]]:
        r"""Return a snapshot of the memory allocator state across all devices.

        A list of segments, each with its blocks (``address``, ``size``,
        ``requested_size``, ``state``: ``active_allocated``,
        ``active_pending_free`` or ``inactive``, and the ``frames`` that
        allocated it while history is recorded), in PyTorch's field names.
        Interpreting the output of this function requires familiarity with the
        memory allocator internals.
        """
        try:
            registry = self._type().registry
        except RuntimeError:
            return []
        return _history.snapshot(self.type_name, registry)["segments"]

    def _record_memory_history(self, enabled: Optional[str] = "all", context: Optional[str] = "all",
                               stacks: str = "python", max_entries: int = sys.maxsize,
                               device: DeviceLike = None, clear_history: bool = False,
                               skip_actions: Optional[List[str]] = None) -> None:
        r"""Enable recording of stack traces associated with memory
        allocations, so you can tell what allocated any piece of memory in
        :func:`_snapshot()`.

        In addition to keeping stack traces with each current allocation and free,
        this will also enable recording of a history of all alloc/free events.
        Up to ``max_entries`` entries are kept: newer entries overwrite the oldest.

        Args:
            enabled (Literal[None, "state", "all"], optional):
                `None`, disable recording memory history (the recorded
                alloc/free history is dropped, as in PyTorch; the frames of
                blocks still live stay until they are freed).
                `"state"`, keep information for currently allocated memory
                (and, as PyTorch, only the last alloc/free entry).
                `"all"`, additionally keep a history of all alloc/free calls.
                Defaults to "all".
            context (Literal[None, "state", "alloc", "all"], optional):
                `None`, Do not record any tracebacks.
                `"state"`, Record tracebacks for currently allocated memory.
                `"alloc"`, additionally keep tracebacks for alloc calls (the
                history entry of a free carries the traceback that allocated
                the memory).
                `"all"`, additionally keep tracebacks for free calls.
                Defaults to "all".
            stacks (Literal["python", "all"], optional): Python frames are
                recorded in both cases (there are no C++ frames to add).
            max_entries (int, optional): Keep a maximum of `max_entries`
                alloc/free events in the recorded history recorded.
            device: ignored; recording applies to every device of this type, as in PyTorch.
            clear_history (bool, optional): Clear history when enabling, defaults to False.
            skip_actions (list[str], optional): action types not to record
                (``"alloc"``, ``"free_requested"``, ``"free_completed"``,
                ``"segment_alloc"``, ``"segment_free"``, ``"oom"``).
        """
        _history.record_memory_history(self.type_name, self._type().registry, enabled, context,
                                       stacks, max_entries, clear_history, skip_actions)

    def _snapshot(self, device: DeviceLike = None) -> Dict[str, Any]:
        r"""Save a snapshot of memory state at the time it was called: a dict
        with ``segments`` and ``device_traces`` in PyTorch's layout (see
        ``torch.cuda.memory._snapshot``), readable by ``torch.cuda._memory_viz``
        and pytorch.org/memory_viz."""
        return _history.snapshot(self.type_name, self._type().registry)

    def _dump_snapshot(self, filename: "_history.PathLike" = "dump_snapshot.pickle") -> None:
        r"""Save a pickled version of the :func:`_snapshot` dictionary to a file.

        This file can be opened by the interactive snapshot viewer at pytorch.org/memory_viz

        Args:
            filename (str or os.PathLike, optional): Name of the file to create.
                Defaults to "dump_snapshot.pickle". Anything but a path (a file
                descriptor, say) is a ``TypeError``.
        """
        _history.dump_snapshot(self.type_name, self._type().registry, filename)

    def memory_summary(self, device: DeviceLike = None, abbreviated: bool = False) -> str:
        r"""Return a human-readable printout of the current memory allocator statistics for a given device.

        This can be useful to display periodically during training, or when
        handling out-of-memory exceptions.

        Args:
            device (int, str or device, optional): selected device. Returns
                printout for the current device if :attr:`device` is ``None`` (default).
            abbreviated (bool, optional): whether to return an abbreviated summary
                (default: False).
        """
        index = self._index(device)
        return memory_summary_table(self.memory_stats(index), DISPLAY_NAMES[self.type_name],
                                    index, abbreviated)

    def functions(self) -> Dict[str, Any]:
        """The public functions, by name, for a namespace module to export."""
        exported = {name: getattr(self, name) for name in PUBLIC_FUNCTIONS}
        exported.update(self._hot_functions())
        return exported

    def _hot_functions(self) -> Dict[str, Any]:
        """``caching_allocator_alloc``/``delete``, typed in the core for the
        common call (the current device), these methods for the rest."""
        fast = _core.namespace_alloc_functions(_devices.types_by_name(), self.type_name,
                                               self.caching_allocator_alloc, self.caching_allocator_delete)
        exported = {}
        for function, method in zip(fast, (self.caching_allocator_alloc, self.caching_allocator_delete)):
            functools.update_wrapper(function, method)
            exported[method.__name__] = function
        return exported


PUBLIC_FUNCTIONS = (
    "is_available", "device_count", "current_device", "set_device",
    "caching_allocator_alloc", "caching_allocator_delete", "record_stream",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "empty_cache",
    "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "get_memory_info", "mem_get_info",
    "memory_snapshot", "memory_summary", "caching_allocator",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
)
