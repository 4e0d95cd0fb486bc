"""The memory functions every device namespace offers (``unimem.cpu``,
``unimem.xpu``, ``unimem.cuda``), in ``torch.cuda.memory``'s names and wording.

A :class:`MemoryAPI` is bound to one device type; the namespace modules export
its methods as module functions.
"""
from __future__ import annotations

import collections
import functools
import numbers
import operator
import sys
import warnings
from typing import (Any, Callable, Dict, Iterable, List, Literal, Optional, Protocol, SupportsIndex, Tuple,
                    Union)

import numpy

from . import _core
from ._runtime.registry import namespace_alloc_functions
from ._observe import history as _history
from ._runtime import devices as _devices
from ._runtime.config import settings_from_env
from ._runtime.devices import DEVICE_POOLS, DeviceLike, DeviceType, device_index, get_type
from ._observe.summary import memory_summary_table



def numpy_dtype(dtype: Any) -> "numpy.dtype[Any]":
    """``numpy.dtype(dtype)``, failing only as the array functions document:
    NumPy parses some strings with ``ast.literal_eval`` and lets its
    SyntaxError (or others) out, for ``b","`` say; those become a TypeError."""
    try:
        return numpy.dtype(dtype)
    except (TypeError, ValueError):
        raise
    except Exception as exc:
        raise TypeError(f"data type {dtype!r} not understood") from exc


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


class HasPointer(Protocol):
    """A memory object with its address as ``ptr``: a CuPy ``Memory`` (such as
    :class:`unimem.cuda.PooledMemory`) or ``MemoryPointer``, an :class:`unimem.Allocation`."""

    @property
    def ptr(self) -> int: ...


class HasArrayInterface(Protocol):
    """A NumPy array (NumPy's ``__array_interface__``)."""

    @property
    def __array_interface__(self) -> Dict[str, Any]: ...


class HasCudaArrayInterface(Protocol):
    """A CUDA array such as a CuPy ndarray (``__cuda_array_interface__``)."""

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...


class HasSyclUsmArrayInterface(Protocol):
    """A SYCL USM array or memory object: a dpnp ndarray, a dpctl
    ``usm_ndarray`` or ``MemoryUSMDevice``/``Shared``/``Host``."""

    @property
    def __sycl_usm_array_interface__(self) -> Dict[str, Any]: ...


MemoryLike = Union[SupportsIndex, HasPointer, HasArrayInterface, HasCudaArrayInterface,
                   HasSyclUsmArrayInterface]
"""What ``record_stream`` takes: an array, a memory object, or an address."""

ADDRESS_LIMIT = 1 << 64


def block_address(memory: MemoryLike) -> int:
    """The address of the block behind ``memory``: where the whole buffer an
    array views starts (a view's first element may lie further in), a memory
    object's address, or an address as given. 0 when there is no memory (an
    empty array, a freed ``PooledMemory``), as for PyTorch's empty tensors.

    Raises ``TypeError`` for what is none of these (``bool``, ``float``,
    ``None``, an object with no address) and ``ValueError`` for an integer
    that is no address."""
    if isinstance(memory, bool):            # an int to Python, but no address
        raise _not_memory(memory)
    if isinstance(memory, numbers.Integral):    # an int or a NumPy integer (which has an array interface)
        address = operator.index(memory)
    else:
        start = _buffer_start(memory)
        if start is None:
            raise _not_memory(memory)
        address = start
    if not 0 <= address < ADDRESS_LIMIT:
        raise ValueError(f"invalid address {address!r}: not a pointer")
    return address


def _not_memory(memory: object) -> TypeError:
    return TypeError(f"expected an array, a memory object (MemoryPointer, Memory, MemoryUSM*, "
                     f"unimem.Allocation) or an address, got {type(memory).__name__}")


def _buffer_start(memory: Any) -> Optional[int]:
    """Where the buffer behind an array or memory object starts (0 for an
    empty array); None for what is neither. The array interfaces are looked
    up on the type: reading CuPy's would ask CUDA for the current stream."""
    kind = type(memory)
    if hasattr(kind, "__sycl_usm_array_interface__"):
        if getattr(memory, "size", None) == 0:
            return 0
        array = memory.get_array() if hasattr(memory, "get_array") else memory   # dpnp -> usm_ndarray
        buffer = getattr(array, "usm_data", array)       # a usm_ndarray's whole buffer, or MemoryUSM*
        return _integer_attribute(buffer, "_pointer")
    if hasattr(kind, "__cuda_array_interface__"):
        if memory.size == 0:
            return 0
        whole = getattr(getattr(memory, "data", None), "mem", None)
        if whole is not None:                             # CuPy: ndarray.data is a MemoryPointer
            return _integer_attribute(whole, "ptr")
        return _integer_attribute(memory.__cuda_array_interface__["data"], 0)
    if hasattr(memory, "mem"):                            # a CuPy MemoryPointer: its whole Memory
        return _integer_attribute(memory.mem, "ptr")
    if hasattr(kind, "__array_interface__"):
        if getattr(memory, "size", None) == 0:
            return 0
        # NumPy collapses a view's base to the object owning the buffer (for
        # unimem.cpu arrays, the pool block's exporter); its interface gives the start.
        owner = memory
        while getattr(owner, "base", None) is not None and hasattr(type(owner.base), "__array_interface__"):
            owner = owner.base
        return _integer_attribute(owner.__array_interface__["data"], 0)
    if hasattr(memory, "ptr"):                            # CuPy Memory, PooledMemory, an Allocation
        return _integer_attribute(memory, "ptr")
    return None


def _integer_attribute(holder: Any, key: Union[str, int]) -> int:
    value = holder[key] if isinstance(key, int) else getattr(holder, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the address of {type(holder).__name__} is not an int: {value!r}")
    return value


def record_stream_on_pools(memory: MemoryLike, stream: Any,
                           pools: Iterable[Callable[[int], Optional[_core.CachingAllocator]]],
                           stream_handle: Callable[[_core.CachingAllocator], int], pools_name: str) -> None:
    """``record_stream`` for every namespace: the block behind ``memory``,
    looked for with each of ``pools`` (``address -> its allocator or None``)
    in turn, is marked as used by ``stream_handle(owner)``.

    Nothing changes when ``memory`` is refused, its block is not in
    ``pools_name`` or the stream is: the errors come before the record."""
    address = block_address(memory)
    if address == 0:            # no memory, nothing to protect (as PyTorch does for empty tensors)
        return
    for find_owner in pools:
        owner = find_owner(address)
        if owner is not None:
            owner.record_stream(address, stream_handle(owner))
            return
    raise ValueError(f"address {address:#x} is not a live block of {pools_name}")


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
        self.pool = DEVICE_POOLS[type_name]

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

    def record_stream(self, memory: MemoryLike, stream: Any) -> None:
        r"""Mark the memory as used by the stream ``stream``.

        When the memory is deallocated, ensure the block is not reused for
        another allocation until all work queued on ``stream`` at the time of
        deallocation is complete (``torch.Tensor.record_stream``).

        Args:
            memory: an array whose memory comes from this device type's pool
                (a CuPy ndarray, a dpnp ndarray or dpctl ``usm_ndarray``, a
                NumPy array from :mod:`unimem.cpu`), a memory object (a CuPy
                ``MemoryPointer`` or ``PooledMemory``, a dpctl ``MemoryUSM*``,
                an :class:`unimem.Allocation`) or the address of a block, as
                :func:`caching_allocator_alloc` returns. An empty array (no
                memory) is left alone.
            stream: a stream of this device type (a CuPy or PyTorch stream or
                a ``cudaStream_t`` as an int; a ``dpctl.SyclQueue``; an int
                handle), or ``None`` for the current stream.

        Raises ``TypeError`` for what is no memory and ``ValueError`` for an
        address that is not a live block of this device type's pool; nothing
        is recorded then.
        """
        registry = self._type().registry
        record_stream_on_pools(memory, stream, [registry.find_owner],
                               lambda owner: registry.stream_handle_of(stream, owner.device),
                               f"the {self.type_name} allocator")

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
        for allocator in self._initialized():
            allocator.empty_cache()

    def _initialized(self) -> List[_core.CachingAllocator]:
        """The allocators made so far (none when the device type has none)."""
        try:
            return list(self._type().registry.initialized().values())
        except RuntimeError:
            return []

    def empty_virt_addr_cache(self, device: DeviceLike = None) -> None:
        r"""Release the virtual address ranges reserved by expandable segments
        that no longer have any physical memory mapped into them.

        With ``expandable_segments:True`` in ``UNIMEM_ALLOC_CONF``, each
        stream and pool reserves a large range of virtual addresses once and
        maps memory at its end as needed; :func:`empty_cache` unmaps the free
        pages but keeps the addresses reserved, so that the segment can grow
        again in place. This function gives the fully unmapped ranges back
        (torch_npu's ``torch_npu.npu.empty_virt_addr_cache``). Call
        :func:`empty_cache` first to unmap what is cached.

        Args:
            device (torch.device or int, optional): selected device. Every
                initialized device if ``None`` (default).

        .. note:: This function is a no-op if the memory allocator has not
            been initialized, or does not use expandable segments.
        """
        if device is not None:
            allocator = self._existing(device)
            if allocator is not None:
                allocator.empty_virt_addr_cache()
            return
        for allocator in self._initialized():
            allocator.empty_virt_addr_cache()

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
        return _history.snapshot(self.pool, registry)["segments"]

    def _record_memory_history(self, enabled: Optional[Literal["state", "all"]] = "all",
                               context: Optional[Literal["state", "alloc", "all"]] = "all",
                               stacks: Literal["python", "all"] = "python", max_entries: int = sys.maxsize,
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
        _history.record_memory_history(self.pool, self._type().registry, enabled, context,
                                       stacks, max_entries, clear_history, skip_actions)

    def _snapshot(self, device: DeviceLike = None) -> Dict[str, Any]:
        r"""Save a snapshot of memory state at the time it was called: a dict
        with ``segments`` and ``device_traces`` in PyTorch's layout (see
        ``torch.cuda.memory._snapshot``), readable by ``torch.cuda._memory_viz``
        and pytorch.org/memory_viz."""
        return _history.snapshot(self.pool, self._type().registry)

    def _dump_snapshot(self, filename: "_history.PathLike" = "dump_snapshot.pickle") -> None:
        r"""Save a pickled version of the :func:`_snapshot` dictionary to a file.

        This file can be opened by the interactive snapshot viewer at pytorch.org/memory_viz

        Args:
            filename (str or os.PathLike, optional): Name of the file to create.
                Defaults to "dump_snapshot.pickle". Anything but a path (a file
                descriptor, say) is a ``TypeError``.
        """
        _history.dump_snapshot(self.pool, self._type().registry, filename)

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
        return memory_summary_table(self.memory_stats(index), self.pool.display_name,
                                    index, abbreviated)

    def functions(self) -> Dict[str, Any]:
        """The public functions, by name, for a namespace module to export."""
        exported = {name: getattr(self, name) for name in PUBLIC_FUNCTIONS}
        exported.update(self._hot_functions())
        return exported

    def _hot_functions(self) -> Dict[str, Any]:
        """``caching_allocator_alloc``/``delete``, typed in the core for the
        common call (the current device), these methods for the rest."""
        fast = namespace_alloc_functions(_devices.types_by_name(), self.type_name,
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
    "empty_virt_addr_cache",
    "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "get_memory_info", "mem_get_info",
    "memory_snapshot", "memory_summary", "caching_allocator",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
)
