"""``unimem.cpu``: a device-style caching pool on plain host memory.

The accelerator of last resort (no GPU, no SYCL device), with the full device
statistics: the same functions as ``unimem.xpu`` and ``unimem.cuda``, and
NumPy arrays whose memory comes from the pool (:func:`empty`, :func:`zeros`).
Not to be confused with :mod:`unimem.host`, the pinned staging pool.
"""
from __future__ import annotations

import ctypes
import operator
from typing import Any, Literal, Sequence, Tuple, Union

import numpy
from numpy.typing import DTypeLike, NDArray

from ._core import OutOfMemoryError
from ._memory_api import PUBLIC_CLASSES, PUBLIC_FUNCTIONS, MemoryAPI, numpy_dtype
from ._runtime.devices import DeviceLike

_api = MemoryAPI("cpu")
globals().update(_api.functions())

__all__ = list(PUBLIC_FUNCTIONS) + list(PUBLIC_CLASSES) + ["empty", "zeros", "OutOfMemoryError"]


class _PoolBuffer:
    """Exposes a pool block to NumPy as bytes; NumPy keeps it (and so the
    block) alive for as long as any array or view uses the memory. The array
    itself is made over those bytes by ``numpy.ndarray``: an interface's
    ``typestr``/``descr`` do not carry every dtype (a subarray dtype, an
    aligned structure's padding)."""

    __slots__ = ("block", "__array_interface__")

    def __init__(self, block: Any, nbytes: int) -> None:
        self.block = block
        self.__array_interface__ = {"data": (block.ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


def empty(shape: Union[int, Sequence[int]], dtype: DTypeLike = float, order: Literal["C", "F"] = "C",
          device: DeviceLike = None) -> NDArray[Any]:
    """Return a new uninitialized NumPy array whose memory comes from the cpu pool."""
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    try:
        dims = (operator.index(shape),)
    except TypeError:
        dims = tuple(operator.index(d) for d in shape)     # type: ignore[union-attr]
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {dims}")
    dt = numpy_dtype(dtype)
    if dt.hasobject:
        raise TypeError("arrays of Python objects cannot live in the pool")
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes == 0:
        return numpy.empty(dims, dt, order=order)
    block = _api.caching_allocator(device).allocate(nbytes)
    return numpy.ndarray(dims, dt, buffer=numpy.asarray(_PoolBuffer(block, nbytes)), order=order)


def zeros(shape: Union[int, Sequence[int]], dtype: DTypeLike = float, order: Literal["C", "F"] = "C",
          device: DeviceLike = None) -> NDArray[Any]:
    """Return a new NumPy array of zeros whose memory comes from the cpu pool."""
    out = empty(shape, dtype, order, device)
    # All bytes zero, as numpy.zeros gives for every dtype (out.fill(0) refuses
    # some, datetime64 without a unit, and the array would then be lost).
    ctypes.memset(out.ctypes.data, 0, out.nbytes)
    return out
