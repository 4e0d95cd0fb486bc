"""``unimem.accelerator``: the current accelerator's devices and memory,
shaped like ``torch.accelerator``; the memory functions live in
:mod:`unimem.accelerator.memory` (as ``torch.accelerator.memory``) and are
re-exported here.

The current accelerator is CUDA when CuPy sees a GPU, else XPU when dpctl sees
a SYCL device, else ``cpu`` (host memory); ``UNIMEM_DEVICE`` overrides the
choice. Every function dispatches by device index to that device type's
caching allocator. As in PyTorch, ``device_index`` is positional-only and may
be ``None`` (the current device), an ``int``, a string such as ``"xpu:0"`` or
a :class:`unimem.device`; a string or device of another type than the current
accelerator is a ``ValueError``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from .._runtime.devices import DeviceLike, current_type, device, device_index as _device_index
from . import memory
# torch.accelerator re-exports its memory functions too; a star import, so
# that type checkers see the re-export of every name in memory.__all__.
from .memory import *  # noqa: F401,F403

__all__ = [
    "current_accelerator", "device_count", "is_available", "current_device_index",
    "set_device_index", "device_index", "synchronize", "memory",
] + memory.__all__


# ---------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------
def current_accelerator(check_available: bool = False) -> Optional[device]:
    r"""Return the device of the current accelerator (``cuda``, ``xpu`` or ``cpu``).

    Args:
        check_available (bool, optional): if True, also check that at least one
            device of that type is usable; return ``None`` if not.

    .. note:: The index of the returned :class:`device` is ``None``; use
        :func:`current_device_index` to know the current index being used.
    """
    dtype = current_type()
    if check_available and dtype.device_count == 0:
        return None
    return device(dtype.name)


def device_count() -> int:
    r"""Return the number of devices of the current accelerator (0 if none)."""
    return current_type().device_count


def is_available() -> bool:
    r"""Check if the current accelerator has at least one device."""
    return device_count() > 0


def current_device_index() -> int:
    r"""Return the index of a currently selected device for the current accelerator."""
    return current_type().current_index()


def set_device_index(device: DeviceLike, /) -> None:
    r"""Set the current device index to a given device.

    Args:
        device (:class:`unimem.device`, str, int): a given device that must match the current
            accelerator device type.
    """
    dtype = current_type()
    dtype.set_current_index(_device_index(device, dtype, optional=False))


@contextlib.contextmanager
def device_index(device: Optional[int], /) -> Iterator[None]:
    r"""Context manager to set the current device index for the current accelerator.

    Temporarily changes the current device index to the specified value for the duration
    of the context, and automatically restores the previous device index when exiting
    the context. ``None`` does nothing.
    """
    if device is None:
        yield
        return
    dtype = current_type()
    previous = dtype.current_index()
    dtype.set_current_index(_device_index(device, dtype, optional=False))
    try:
        yield
    finally:
        dtype.set_current_index(previous)


def synchronize(device: DeviceLike = None, /) -> None:
    r"""Wait for all kernels in all streams on the given device to complete.

    Args:
        device (:class:`unimem.device`, str, int, optional): device for which to synchronize.
            It must match the current accelerator device type. If not given,
            use :func:`current_device_index` by default.

    Devices without asynchronous work (``cpu``) have nothing to wait for. An
    XPU device waits on every SYCL queue unimem knows on it (its default
    queue and those given as streams); a CUDA device on all of its streams.
    """
    dtype = current_type()
    index = _device_index(device, dtype)
    # Optional for user backends: one without it has no asynchronous work.
    device_synchronize = getattr(dtype.backend, "synchronize", None)
    if device_synchronize is not None:
        device_synchronize(index)
