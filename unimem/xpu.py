"""``unimem.xpu``: Intel XPU (SYCL) memory for dpctl and dpnp users.

The memory functions of ``torch.xpu.memory`` (``memory_stats``,
``memory_allocated``, ``empty_cache``, ...) and dpnp arrays whose memory comes
from the caching pool::

    x = unimem.xpu.empty((1024, 1024), dtype="f4")    # a dpnp.ndarray, memory from the pool
    y = unimem.xpu.zeros_like(x); z = x @ y            # ordinary dpnp work on it
    unimem.xpu.memory_stats(0)["active_bytes.all.current"]
    del x, y, z                                        # blocks go back to the pool, not to SYCL

A block returns to the pool when the last array (or view) using it is gone
and dpctl has let go of it (dpctl keeps arrays alive until the kernels using
them finish), never earlier. Device USM comes from the ``xpu`` device pools,
host USM from :mod:`unimem.host` (pinned memory), shared USM from per-device
shared pools.
"""
from __future__ import annotations

import collections
import contextlib
import math
import numbers
import operator
import sys
from typing import Any, Dict, Iterator, NoReturn, Optional, Sequence, Tuple, Union

import numpy

from . import host
from ._integrations import dpnp as _dpnp_allocator, usm_memory as _usm_memory
from ._runtime.devices import get_type
from ._memory_api import PUBLIC_CLASSES, PUBLIC_FUNCTIONS, DeviceLike, MemoryAPI, MemoryLike, record_stream_on_pools, numpy_dtype
from ._core import OutOfMemoryError
from ._memory.device_type import PoolsBeside, show_pools_beside, synchronize_device
from ._memory.mempool import generate_graph_pool_handle
from ._memory import telemetry as _telemetry
from ._observe.summary import has_held_memory, memory_summary_table
from . import _xpu_pools
# _pool_for and _keep_alive_guard: the dpnp allocator's routes (the SYCL interposer's too)
from ._xpu_pools import (_ctx, _device_to_index, _keep_alive_guard, _pool, _pool_for, _queue_and_index,
                         _runtime, _shared_pools_made, _stream_for, allocator_for, default_queue, stream_handle)

_api = MemoryAPI("xpu")
globals().update(_api.functions())

__all__ = list(PUBLIC_FUNCTIONS) + list(PUBLIC_CLASSES) + [
    "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
    "asarray", "default_queue", "stream_handle", "allocator_for", "synchronize",
    "set_allocator", "reset_allocator", "using_allocator", "allocator_installed", "allocator_counters",
    "OutOfMemoryError", "device_memory_used", "memory_usage", "graph_pool_handle",
]

ShapeLike = Union[int, Sequence[int]]

# What dpnp arrays can hold (no long double, no byte-swapped types).
DPNP_TYPES = frozenset(numpy.dtype(t) for t in (
    "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"))


# ---------------------------------------------------------------------------
# array arguments
# ---------------------------------------------------------------------------
def _refuse_dtype(dt: numpy.dtype, what: str, asked_for: bool = True) -> NoReturn:
    """The error dpnp gives for a data type it cannot hold: a ValueError for
    one of its types in the other byte order, and for a structured type
    asked for ("not understood"; the structured type of an array to copy,
    ``asked_for`` False, is a TypeError in dpnp.asarray); a TypeError
    (``what``) for the rest."""
    if dt.newbyteorder("=") in DPNP_TYPES:
        raise ValueError(f"Data type '{dt.str}' can only have native byteorder.")
    if dt.fields is not None and asked_for:
        raise ValueError(f"Data type '{dt}' is not understood.")
    raise TypeError(what)


def _normalize_shape(shape: ShapeLike) -> Tuple[int, ...]:
    if type(shape) is int:
        dims: Tuple[int, ...] = (shape,)
    else:
        try:
            dims = (operator.index(shape),)
        except TypeError:
            try:
                dims = tuple(operator.index(d) for d in shape)   # type: ignore[union-attr]
            except TypeError:
                raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def _normalize_dtype(dtype: Any, queue, index: int) -> numpy.dtype:
    ctx = _ctx()
    key = (dtype, index)
    try:
        return ctx.dtypes[key]
    except (KeyError, TypeError):      # TypeError: an unhashable dtype argument
        pass
    if dtype is None:
        dt = numpy.dtype(ctx.dpnp.default_float_type(sycl_queue=queue))
    else:
        try:
            dt = numpy_dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"data type {dtype!r} not understood") from exc
        if dt not in DPNP_TYPES:
            _refuse_dtype(dt, f"dpnp arrays cannot hold data type {dt} (booleans, integers, float16/32/64 "
                              f"and complex64/128)")
        dev = ctx.runtime.devices[index]
        if dt in (numpy.float64, numpy.complex128) and not dev.has_aspect_fp64:
            raise ValueError(f"device {dev.name} does not support double precision ({dt})")
        if dt == numpy.float16 and not dev.has_aspect_fp16:
            raise ValueError(f"device {dev.name} does not support half precision")
    try:
        ctx.dtypes[key] = dt
    except TypeError:
        pass
    return dt


# ---------------------------------------------------------------------------
# arrays from the pool
# ---------------------------------------------------------------------------
def empty(shape: ShapeLike, dtype: Any = None, *, order: Optional[str] = "C", device: Any = None,
          usm_type: Optional[str] = "device", sycl_queue: Any = None):
    """Return a new uninitialized ``dpnp.ndarray`` whose memory comes from the pool.

    Arguments as ``dpnp.empty``: ``dtype`` (default: the device's default
    floating type), ``order`` (``"C"`` or ``"F"``), ``device`` (an index,
    ``"xpu:N"``, a ``dpctl.SyclDevice`` or queue), ``usm_type``
    (``"device"``, ``"shared"`` or ``"host"``), ``sycl_queue``; None for
    ``order`` or ``usm_type`` is its default, as in dpnp.
    """
    ctx = _ctx()
    order = "C" if order is None else order
    usm_type = "device" if usm_type is None else usm_type
    if order not in ("C", "F", "c", "f"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    queue, index = _queue_and_index(device, sycl_queue)
    dims = _normalize_shape(shape)
    dt = _normalize_dtype(dtype, queue, index)
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes > sys.maxsize:     # as numpy and dpnp refuse it (it reached the pool as an OverflowError)
        raise ValueError(f"array is too big: {nbytes} bytes is more than the largest possible allocation")
    pool = _pool(usm_type, index, queue)
    if nbytes == 0:     # nothing to allocate
        return ctx.dpnp.empty(dims, dtype=dt, order=order, usm_type=usm_type, sycl_queue=queue)
    if ctx.yields_to_host_tasks[index]:     # see _keep_alive_guard
        _usm_memory.yield_gil()
    # dpctl's own memory object, holding the block with a smart pointer as
    # dpctl holds what it allocates: the same memory the dpnp allocator
    # (set_allocator) hands out, so dpnp's kernels keep it alive without
    # the GIL and it returns to the pool from whichever thread lets go last
    memory = _usm_memory.pooled_memory(
        ctx.usm_kinds[usm_type], pool, nbytes,
        0 if queue is ctx.default_queues[index] else _stream_for(usm_type, index, queue), queue)
    try:
        return ctx.wrap(ctx.usm_ndarray(dims, dtype=dt, buffer=memory, order=order.upper()))
    except BaseException:
        _usm_memory.release_now(memory)      # now, not when the traceback goes
        raise


def _filled(out: Any, fill: Any) -> Any:
    """``fill(out)``; if it fails, ``out``'s block goes back before the error
    propagates (the traceback would keep the array alive)."""
    try:
        fill(out)
    except BaseException:
        _release(out)
        raise
    return out


def _release(array: Any) -> None:
    """Give a pool array's block back now, or when the kernels using it are
    done (the array must not be used again)."""
    memory = array.get_array().usm_data
    if _usm_memory.holds_pool_block(memory):     # not so for an empty array
        _usm_memory.release_now(memory)


def full(shape: ShapeLike, fill_value: Any, dtype: Any = None, **kwargs: Any):
    """Return a new pool-backed ``dpnp.ndarray`` filled with ``fill_value`` (a scalar)."""
    if not isinstance(fill_value, (numbers.Number, numpy.generic)) or isinstance(fill_value, numpy.void):
        raise TypeError(f"fill_value must be a scalar, not {type(fill_value).__name__}")
    if dtype is None:
        dtype = _fill_dtype(fill_value, kwargs)
    _check_fill(fill_value, dtype)
    return _filled(empty(shape, dtype, **kwargs), lambda out: out.fill(fill_value))


def _check_fill(fill_value: Any, dtype: Any) -> None:
    """Raise, before a block is taken, what fill would raise after it for a
    value ``dtype`` cannot hold, so that a call that fails leaves the
    pool's counters as they were: an integer outside an integer type's
    range (OverflowError, NumPy's message: dpnp.full(3, 300, dtype="u1")),
    a float NaN (ValueError) or one that no integer of the type holds
    (OverflowError: infinity, 1e300), an int too large for a float
    (OverflowError). A data type dpnp cannot hold is left to empty's error;
    so is a value of another kind (complex, Fraction, Decimal)."""
    if isinstance(fill_value, (bool, numpy.bool_)) or dtype is None:
        return
    try:
        dt = numpy_dtype(dtype)
    except (TypeError, ValueError):
        return
    if dt not in DPNP_TYPES:
        return
    if dt.kind in "fc" and type(fill_value) is int:
        float(fill_value)                                   # OverflowError past a double
    if dt.kind not in "iu":
        return
    if isinstance(fill_value, (float, numpy.floating)):
        if math.isnan(fill_value):
            raise ValueError("cannot convert float NaN to integer")
        if math.isinf(fill_value):
            raise OverflowError("cannot convert float infinity to integer")
        value = int(fill_value)
        what = f"{fill_value!r}"
    elif isinstance(fill_value, numbers.Integral):      # int, its subclasses, NumPy integers
        value = operator.index(fill_value)
        what = f"Python integer {value}"
    else:
        return
    bounds = numpy.iinfo(dt)
    if not bounds.min <= value <= bounds.max:
        raise OverflowError(f"{what} out of bounds for {dt}")


def _fill_dtype(fill_value: Any, kwargs: Dict[str, Any]) -> Any:
    """dpnp.full's data type for ``fill_value`` when none is given: the
    device's default of the value's kind, whatever the width of a NumPy
    scalar (``dpnp.full(3, numpy.int8(1))`` is int64, ``numpy.complex64``
    complex128); a bool's is bool. Any other is passed on, for empty to refuse."""
    if type(fill_value) is int:    # of any size: dpnp.full(3, 2**63) is an OverflowError, not uint64
        return numpy.dtype(numpy.int64)
    dtype = numpy.asarray(fill_value).dtype
    if dtype.kind in "iu":
        return numpy.dtype(numpy.int64)
    if dtype.kind == "f":
        return None               # the device's default floating type
    if dtype.kind == "c":
        queue, _ = _queue_and_index(kwargs.get("device"), kwargs.get("sycl_queue"))
        return numpy.dtype(numpy.complex128 if queue.sycl_device.has_aspect_fp64 else numpy.complex64)
    return dtype


def zeros(shape: ShapeLike, dtype: Any = None, **kwargs: Any):
    """Return a new pool-backed ``dpnp.ndarray`` of zeros."""
    return _filled(empty(shape, dtype, **kwargs), lambda out: out.fill(0))


def ones(shape: ShapeLike, dtype: Any = None, **kwargs: Any):
    """Return a new pool-backed ``dpnp.ndarray`` of ones."""
    return _filled(empty(shape, dtype, **kwargs), lambda out: out.fill(1))


def _like(x: Any, dtype: Any, kwargs: Dict[str, Any]) -> Any:
    """A new uninitialized pool array shaped like ``x``, on its queue, of its
    USM kind and type unless given. ``order`` as ``dpnp.empty_like`` takes
    it: ``"K"`` (the default, or None) keeps the order of ``x``'s strides,
    ``"A"`` is ``"F"`` for a Fortran-contiguous ``x``, else ``"C"``."""
    if not hasattr(x, "sycl_queue"):
        raise TypeError(f"expected a dpnp.ndarray or usm_ndarray, got {type(x).__name__}")
    order = kwargs.pop("order", "K")
    order = "K" if order is None else order
    if order not in ("C", "F", "A", "K", "c", "f", "a", "k"):
        raise ValueError(f"order must be one of 'C', 'F', 'A' or 'K', got {order!r}")
    if kwargs.get("usm_type") is None:
        kwargs["usm_type"] = x.usm_type
    if "device" not in kwargs and "sycl_queue" not in kwargs:
        kwargs["sycl_queue"] = x.sycl_queue
    return _empty_laid_out_as(x, order.upper(), x.dtype if dtype is None else dtype, kwargs, False)


def _empty_laid_out_as(x: Any, order: str, dtype: Any, kwargs: Dict[str, Any], backwards: bool) -> Any:
    """A pool array shaped like ``x`` (a NumPy or dpnp array), laid out as
    dpnp lays out a copy or an ``empty_like`` for ``order`` ("C", "F", "A"
    or "K"): "A" is F for an ``x`` that is Fortran contiguous and not C
    contiguous, else C; "K" is that for a contiguous ``x``, else the axes by
    falling stride length (a length-1 axis last, as dpnp orders them), made
    C-contiguous in that order and viewed back in ``x``'s. ``backwards``:
    an axis that runs backwards in ``x`` runs backwards in the result too
    (dpnp.asarray's copy does that, dpnp.empty_like does not)."""
    flags = x.flags
    if order == "A" or (order == "K" and (flags.c_contiguous or flags.f_contiguous)):
        order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
    if order != "K":
        return empty(x.shape, dtype, order=order, **kwargs)
    shape, strides = x.shape, x.strides
    by_stride = sorted(range(len(shape)), key=lambda d: abs(strides[d]) if shape[d] > 1 else 0, reverse=True)
    made = empty(tuple(shape[d] for d in by_stride), dtype, order="C", **kwargs)
    view = made.transpose(sorted(range(len(shape)), key=by_stride.__getitem__))
    if backwards and any(stride < 0 for stride in strides):
        view = view[tuple(slice(None, None, -1) if stride < 0 else slice(None) for stride in strides)]
    return view


def empty_like(x: Any, dtype: Any = None, **kwargs: Any):
    """A new uninitialized pool-backed array with the shape, type, queue, USM kind and
    (``order="K"``, the default) memory layout of ``x``."""
    return _like(x, dtype, kwargs)


def zeros_like(x: Any, dtype: Any = None, **kwargs: Any):
    """A new pool-backed array of zeros shaped like ``x``."""
    return _filled(_like(x, dtype, kwargs), lambda out: out.fill(0))


def ones_like(x: Any, dtype: Any = None, **kwargs: Any):
    """A new pool-backed array of ones shaped like ``x``."""
    return _filled(_like(x, dtype, kwargs), lambda out: out.fill(1))


def full_like(x: Any, fill_value: Any, dtype: Any = None, **kwargs: Any):
    """A new pool-backed array shaped like ``x``, filled with ``fill_value``."""
    if not isinstance(fill_value, (numbers.Number, numpy.generic)) or isinstance(fill_value, numpy.void):
        raise TypeError(f"fill_value must be a scalar, not {type(fill_value).__name__}")
    if hasattr(x, "sycl_queue"):             # else _like refuses x
        _check_fill(fill_value, x.dtype if dtype is None else dtype)
    return _filled(_like(x, dtype, kwargs), lambda out: out.fill(fill_value))


def _empty_in_layout(order: Any, source: Any, dtype: Any, **kwargs: Any) -> Any:
    """``empty`` for asarray's copy of ``source``, laid out as dpnp.asarray
    lays it out (:func:`_empty_laid_out_as`, axes that run backwards kept)
    for ``order``: of a str only the first letter counts, as dpnp reads it;
    None (dpnp's default) is "K"."""
    if order is None:
        key = "K"
    elif not isinstance(order, str):
        raise TypeError(f"order must be a str or None, got {type(order).__name__}")
    else:
        key = order[:1].upper()
    if key not in ("C", "F", "A", "K"):
        raise ValueError(f"order must be 'K', 'A', 'F' or 'C', got {order!r}")
    return _empty_laid_out_as(source, key, dtype, kwargs, True)


def _holds_usm_array(obj: Any) -> bool:
    """Whether the list or tuple ``obj`` holds a USM array, at any depth."""
    return isinstance(obj, (list, tuple)) and any(
        hasattr(item, "__sycl_usm_array_interface__") or _holds_usm_array(item) for item in obj)


def asarray(obj: Any, dtype: Any = None, *, order: Optional[str] = None, device: Any = None,
            usm_type: Optional[str] = None, sycl_queue: Any = None):
    """Copy ``obj`` (a NumPy array, a sequence, a scalar or a dpnp array) into
    a new pool-backed ``dpnp.ndarray``. As ``dpnp.asarray``, a dpnp or USM
    array keeps its queue and USM type unless ``device``, ``sycl_queue`` or
    ``usm_type`` say otherwise; anything else goes to device USM. ``order``
    as dpnp's: "C", "F", "A" or "K"; None (the default) is "K", the
    source's layout."""
    dpnp = _ctx().dpnp
    usm_source = hasattr(obj, "__sycl_usm_array_interface__")
    if usm_source:
        obj = obj if isinstance(obj, dpnp.ndarray) else dpnp.asarray(obj)
        usm_type = obj.usm_type if usm_type is None else usm_type
        if device is None and sycl_queue is None:
            sycl_queue = obj.sycl_queue
    queue, _ = _queue_and_index(device, sycl_queue)
    if usm_source:
        source = obj
        if source.sycl_queue != queue:
            source = source.to_device(queue)
        out = _empty_in_layout(order, source, source.dtype if dtype is None else dtype,
                               usm_type=usm_type, sycl_queue=queue)

        def copy(out: Any) -> None:
            out[...] = source
        return _filled(out, copy)
    try:
        if dtype is not None and not isinstance(obj, numpy.ndarray):
            # Python values are converted with the dtype, as dpnp.asarray
            # converts them (NumPy's rules): 300 as uint8 is an OverflowError,
            # 1+2j as float32 a TypeError, 2**64 or None as float64 a value;
            # not a value wrapped or cut by a cast. An array is cast (below).
            host_data = numpy.asarray(obj, dtype=dtype)
        else:
            host_data = numpy.asarray(obj)
    except TypeError:
        if not _holds_usm_array(obj):
            raise
        # A sequence of dpnp (USM) arrays, which refuse to become NumPy
        # arrays: dpnp.asarray builds it on their device, and it is copied
        # into the pool as a dpnp array is (asked only after NumPy refused,
        # so that a long list of numbers is not walked in Python).
        built = dpnp.asarray(obj, dtype=dtype, device=device, usm_type=usm_type, sycl_queue=sycl_queue)
        return asarray(built, order=order)
    if dtype is None:
        dtype = host_data.dtype
        if dtype == numpy.float64 and not queue.sycl_device.has_aspect_fp64:
            dtype = numpy.float32
        elif dtype not in DPNP_TYPES:
            _refuse_dtype(dtype, f"dpnp arrays cannot hold data type {dtype}", asked_for=False)
    elif host_data.dtype.kind not in "biufc":
        raise TypeError(f"cannot copy data of type {host_data.dtype} into a dpnp array")
    out = _empty_in_layout(order, host_data, dtype, usm_type=usm_type, sycl_queue=queue)

    def copy(out: Any) -> None:
        if out.size:          # asarray, not ascontiguousarray: that makes 0-d data 1-d
            out.get_array()[...] = numpy.asarray(host_data, dtype=out.dtype, order="K")
    return _filled(out, copy)


def record_stream(memory: MemoryLike, stream: Any) -> None:
    r"""Mark the memory as used by the stream ``stream``.

    When the memory is deallocated, ensure the block is not reused for
    another allocation until all work queued on ``stream`` at the time of
    deallocation is complete (``torch.Tensor.record_stream``).

    Args:
        memory: an array whose memory comes from unimem's XPU pools (a dpnp
            ndarray or dpctl ``usm_ndarray``, of device, shared or host USM),
            a memory object (a dpctl ``MemoryUSM*``, an :class:`unimem.Allocation`)
            or the address of a block. An empty array (no memory) is left alone.
        stream: a ``dpctl.SyclQueue`` (a SYCL queue is PyTorch's XPU stream),
            a handle from :func:`stream_handle`, or ``None`` for the default queue.

    A host USM block is cached for every queue alike (the pinned host pool),
    so its use on any queue named here, the default queue included, is
    waited for before the block is handed out again.

    Raises ``TypeError`` for what is no memory or no queue and ``ValueError``
    for an address that is not a live block of unimem's XPU pools; nothing
    is recorded then.
    """
    pools = [get_type("xpu").registry.find_owner]
    shared = _xpu_pools.shared_registry()
    if shared is not None:
        pools.append(shared.find_owner)
    pinned = host.caching_allocator()
    pools.append(lambda address: pinned if pinned.owns(address) else None)

    def stream_of(owner: Any) -> int:
        if owner is pinned:         # its stream 0 is every queue's (host USM), not the default queue
            return _xpu_pools.host_block_use_stream(stream)
        return 0 if stream is None else stream_handle(stream)
    record_stream_on_pools(memory, stream, pools, stream_of, "unimem's XPU pools")


# ---------------------------------------------------------------------------
# the allocator of every dpnp array
# ---------------------------------------------------------------------------
def set_allocator() -> None:
    """Make unimem's pools the allocator of every dpnp array.

    From then on, every ``dpnp`` and ``dpnp.tensor`` array allocated through
    Python (the results of dpnp's operations included), on any queue of a
    device unimem serves, takes its memory from unimem's pools - device USM
    from the device pools, shared USM from the shared pools, host USM from
    the pinned host pool - and gives it back when its last view is gone and
    the kernels using it have finished. The dpnp counterpart of
    ``cupy.cuda.set_allocator(unimem.cuda.allocator)``.

    Requests on a queue of another SYCL context, with an alignment above 512
    bytes, or of zero bytes go to dpctl, counted in :func:`allocator_counters`.
    Thread-safe; installing twice is a no-op. Raises ``RuntimeError``,
    changing nothing, when the installed dpctl or dpnp does not allocate the
    way unimem relies on (:mod:`unimem._integrations.dpnp` says what that is)."""
    _set_up_pools()
    _dpnp_allocator.set_allocator(_pool_for, _keep_alive_guard)


def _set_up_pools() -> None:
    """Make every pool the dpnp allocator can route to (no memory yet), so
    that no allocation it serves has to make one. Making a pool reads the
    host's memory and waits for locks, letting the GIL go, and dpnp's
    extensions allocate from inside C++ static initializers that other
    threads wait for holding the GIL: a first allocation that lets the GIL
    go there can deadlock."""
    ctx = _ctx()
    for index, queue in enumerate(ctx.default_queues):
        for usm_type in _dpnp_allocator.USM_TYPES:
            _pool_for(usm_type, index, queue)


def reset_allocator() -> None:
    """Give dpnp back dpctl's own allocator. Arrays from the pools stay valid
    and give their memory back to the pools when they are gone."""
    _dpnp_allocator.reset_allocator()


@contextlib.contextmanager
def using_allocator() -> Iterator[None]:
    """A context manager in which unimem allocates every dpnp array (as
    ``cupy.cuda.using_allocator``); the allocator in effect before is back after it.

    Unlike CuPy's, dpnp's allocator is one for the whole process: inside the
    block every thread's dpnp arrays come from the pools, and with blocks in
    several threads the pools stay in effect until the last block ends."""
    _set_up_pools()
    with _dpnp_allocator.using_allocator(_pool_for, _keep_alive_guard):
        yield


allocator_installed = _dpnp_allocator.allocator_installed
allocator_counters = _dpnp_allocator.allocator_counters


def synchronize(device: Any = None) -> None:
    r"""Wait for all kernels in all queues on a XPU device to complete.

    Args:
        device (torch.device or int, optional): device for which to synchronize.
            It uses the current device, given by :func:`~unimem.xpu.current_device`,
            if :attr:`device` is ``None`` (default).

    Afterwards the memory of every array deleted before the call is back in
    the pools (dpnp keeps an array's memory until the kernels using it are done).
    """
    index = _ctx().registry.current_index() if device is None else _device_to_index(device)
    # dpctl's keep-alive host tasks let go of arrays on their own threads:
    # the frees that wait for other queues are done there (_free_deferred)
    synchronize_device(get_type("xpu"), index)


def device_memory_used(device: Any = None) -> int:
    r"""Return the current GPU used global (device) memory in bytes.

    Args:
        device (torch.device, str or int, optional): selected device. Uses the
            current device, given by :func:`~unimem.xpu.current_device`,
            if ``None`` (default).

    The device's global memory less the free memory its driver reports, every
    process included (``dpctl.utils.intel_device_info``: Level Zero devices,
    where ``ZES_ENABLE_SYSMAN=1`` may be needed); ``RuntimeError`` on a
    device that reports none (OpenCL devices, the SYCL CPU device).
    """
    return _telemetry.xpu_device_memory_used(_device_to_index(device))


def memory_usage(device: Any = None) -> float:
    r"""Return the GPU memory bandwidth usage as a percentage.

    Args:
        device (torch.device, str or int, optional): selected device. Uses the
            current device, given by :func:`~unimem.xpu.current_device`,
            if ``None`` (default).

    PyTorch samples Level Zero Sysman's bandwidth counters, which dpctl does
    not expose: this raises ``RuntimeError``, as PyTorch's where the
    counters cannot be read.
    """
    _device_to_index(device)     # a bad device argument is refused first, as PyTorch's
    raise RuntimeError(_telemetry.XPU_BANDWIDTH_UNAVAILABLE)


#: torch.xpu's name for it (its graph pools share the ids of MemPool objects).
graph_pool_handle = generate_graph_pool_handle


# ---------------------------------------------------------------------------
# statistics of the shared and host USM pools, beside the device's
# ---------------------------------------------------------------------------
#: The prefix of the shared USM pool's statistics in :func:`memory_stats`.
SHARED_STATS_PREFIX = "usm_shared."


# unimem.accelerator's functions on XPU show and manage them too.
show_pools_beside("xpu", PoolsBeside(SHARED_STATS_PREFIX, _shared_pools_made))


def memory_stats(device: DeviceLike = None) -> "collections.OrderedDict[str, Any]":
    return _api.memory_stats(device)


memory_stats.__doc__ = (_api.memory_stats.__doc__ or "") + """
    On an XPU device the statistics of the device's shared USM pool (arrays
    with ``usm_type="shared"``) follow, once it has been used, under the same
    keys prefixed with ``"usm_shared."``; host USM arrays come from the pinned
    host pool, whose statistics are :func:`unimem.host_memory_stats`.
    """


def memory_summary(device: DeviceLike = None, abbreviated: bool = False) -> str:
    index = _api._index(device)
    parts = [_api.memory_summary(index, abbreviated)]
    # The pools beside the device's: a table each once it has held memory
    # (a pool that was only set up prints none, not a table of zeros).
    beside: list[Tuple[Dict[str, Any], str, int]] = []
    beside += [(shared.memory_stats(), "XPU shared USM", index) for shared in _shared_pools_made(index)]
    pinned = host._existing()
    if host.backend_name() == "sycl" and pinned is not None:
        beside.append((pinned.memory_stats(), "XPU host USM", 0))
    parts += [memory_summary_table(stats, name, pool_index, abbreviated)
              for stats, name, pool_index in beside if has_held_memory(stats)]
    return "\n".join(parts)


memory_summary.__doc__ = (_api.memory_summary.__doc__ or "") + """
    On an XPU device the tables of the shared USM pool of the device and of
    the host USM (pinned) pool follow the device's, once they have held memory.
    """


# ---------------------------------------------------------------------------
# torch.xpu.memory's XPUPluggableAllocator; torch.cuda's host statistics
# (issue 28: names that need no change to the compiled core)
# ---------------------------------------------------------------------------
from .backends.shared_library import SharedLibraryAllocator  # noqa: E402
from .host import (host_memory_stats, host_memory_stats_as_nested_dict,  # noqa: E402,F401
                   reset_accumulated_host_memory_stats, reset_peak_host_memory_stats)

__all__ += ["XPUPluggableAllocator", "host_memory_stats", "host_memory_stats_as_nested_dict",
            "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats"]


def _queue_pointer(stream: int, device: int) -> int:
    """The ``sycl::queue*`` (dpctl's ``DPCTLSyclQueueRef``) of a pool's queue handle."""
    runtime = _runtime()
    queue = runtime.default_queues[device] if stream == 0 else runtime.queues[stream]
    return int(queue.addressof_ref())


class XPUPluggableAllocator(SharedLibraryAllocator):
    r"""
    XPU memory allocator loaded dynamically from a shared library.

    This lets users provide custom allocation and free functions implemented
    in a separate shared library. The allocator is registered and could become
    available for use via :func:`change_current_allocator`.

    Arguments:
        path_to_lib_file (str):
            Filesystem path to the shared library file containing the allocation
            and free functions.
        alloc_fn_name (str):
            Name of the allocation function exported from the shared library.
            The function must have the signature:

                ``void* alloc_fn(size_t size, int device, sycl::queue* queue);``

        free_fn_name (str):
            Name of the free function exported from the shared library.
            The function must have the signature:

                ``void free_fn(void* ptr, size_t size, int device, sycl::queue* queue);``

    Unlike PyTorch's, the functions are called on a cache miss only: unimem's
    caching allocator stays on top. ``queue`` is the ``dpctl.SyclQueue`` the
    request named (its ``addressof_ref()``), else the device's default queue.
    """

    def __init__(self, path_to_lib_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        # mem_get_info keeps asking the device (global memory; free where it reports it)
        device_backend = get_type("xpu").backend
        super().__init__(path_to_lib_file, alloc_fn_name, free_fn_name, stream_pointer=_queue_pointer,
                         memory_info_fn=device_backend.memory_info)


# PyTorch's XPUPluggableAllocator over unimem's pools (the other way round from XPUPluggableAllocator above)
from ._integrations.torch import namespace_pluggable_allocator  # noqa: E402
pluggable_allocator = namespace_pluggable_allocator("xpu")
__all__.append("pluggable_allocator")
