"""``unimem.accelerator.memory``: the memory functions of the current
accelerator, shaped like ``torch.accelerator.memory`` (and the
``torch.cuda.memory`` names users still call). Every function here is also
``unimem.accelerator.<name>``, the same object.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Literal, Optional, Tuple

from .. import host
from .._runtime.registry import caching_allocator_alloc, caching_allocator_delete
from .._runtime.devices import DeviceLike, DeviceType, current_type, device_index as _device_index
from .._memory_api import MemoryAPI, MemoryLike
from .._memory.mempool import MemPool as _MemPool

if TYPE_CHECKING:
    from .._observe.history import PathLike

__all__ = [
    "empty_cache", "empty_virt_addr_cache", "sleep", "wake_up", "is_sleeping", "empty_host_cache", "get_memory_info", "mem_get_info",
    "get_allocator_backend",
    "max_memory_allocated",
    "max_memory_reserved", "memory_allocated", "memory_allocated_by_client", "memory_reserved", "memory_stats",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats",
    "memory_stats_as_nested_dict", "caching_allocator_alloc", "caching_allocator_delete",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "reset_max_memory_allocated", "reset_max_memory_cached", "memory_cached",
    "max_memory_cached", "memory_summary", "memory_snapshot", "record_stream",
    "host_memory_stats", "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats",
    "reset_accumulated_host_memory_stats",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
    "MemPool", "use_mem_pool", "caching_allocator_enable", "caching_allocator_disabled",
]

_apis: Dict[str, MemoryAPI] = {}


def _current() -> Tuple[DeviceType, MemoryAPI]:
    """The current accelerator's device type and its memory functions."""
    dtype = current_type()
    api = _apis.get(dtype.name)
    if api is None:
        api = _apis[dtype.name] = MemoryAPI(dtype.name)
    return dtype, api


# ---------------------------------------------------------------------------
# torch.accelerator.memory
# ---------------------------------------------------------------------------
def empty_cache() -> None:
    r"""Release all unoccupied cached memory currently held by the caching
    allocator so that those can be used in other application.

    .. note:: This function is a no-op if the memory allocator for the current
        accelerator has not been initialized.
    """
    _current()[1].empty_cache()


def empty_virt_addr_cache(device_index: DeviceLike = None, /) -> None:
    r"""Release the virtual address ranges that expandable segments of the
    current accelerator reserved and that no longer have any memory mapped
    (torch_npu's ``empty_virt_addr_cache``). :func:`empty_cache` unmaps free
    pages but keeps their addresses reserved; call it first.

    Args:
        device_index (:class:`unimem.device`, str, int, optional): the device
            index to select. Every initialized device of the current
            accelerator if ``None`` (default).
    """
    _current()[1].empty_virt_addr_cache(device_index)


def sleep(offload: bool = True, device_index: DeviceLike = None) -> None:
    r"""Give the memory of a device of the current accelerator back while
    every live block keeps its address (vLLM's sleep mode); allocating raises
    ``RuntimeError`` until :func:`wake_up`. ``offload`` (default) keeps the
    bytes of the live blocks in host memory for :func:`wake_up` to copy back.
    See :func:`unimem.cpu.sleep`.

    Args:
        offload (bool): keep the contents of the live blocks.
        device_index (:class:`unimem.device`, str, int, optional): the device
            index to select. The current device if ``None`` (default).
    """
    _current()[1].sleep(offload, device_index)


def wake_up(device_index: DeviceLike = None, /) -> None:
    r"""Back the memory :func:`sleep` gave back again, at the same addresses,
    and allow allocation again. See :func:`unimem.cpu.wake_up`.

    Args:
        device_index (:class:`unimem.device`, str, int, optional): the device
            index to select. The current device if ``None`` (default).
    """
    _current()[1].wake_up(device_index)


def is_sleeping(device_index: DeviceLike = None, /) -> bool:
    r"""Return whether a device of the current accelerator is asleep.

    Args:
        device_index (:class:`unimem.device`, str, int, optional): the device
            index to select. The current device if ``None`` (default).
    """
    return _current()[1].is_sleeping(device_index)


def memory_stats(device_index: DeviceLike = None, /) -> "collections.OrderedDict[str, Any]":
    r"""Return a dictionary of accelerator device memory allocator statistics for a given device index.

    The return value of this function is a dictionary of statistics, each of
    which is a non-negative integer (see :func:`unimem.cpu.memory_stats` for
    the list). Keys are PyTorch's: ``"allocated_bytes.all.current"``,
    ``"reserved_bytes.large_pool.peak"``, ``"num_ooms"``, ...

    Args:
        device_index (:class:`unimem.device`, str, int, optional): the index of the device to target.
            If not given, use :func:`current_device_index` by default.
            If a :class:`unimem.device` or str is provided, its type must match the current
            accelerator device type.

    Returns:
        OrderedDict[str, Any]: an ordered dictionary mapping statistic names to their values,
        empty before the first allocation on the device.
    """
    return _current()[1].memory_stats(device_index)


def memory_stats_as_nested_dict(device_index: DeviceLike = None, /) -> Dict[str, Any]:
    r"""Return the result of :func:`memory_stats` as a nested dictionary."""
    return _current()[1].memory_stats_as_nested_dict(device_index)


def memory_allocated(device_index: DeviceLike = None, /) -> int:
    r"""Return the current accelerator device memory occupied by tensors
    in bytes for a given device index.

    Args:
        device_index (:class:`unimem.device`, str, int, optional): the index of the device to target.
            If not given, use :func:`current_device_index` by default.
            If a :class:`unimem.device` or str is provided, its type must match the current
            accelerator device type.

    Returns:
        int: the current memory occupied by live tensors (in bytes) within the current process.
    """
    dtype = current_type()
    return dtype.registry.memory_allocated(_device_index(device_index, dtype))


def memory_allocated_by_client(device_index: DeviceLike = None, /) -> Dict[str, int]:
    r"""Return :func:`memory_allocated` of the current accelerator's device
    by the framework each block was handed out to (``{"torch": ..., "cupy":
    ..., "dpnp": ..., "numba": ..., "c": ..., "unimem": ...}``, only those
    holding memory; unimem's own addition).

    Returns:
        dict[str, int]: bytes by client, adding up to :func:`memory_allocated`.
    """
    return _current()[1].memory_allocated_by_client(device_index)


def max_memory_allocated(device_index: DeviceLike = None, /) -> int:
    r"""Return the current accelerator maximum device memory occupied by tensors
    in bytes for a given device index.

    By default, this returns the peak allocated memory since the beginning of
    this program. :func:`reset_peak_memory_stats` can be used to
    reset the starting point in tracking this metric.

    Returns:
        int: the peak memory occupied by live tensors (in bytes) within the current process.
    """
    return _current()[1].max_memory_allocated(device_index)


def memory_reserved(device_index: DeviceLike = None, /) -> int:
    r"""Return the current accelerator device memory managed by the caching allocator
    in bytes for a given device index.

    Returns:
        int: the current memory reserved by unimem (in bytes) within the current process.
    """
    return _current()[1].memory_reserved(device_index)


def max_memory_reserved(device_index: DeviceLike = None, /) -> int:
    r"""Return the current accelerator maximum device memory managed by the caching allocator
    in bytes for a given device index.

    By default, this returns the peak cached memory since the beginning of this
    program. :func:`reset_peak_memory_stats` can be used to reset
    the starting point in tracking this metric.

    Returns:
        int: the peak memory reserved by unimem (in bytes) within the current process.
    """
    return _current()[1].max_memory_reserved(device_index)


def reset_accumulated_memory_stats(device_index: DeviceLike = None, /) -> None:
    r"""Reset the "accumulated" (historical) stats tracked by the current accelerator
    memory allocator for a given device index.

    .. note:: This function is a no-op if the memory allocator for the current
        accelerator has not been initialized.
    """
    _current()[1].reset_accumulated_memory_stats(device_index)


def reset_peak_memory_stats(device_index: DeviceLike = None, /) -> None:
    r"""Reset the "peak" stats tracked by the current accelerator
    memory allocator for a given device index.

    .. note:: This function is a no-op if the memory allocator for the current
        accelerator has not been initialized.
    """
    _current()[1].reset_peak_memory_stats(device_index)


def get_memory_info(device_index: DeviceLike = None, /) -> Tuple[int, int]:
    r"""Return the current device memory information for a given device index.

    Returns:
        tuple[int, int]: a tuple of two integers (free_memory, total_memory) in bytes.
            The first value is the free memory on the device (available across all processes and applications),
            The second value is the device's total hardware memory capacity.
    """
    return _current()[1].get_memory_info(device_index)


mem_get_info = get_memory_info     # torch.cuda.memory's name for it


def get_allocator_backend() -> str:
    r"""Return a string describing the active allocator backend of the
    current accelerator: ``native``, or the pluggable allocator's name once
    :func:`unimem.change_current_allocator` installed one (see
    :func:`unimem.cuda.get_allocator_backend`)."""
    return _current()[1].get_allocator_backend()


# ---------------------------------------------------------------------------
# torch.cuda.memory names that users still call
# ---------------------------------------------------------------------------
def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    r"""Set memory fraction for a process.

    The fraction is used to limit the caching allocator to allocated memory on a device.
    The allowed value equals the total visible memory multiplied fraction.
    If trying to allocate more than the allowed value in a process, will raise an out of
    memory error in allocator.

    Args:
        fraction(float): Range: 0~1. Allowed memory equals total_memory * fraction.
        device (int, str or device, optional): selected device. If it is
            ``None`` the current device is used.
    """
    _current()[1].set_per_process_memory_fraction(fraction, device)


def get_per_process_memory_fraction(device: DeviceLike = None) -> float:
    r"""Get memory fraction for a process (1.0 unless one was set)."""
    return _current()[1].get_per_process_memory_fraction(device)


def reset_max_memory_allocated(device: DeviceLike = None) -> None:
    r"""Reset the starting point in tracking maximum memory occupied by tensors for a given device.

    .. warning::
        This function now calls :func:`reset_peak_memory_stats`, which resets
        /all/ peak memory stats.
    """
    _current()[1].reset_max_memory_allocated(device)


def reset_max_memory_cached(device: DeviceLike = None) -> None:
    r"""Reset the starting point in tracking maximum memory managed by the caching allocator
    for a given device.

    .. warning::
        This function now calls :func:`reset_peak_memory_stats`, which resets
        /all/ peak memory stats.
    """
    _current()[1].reset_max_memory_cached(device)


def memory_cached(device: DeviceLike = None) -> int:
    r"""Deprecated; see :func:`memory_reserved`."""
    return _current()[1].memory_cached(device)


def max_memory_cached(device: DeviceLike = None) -> int:
    r"""Deprecated; see :func:`max_memory_reserved`."""
    return _current()[1].max_memory_cached(device)


def memory_summary(device: DeviceLike = None, abbreviated: bool = False) -> str:
    r"""Return a human-readable printout of the current memory allocator statistics for a given device.

    This can be useful to display periodically during training, or when
    handling out-of-memory exceptions.
    """
    return _current()[1].memory_summary(device, abbreviated)


def memory_snapshot(mempool_id: Optional[Tuple[int, int]] = None,
                    include_traces: bool = True) -> List[Dict[str, Any]]:
    r"""Return a snapshot of the memory allocator state across all devices of
    the current accelerator (segments and their blocks, PyTorch's layout);
    only the segments of pool ``mempool_id`` (a :class:`MemPool`'s id) when given.
    ``include_traces``: torch.cuda's argument, accepted (segments carry no
    trace entries)."""
    return _current()[1]._memory_snapshot_with_traces(mempool_id, include_traces)


# ---------------------------------------------------------------------------
# private pools and the cache switch, on the current accelerator
# ---------------------------------------------------------------------------
class MemPool(_MemPool):
    __doc__ = _MemPool.__doc__


def use_mem_pool(pool: _MemPool, device: DeviceLike = None) -> ContextManager[None]:
    r"""A context manager that routes the current thread's allocations on
    ``device`` (the current one if ``None``) of the current accelerator to
    ``pool`` (see :func:`unimem.cuda.use_mem_pool`)."""
    return _current()[1].use_mem_pool(pool, device)


def caching_allocator_enable(value: bool = True) -> None:
    r"""Enable or disable the current accelerator's caching allocator. On by
    default (see :func:`unimem.cuda.caching_allocator_enable`)."""
    _current()[1].caching_allocator_enable(value)


def caching_allocator_disabled() -> ContextManager[None]:
    r"""Context manager that temporarily disables the current accelerator's caching allocator."""
    return _current()[1].caching_allocator_disabled()


def _record_memory_history(enabled: Optional[Literal["state", "all"]] = "all", *args: Any,
                           **kwargs: Any) -> None:
    r"""Record the history of the current accelerator's allocations (see
    :func:`unimem.cpu._record_memory_history` for the arguments, as in
    ``torch.cuda.memory._record_memory_history``)."""
    _current()[1]._record_memory_history(enabled, *args, **kwargs)


def _snapshot(device: DeviceLike = None, augment_with_fx_traces: bool = False) -> Dict[str, Any]:
    r"""Return a snapshot of the current accelerator's memory allocator state
    (``segments`` and ``device_traces``, PyTorch's layout).
    ``augment_with_fx_traces`` (a bool) has no effect: unimem records no FX
    graphs."""
    return _current()[1]._snapshot(device, augment_with_fx_traces)


def _dump_snapshot(filename: PathLike = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    r"""Save a pickled :func:`_snapshot` to a file (readable by pytorch.org/memory_viz)."""
    _current()[1]._dump_snapshot(filename, augment_with_fx_traces)


def record_stream(memory: MemoryLike, stream: Any) -> None:
    r"""Mark the memory as used by the stream ``stream`` (``torch.Tensor.record_stream``),
    on the current accelerator: an array from its pool, a memory object or a
    block's address, and one of its streams (``None``: the current one), as
    for :func:`unimem.cpu.record_stream`.
    """
    _current()[1].record_stream(memory, stream)


host_memory_stats = host.host_memory_stats
host_memory_stats_as_nested_dict = host.host_memory_stats_as_nested_dict
reset_peak_host_memory_stats = host.reset_peak_host_memory_stats
reset_accumulated_host_memory_stats = host.reset_accumulated_host_memory_stats
empty_host_cache = host.empty_host_cache
