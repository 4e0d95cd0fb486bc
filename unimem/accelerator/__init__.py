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
from typing import Any, Dict, Iterator, Optional

import numpy

from .._runtime.devices import DeviceLike, current_type, device, device_index as _device_index, is_negative_index
from .._memory.device_type import synchronize_device
from .._memory.mempool import generate_graph_pool_handle
from . import memory
# torch.accelerator re-exports its memory functions too; a star import, so
# that type checkers see the re-export of every name in memory.__all__.
from .memory import *  # noqa: F401,F403

__all__ = [
    "current_accelerator", "device_count", "is_available", "current_device_index",
    "set_device_index", "device_index", "synchronize", "memory",
    "current_device_idx", "set_device_idx", "current_stream", "set_stream", "get_device_capability",
    "generate_graph_pool_handle",
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

    .. note:: This function is a no-op if this device index is negative.
    """
    dtype = current_type()
    if is_negative_index(device):
        return
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
    synchronize_device(dtype, _device_index(device, dtype))


# torch.accelerator's older names, the same functions
current_device_idx = current_device_index
set_device_idx = set_device_index


# ---------------------------------------------------------------------------
# streams: the backend's own (a CuPy stream, a dpctl.SyclQueue)
# ---------------------------------------------------------------------------
def current_stream(device: DeviceLike = None, /) -> Any:
    r"""Return the currently selected stream for a given device.

    Args:
        device (:class:`unimem.device`, str, int, optional): a given device that must match the current
            accelerator device type. If not given,
            use :func:`current_device_index` by default.

    Returns:
        the currently selected stream for a given device, the backend's own:
        on CUDA, CuPy's current stream (``cupy.cuda.get_current_stream``,
        which unimem.cuda's pools key blocks by); on XPU, the device's
        default ``dpctl.SyclQueue`` (the queue dpnp and ``unimem.xpu`` use
        when a call names none); on ``cpu``, ``None`` (no streams: host
        memory is used in program order).
    """
    dtype = current_type()
    index = _device_index(device, dtype)
    if dtype.name == "cuda":
        import cupy
        return cupy.cuda.get_current_stream(index)
    if dtype.name == "xpu":
        from .. import xpu
        return xpu.default_queue(index)
    return None


def set_stream(stream: Any) -> None:
    r"""Set the current stream to a given stream.

    Args:
        stream: a given stream that must match the current accelerator device
            type: a CuPy stream on CUDA (``stream.use()``, so that CuPy and
            unimem.cuda allocate on it).

    .. note:: This function will set the current device index to the device index of the given stream.

    On XPU and ``cpu`` it raises ``NotImplementedError``: ``unimem.xpu`` has no
    current queue to change (a call names its ``dpctl.SyclQueue``, else the
    device's default queue is used), and the host has no streams.
    """
    dtype = current_type()
    if dtype.name != "cuda":
        raise NotImplementedError(
            f"set_stream: the {dtype.name} accelerator has no current stream to set"
            + (" (name the dpctl.SyclQueue in each call: sycl_queue=..., record_stream(..., queue); "
               "the default is current_stream())" if dtype.name == "xpu" else " (the host has no streams)"))
    stream_device = getattr(stream, "device_id", None)
    if not callable(getattr(stream, "use", None)) or not isinstance(stream_device, int):
        raise TypeError(f"expected a CuPy stream (cupy.cuda.Stream or ExternalStream), got {type(stream).__name__}")
    dtype.set_current_index(_device_index(stream_device, dtype, optional=False))
    stream.use()


# ---------------------------------------------------------------------------
# device capability
# ---------------------------------------------------------------------------
# The dtypes every backend's arrays hold (CuPy, dpnp, NumPy); half and double
# precision depend on the device on XPU (SYCL's fp16 and fp64 aspects).
_COMMON_DTYPES = ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f4", "c8")
_HALF_DTYPES = ("f2",)
_DOUBLE_DTYPES = ("f8", "c16")


def get_device_capability(device: DeviceLike = None, /) -> Dict[str, Any]:
    r"""Return the capability of the currently selected device.

    Args:
        device (:class:`unimem.device`, str, int, optional): The device to query capabilities for
            accelerator device type. If not given,
            use :func:`current_device_index` by default.

    Returns:
        dict[str, Any]: A dictionary containing device capability information. The dictionary includes:
            - ``supported_dtypes`` (set(numpy.dtype)): Set of data types for which
              arrays can be allocated on the accelerator (NumPy dtypes, as
              CuPy, dpnp and :mod:`unimem.cpu` take them). On XPU, ``float16``
              and ``float64``/``complex128`` only where the device has SYCL's
              ``fp16`` and ``fp64`` aspects.
    """
    dtype = current_type()
    index = _device_index(device, dtype)
    names = _COMMON_DTYPES
    if dtype.name == "xpu":
        from .. import xpu
        sycl_device = xpu.default_queue(index).sycl_device
        names += (_HALF_DTYPES if sycl_device.has_aspect_fp16 else ()) + \
            (_DOUBLE_DTYPES if sycl_device.has_aspect_fp64 else ())
    else:
        names += _HALF_DTYPES + _DOUBLE_DTYPES
    return {"supported_dtypes": {numpy.dtype(name) for name in names}}
