"""Statistics: ``memory_stats`` and the figures read from it, their resets,
the device's memory information and ``memory_summary``."""
from __future__ import annotations

import collections
import warnings
from typing import Any, Dict, Tuple

from .. import _core
from .._observe.summary import clients_section, memory_summary_table
from .._runtime.devices import DeviceLike, device_index
from .device_type import DeviceTypeAPI


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


class StatisticsAPI(DeviceTypeAPI):
    """What a device type's caching allocators report."""

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
          (unimem: with expandable segments under ``max_reserved_ratio``,
          ``expandable_segments:True``'s default, every request is in the
          large pool, and ``small_pool`` stays 0.)

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

        Returns an empty ``OrderedDict`` before the device type's first
        allocator is made (PyTorch: before CUDA is initialised), and where the
        device type has no device; after that, a device not used yet has
        every statistic at 0.
        """
        stats = self._device_memory_stats(device)
        beside = self.stats_beside(device)
        if not beside:
            return stats
        stats.update(beside)
        return collections.OrderedDict(sorted(stats.items()))

    def _device_memory_stats(self, device: DeviceLike) -> "collections.OrderedDict[str, Any]":
        allocator = self._existing_if_available(device)
        if allocator is not None:
            return allocator.memory_stats()
        made = self._initialized()
        if not made:
            return collections.OrderedDict()
        # PyTorch makes every device's allocator at initialisation: the same
        # keys at 0 (max_split_size is the configuration, not a counter)
        return collections.OrderedDict(
            (key, value if key == "max_split_size" else 0) for key, value in made[0].memory_stats().items())

    def memory_stats_as_nested_dict(self, device: DeviceLike = None) -> Dict[str, Any]:
        r"""Return the result of :func:`memory_stats` as a nested dictionary."""
        return nest_stats(self.memory_stats(device))

    def reset_accumulated_memory_stats(self, device: DeviceLike = None) -> None:
        r"""Reset the "accumulated" (historical) stats tracked by the memory allocator.

        Accumulated stats correspond to the `"allocated"` and `"freed"` keys in each
        individual stat dict, as well as `"num_alloc_retries"` and `"num_ooms"`.
        """
        index, allocator = self._peek(device)
        if allocator is not None:
            allocator.reset_accumulated_stats()
        for pool in self.pools_beside(index):
            pool.reset_accumulated_stats()

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        r"""Reset the "peak" stats tracked by the memory allocator.

        Peak stats correspond to the `"peak"` key in each individual stat dict.
        """
        index, allocator = self._peek(device)
        if allocator is not None:
            allocator.reset_peak_stats()
        for pool in self.pools_beside(index):
            pool.reset_peak_stats()

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
        try:
            dtype = self._type()
        except RuntimeError as unavailable:     # no device of this type: see _peek
            self._never_used_index(device, unavailable)
            return 0
        return dtype.registry.memory_allocated(device_index(device, dtype))

    def memory_allocated_by_client(self, device: DeviceLike = None) -> Dict[str, int]:
        r"""Return :func:`memory_allocated` of a given device by the framework
        each block was handed out to (unimem's own addition).

        unimem is the one pool of a device for every framework in the process:
        a block remembers whose entry point allocated it. The keys, in this
        order, only those holding memory: ``"unimem"`` (unimem's own functions:
        ``caching_allocator_alloc``, ``unimem.xpu.empty``, ...), ``"torch"``
        (PyTorch's pluggable allocator, ``unimem.install_allocators(torch=True)``),
        ``"cupy"`` (``unimem.cuda.allocator``), ``"dpnp"`` (dpnp's arrays and its
        C++ scratch), ``"numba"`` (the EMM plugin) and ``"c"`` (C code through
        ``unimem.h``). The values are bytes after rounding and add up to
        :func:`memory_allocated`; memory freed while a stream may still use
        it is no one's. An empty dict before the device's first allocation.
        """
        allocator = self._existing_if_available(device)
        return {} if allocator is None else allocator.memory_allocated_by_client()

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        r"""Return the maximum memory occupied by tensors in bytes for a given device.

        By default, this returns the peak allocated memory since the beginning of
        this program. :func:`reset_peak_memory_stats` can be used to
        reset the starting point in tracking this metric.
        """
        allocator = self._existing_if_available(device)
        return 0 if allocator is None else allocator.max_memory_allocated()

    def memory_reserved(self, device: DeviceLike = None) -> int:
        r"""Return the current memory managed by the caching allocator in bytes for a given device."""
        allocator = self._existing_if_available(device)
        return 0 if allocator is None else allocator.memory_reserved()

    def max_memory_reserved(self, device: DeviceLike = None) -> int:
        r"""Return the maximum memory managed by the caching allocator in bytes for a given device.

        By default, this returns the peak cached memory since the beginning of this
        program. :func:`reset_peak_memory_stats` can be used to reset
        the starting point in tracking this metric.
        """
        allocator = self._existing_if_available(device)
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

        Where the figures come from, by backend:

        - CUDA: ``cudaMemGetInfo`` on the device.
        - XPU: the device's global memory (``SyclDevice.global_mem_size``) and
          its free memory where the device reports it (``free_memory``);
          else the total less what unimem holds on the device, and on a CPU
          device no more than the host's available memory.
        - ``cpu``: the system's available and total physical memory
          (``MemAvailable`` of ``/proc/meminfo``, ``os.sysconf``).
        - a :class:`unimem.PluggableAllocator`: its ``memory_info_fn``
          (``NotImplementedError`` without one).

        ``NotImplementedError`` for a backend without ``memory_info``, and
        ``RuntimeError`` when its answer is no pair of byte counts.
        """
        dtype = self._type()
        return _core.backend_memory_info(dtype.backend, device_index(device, dtype))

    mem_get_info = get_memory_info

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
        index = self._peek(device)[0]
        # unimem's addition after PyTorch's table: who holds the allocated
        # memory, once a framework other than unimem's own functions does
        return (memory_summary_table(self.memory_stats(index), self.pool.display_name, index, abbreviated)
                + clients_section(self.memory_allocated_by_client(index), index))
