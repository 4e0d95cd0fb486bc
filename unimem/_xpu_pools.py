"""The pools of ``unimem.xpu``: the SYCL context every array call needs,
queues and device indexes, and which pool serves each USM type on a device
(the device's own, the shared USM pool beside it, the pinned host pool).

Below :mod:`unimem.xpu`, which makes arrays from these pools and installs
them as dpnp's allocator; nothing here imports it.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy

from . import _core, host
from ._integrations import dpnp as _dpnp_allocator, usm_memory as _usm_memory
from ._runtime.devices import device_index, get_type, new_allocator
from ._runtime.pools import Pool, PoolKind, register_named_pool
from ._runtime.registry import DeviceRegistry
from .backends import xpu as _backend

_shared_lock = threading.Lock()
_shared_registry: Optional[DeviceRegistry] = None


# ---------------------------------------------------------------------------
# queues, devices and pools
# ---------------------------------------------------------------------------
class _Context:
    """What every array call needs, looked up once (dpnp's modules, the SYCL
    runtime, the device registry, each device's data-type support)."""

    def __init__(self) -> None:
        import dpnp
        import dpnp.tensor as dpt
        self.dtype_xpu = get_type("xpu")     # raises, saying why, when there is no SYCL device
        self.registry = self.dtype_xpu.registry
        self.runtime = _backend._SyclRuntime.get()
        self.dpctl = self.runtime.dpctl
        self.dpnp = dpnp
        self.usm_ndarray = dpt.usm_ndarray
        self.wrap = dpnp.ndarray._create_from_usm_ndarray
        self.usm_kinds = _dpnp_allocator.usm_kinds()
        self.default_queues = self.runtime.default_queues
        self.dtypes: Dict[Tuple[Any, int], numpy.dtype] = {}
        from dpctl.utils import SequentialOrderManager
        self.order_managers = SequentialOrderManager
        # Whether an array handed out on device N first lets dpctl's
        # keep-alive host tasks take the GIL (see _keep_alive_guard: on CPU
        # devices, where oneMKL's work shares their threads).
        self.yields_to_host_tasks = [bool(d.has_aspect_cpu) for d in self.runtime.devices]


_context: Optional[_Context] = None


def _ctx() -> _Context:
    global _context
    if _context is None:
        _context = _Context()
    return _context


def _runtime():
    return _ctx().runtime


def default_queue(device: Any = None):
    """The default ``dpctl.SyclQueue`` of an XPU device (the one dpnp uses)."""
    return _ctx().default_queues[_device_to_index(device)]


def stream_handle(queue) -> int:
    """The integer handle unimem keys ``queue``'s device and shared USM pools
    by (0: a default queue; the pinned host pool caches host USM of every
    queue alike).
    It names the queue while someone holds the queue: once only unimem does,
    its cache goes back at another queue's first allocation and the handle
    may then name a new queue, so keep the queue while you use its handle."""
    return _runtime().stream_handle(queue)


def _queue_and_index(device: Any, sycl_queue: Any) -> Tuple[Any, int]:
    ctx = _ctx()
    if device is None and sycl_queue is None:
        index = ctx.registry.current_index()
        return ctx.default_queues[index], index
    if sycl_queue is None and isinstance(device, ctx.dpctl.SyclQueue):
        device, sycl_queue = None, device
    if sycl_queue is not None:
        if not isinstance(sycl_queue, ctx.dpctl.SyclQueue):
            raise TypeError(f"sycl_queue must be a dpctl.SyclQueue, not {type(sycl_queue).__name__}")
        index = ctx.runtime.device_index_of(sycl_queue)
        if device is not None and _device_to_index(device) != index:
            raise TypeError("sycl_queue and device keywords name different devices")
        return sycl_queue, index
    index = _device_to_index(device)
    return ctx.default_queues[index], index


def _device_to_index(device: Any) -> int:
    ctx = _ctx()
    if isinstance(device, ctx.dpctl.SyclDevice):
        for index, known in enumerate(ctx.runtime.devices):
            if known == device:
                return index
        raise ValueError(f"SYCL device {device.name!r} is not one of unimem's XPU devices")
    return device_index(device, ctx.dtype_xpu)


def _shared_pools() -> DeviceRegistry:
    global _shared_registry
    if _shared_registry is None:
        with _shared_lock:
            if _shared_registry is None:
                backend = _backend.XPUBackend("shared")
                _shared_registry = DeviceRegistry(
                    "xpu-shared", backend.device_count(),
                    lambda index: new_allocator(SHARED_POOL, backend, index),
                    stream_handle_fn=_backend._SyclRuntime.get().stream_handle)
    return _shared_registry


#: The shared USM pools, one per XPU device.
SHARED_POOL = register_named_pool(Pool(PoolKind.SHARED_USM, "xpu", "xpu-shared", "XPU",
                                       _shared_pools, lambda: _shared_registry))


def _check_usm_type(usm_type: Any) -> None:
    if usm_type not in ("device", "shared", "host"):
        raise ValueError(f"usm_type must be 'device', 'shared' or 'host', got {usm_type!r}")


def _pool(usm_type: str, index: int, queue: Any) -> _core.CachingAllocator:
    """The pool serving ``usm_type`` memory on device ``index`` for ``queue``
    (read for host USM only). ``ValueError`` for an unknown ``usm_type``, and
    for host USM when the pinned pool is not SYCL host USM of the queue's context."""
    _check_usm_type(usm_type)
    if usm_type == "device":
        return get_type("xpu").allocator(index)
    if usm_type == "shared":
        return _shared_pools().get(index)
    return _host_pool_for(queue)


def allocator_for(usm_type: str = "device", device: Any = None) -> _core.CachingAllocator:
    """The caching allocator serving ``usm_type`` memory on ``device``."""
    _check_usm_type(usm_type)
    return _pool(usm_type, _device_to_index(device), default_queue(device) if usm_type == "host" else None)


def _pool_for(usm_type: str, index: int, queue: Any) -> Optional[Tuple[_core.CachingAllocator, int]]:
    """The dpnp allocator's pool lookup: :func:`_pool` and :func:`_stream_for`,
    None where there is no pool (host USM when the pinned pool is not SYCL
    host USM of that context). What making a pool raises (a malformed
    UNIMEM_ALLOC_CONF) goes through."""
    if usm_type == "host":
        pool = host.caching_allocator()
        if _why_no_host_pool(pool, queue):
            return None
    else:
        pool = _pool(usm_type, index, queue)
    return pool, _stream_for(usm_type, index, queue)


def _stream_for(usm_type: str, index: int, queue: Any) -> int:
    """The stream a request for ``usm_type`` memory on ``queue`` (of device
    ``index``) is cached under in its pool.

    Device and shared USM: the queue's handle (0 for the device's default
    queue), as PyTorch's device pools cache by stream: a block freed on a
    queue is reused on that queue with no event. Host USM: 0, whatever the
    queue. Host memory belongs to the SYCL context, not to a queue, and the
    pinned pool is one for every queue and device, as PyTorch's
    CachingHostAllocator takes no stream: keyed by queue, each queue would
    pin segments of its own (2 MiB for a one-byte array on a new queue, dpnp's
    own short-lived queues included) that no other queue reuses. Reuse on
    another queue is safe: a block goes back only once the kernels using it,
    on any queue, are done (they hold copies of its smart pointer), and one
    that record_stream names waits for that queue's work first, the default
    queue's included (:func:`host_block_use_stream`)."""
    if usm_type == "host" or queue is _ctx().default_queues[index]:
        return 0
    return _runtime().stream_handle(queue)


def host_block_use_stream(stream: Any) -> int:
    """The stream ``record_stream`` names a host USM block's use on
    ``stream`` by, in the pinned pool: a handle of that queue that is never
    0 (a ``dpctl.SyclQueue`` or a :func:`stream_handle`; None or 0: the
    current device's default queue).

    The pool caches host USM of every queue under stream 0 (see
    :func:`_stream_for`), so there 0 is the block's own stream and names no
    queue: the core records no event for a use on a block's own stream, and
    a block used on the default queue would go to another queue while that
    work runs."""
    if stream is None or (type(stream) is int and stream == 0):
        stream = default_queue()
    return _runtime().own_handle(stream)


def _keep_alive_guard(index: int) -> Optional[Any]:
    """What runs before each array the pool hands out on device ``index``
    (unimem.xpu.empty and the dpnp allocator): on a CPU device,
    _usm_memory.yield_gil, which lets dpctl's keep-alive host tasks take the
    GIL without waiting for any of them; None elsewhere.

    dpctl keeps arrays alive until their kernels finish with host tasks that
    need the GIL to let go of them; they run in the SYCL runtime's small pool
    of host-task threads. On a CPU device oneMKL runs its own work as host
    tasks in that pool, and dpnp sometimes waits for it holding the GIL: if
    keep-alive tasks waiting for the GIL fill the pool first, nothing moves
    again. dpctl's own allocator lets the GIL go for a moment at every
    allocation (its malloc runs without it), which lets waiting tasks
    through; the pool's hit path never lets it go, so it does the same (a
    busy moment without the GIL: a sleep would give the CPU up to the
    device's kernels for a whole time slice). Nothing is waited for: tasks
    behind a kernel still running would make the allocation wait for the
    device (tens of milliseconds behind a matmul), and one blocked for good
    would block it for good.
    """
    return _usm_memory.yield_gil if _ctx().yields_to_host_tasks[index] else None


def _host_pool_for(queue) -> _core.CachingAllocator:
    pool = host.caching_allocator()
    reason = _why_no_host_pool(pool, queue)
    if reason:
        raise ValueError(reason)
    return pool


def _why_no_host_pool(pool: _core.CachingAllocator, queue: Any) -> Optional[str]:
    """Why the pinned host pool cannot serve host USM of ``queue``; None when it can."""
    if host.backend_name() != "sycl":
        return (f"host USM arrays come from the pinned host pool, which here is "
                f"{host.backend_name()!r} memory, not SYCL host USM")
    if queue.sycl_context != pool.backend.default_queue(0).sycl_context:
        return "host USM arrays from the pool must use the default SYCL context of the platform"
    return None


def _shared_pools_made(index: Optional[int]) -> List[_core.CachingAllocator]:
    """The shared USM pools made so far: device ``index``'s, or every device's for None."""
    made = _shared_registry.initialized() if _shared_registry is not None else {}
    return [pool for i, pool in made.items() if index is None or i == index]


def shared_registry() -> Optional[DeviceRegistry]:
    """The shared USM pools' registry, None until the first is made."""
    return _shared_registry
