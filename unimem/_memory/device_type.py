"""The device type a :class:`unimem._memory_api.MemoryAPI` is bound to: its
allocators, and the device functions (``is_available``, ``set_device``...)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _core
from .._runtime.devices import DEVICE_POOLS, DeviceLike, DeviceType, device_index, get_type, is_negative_index


@dataclass(frozen=True)
class PoolsBeside:
    """Pools whose statistics a device type's ``memory_stats`` shows beside
    each device's own, under ``prefix`` (XPU: a device's shared USM pool);
    the reset functions and ``empty_cache`` reach them too. ``made(index)``:
    those made so far for device ``index``, or for every device with None."""

    prefix: str
    made: Callable[[Optional[int]], List[_core.CachingAllocator]]


_POOLS_BESIDE: Dict[str, PoolsBeside] = {}


def show_pools_beside(type_name: str, pools: PoolsBeside) -> None:
    """Have every memory API of ``type_name`` (its namespace's and
    ``unimem.accelerator``'s) show and manage ``pools`` beside its devices'."""
    _POOLS_BESIDE[type_name] = pools


def pools_beside(type_name: str, index: Optional[int]) -> List[_core.CachingAllocator]:
    """The pools made so far beside device ``index`` of ``type_name`` (every
    device's for None): those :func:`show_pools_beside` named."""
    beside = _POOLS_BESIDE.get(type_name)
    return beside.made(index) if beside is not None else []


def synchronize_device(dtype: DeviceType, index: int) -> None:
    """Wait for all work on device ``index`` of ``dtype`` (its backend's
    ``synchronize``: a user backend without one has no asynchronous work),
    then commit the frees that the finished work let go of on a runtime's
    thread, in the device's pool, the pools beside it (XPU's shared USM) and
    the pinned host pool."""
    device_synchronize = getattr(dtype.backend, "synchronize", None)
    if device_synchronize is None:
        return
    device_synchronize(index)
    from .. import host        # unimem.host imports this package: imported here, once it is loaded
    for pool in [dtype.registry.initialized().get(index), *pools_beside(dtype.name, index), host._existing()]:
        if pool is not None:
            pool.process_events()


class _DefaultDeviceOnly:
    """What :func:`device_index` reads a device argument against where a
    device type has no device: the one device a program names by default."""

    device_count = 1

    def __init__(self, name: str) -> None:
        self.name = name

    def current_index(self) -> int:
        return 0


class DeviceTypeAPI:
    """The memory functions of one device type (``"cpu"``, ``"xpu"``, ``"cuda"``):
    the plumbing every part of :class:`unimem._memory_api.MemoryAPI` shares."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.pool = DEVICE_POOLS[type_name]

    def pools_beside(self, index: Optional[int]) -> List[_core.CachingAllocator]:
        """The pools shown beside device ``index``'s (every device's for None): :class:`PoolsBeside`."""
        return pools_beside(self.type_name, index)

    def stats_beside(self, device: DeviceLike) -> Dict[str, Any]:
        """The statistics of the pools beside ``device``'s, their keys prefixed."""
        beside = _POOLS_BESIDE.get(self.type_name)
        if beside is None:
            return {}
        return {beside.prefix + key: value for pool in beside.made(self._index(device))
                for key, value in pool.memory_stats().items()}

    # -- plumbing ---------------------------------------------------------
    def _type(self) -> DeviceType:
        return get_type(self.type_name)

    def _index(self, device: DeviceLike) -> int:
        return device_index(device, self._type())

    def _existing(self, device: DeviceLike) -> Optional[_core.CachingAllocator]:
        dtype = self._type()
        return dtype.registry.peek(device_index(device, dtype))

    def _peek(self, device: DeviceLike) -> Tuple[int, Optional[_core.CachingAllocator]]:
        """The index ``device`` names and its allocator, None if not made yet.

        Where this device type has no device (``unimem.cuda`` without a GPU)
        the device a program names by default (None, 0, ``"cuda"``,
        ``"cuda:0"``) is one never used, (0, None): its statistics read as
        PyTorch's do before CUDA is initialised (an empty ``memory_stats``,
        zeros, resets that do nothing), so that code measuring memory runs on
        CPU machines. Any other device is refused, as where there are devices."""
        try:
            dtype = self._type()
        except RuntimeError as unavailable:
            return self._never_used_index(device, unavailable), None
        index = device_index(device, dtype)
        return index, dtype.registry.peek(index)

    def _never_used_index(self, device: DeviceLike, unavailable: RuntimeError) -> int:
        """:meth:`_peek`'s index where this device type has no device: 0 for
        the default device; ``InvalidDeviceError`` for another index,
        ``TypeError``/``ValueError`` for what names no device of this type."""
        try:
            return device_index(device, _DefaultDeviceOnly(self.type_name))
        except _core.InvalidDeviceError:
            raise _core.InvalidDeviceError(f"device {device!r} is out of range: {unavailable}") from None

    def _existing_if_available(self, device: DeviceLike) -> Optional[_core.CachingAllocator]:
        """:meth:`_existing`, or None where this device type has no device (see :meth:`_peek`)."""
        return self._peek(device)[1]

    def caching_allocator(self, device: DeviceLike = None) -> _core.CachingAllocator:
        """The caching allocator of ``device`` (created if needed)."""
        dtype = self._type()
        return dtype.allocator(device_index(device, dtype))

    def _initialized(self) -> List[_core.CachingAllocator]:
        """The allocators made so far (none when the device type has none)."""
        try:
            return list(self._type().registry.initialized().values())
        except RuntimeError:
            return []

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
        r"""Set the current device.

        This function is a no-op if this argument is negative.
        """
        dtype = self._type()
        if is_negative_index(device):
            return
        dtype.set_current_index(device_index(device, dtype, optional=False))
