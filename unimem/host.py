"""``unimem.host``: the pinned (page-locked) host memory pool.

The analogue of PyTorch's ``CachingHostAllocator``: host memory for staging
host<->device copies, cached and counted (``host_memory_stats``). The memory is
page-locked with ``cudaHostAlloc`` when CUDA is present, is SYCL host USM when
only a SYCL device is (or when the program uses SYCL and not CUDA), and plain
page-aligned memory otherwise; :func:`backend_name` says which.

Unlike PyTorch's and CuPy's pinned pools, which round every request up to a
power of two and never split (a 10 GiB request holds 16 GiB), this pool uses
the same best-fit, splitting policy as the device pools: a request is rounded
to 512 bytes and carved from a 2 MiB segment (20 MiB for requests over
1 MiB, the request rounded up to 2 MiB from 10 MiB), so several small pinned
buffers cost one call to the pinning runtime (pinning is slow, and
``cudaFreeHost`` synchronizes the device) and a request of 10 MiB or more
reserves at most 2 MiB more than it asked for.
:func:`host_memory_stats` therefore counts other figures than PyTorch for
the same requests, each what this pool reserved or handed out: after pinned
allocations of 40,960 and 81,920 bytes, PyTorch counts blocks of 65,536 and
131,072 bytes, two blocks and two ``cudaHostAlloc`` calls; unimem counts
40,960 + 81,920 bytes handed out, from one 2 MiB segment and one call.
"""
from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Dict, Mapping, Optional

from . import _core
from ._runtime.registry import DeviceRegistry
from ._runtime import devices as _devices
from ._runtime.devices import new_allocator
from ._runtime.pools import Pool, PoolKind, register_named_pool
from ._memory_api import nest_stats
from .backends.base import Backend

_lock = threading.Lock()
_backend: Optional[Backend] = None
_registry: Optional[DeviceRegistry] = None


#: The runtimes that pin host memory, in order of preference, each with the
#: Python module a program imports to use it.
_PINNING_RUNTIMES = (("cuda", "cupy"), ("xpu", "dpctl"))


def _choose_backend() -> Backend:
    """Pinned memory from the first runtime that offers it, runtimes the
    program already uses first.

    A runtime is in use when its device type is set up or its module is
    imported. Probing CUDA imports CuPy (and asks the driver for GPUs), which
    an XPU program should not pay for to get host USM, nor see in its
    ``sys.modules``; so CUDA is probed first only when the program uses it
    or uses neither runtime, as on a CUDA machine whose program has not
    allocated yet.
    """
    set_up = _devices.types_by_name()
    in_use = [name for name, module in _PINNING_RUNTIMES if name in set_up or module in sys.modules]
    for name in in_use + [name for name, _ in _PINNING_RUNTIMES if name not in in_use]:
        if _devices.is_available(name):
            pinned = getattr(_devices.get_type(name).backend, "pinned_host_backend", None)
            if pinned is not None:
                return pinned()
    from .backends._host import PageAlignedBackend
    return PageAlignedBackend("host")


def _host_registry() -> DeviceRegistry:
    global _backend, _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                backend = _backend = _choose_backend()
                _registry = DeviceRegistry(
                    "host", 1, lambda index: new_allocator(POOL, backend, index, device_options=False))
    return _registry


#: The pinned host pool: one allocator, device index 0 (counted as ``cpu:0``).
POOL = register_named_pool(Pool(PoolKind.PINNED_HOST, "cpu", "host", "host",
                                _host_registry, lambda: _registry))


def backend_name() -> str:
    """Where pinned memory comes from: ``"cuda"`` (cudaHostAlloc), ``"sycl"``
    (SYCL host USM) or ``"page-aligned"`` (plain, not page-locked)."""
    _host_registry()
    return getattr(_backend, "pinning", "page-aligned")


def caching_allocator() -> _core.CachingAllocator:
    """The host pool's caching allocator."""
    return _host_registry().get(0)


def _existing() -> Optional[_core.CachingAllocator]:
    return None if _registry is None else _registry.peek(0)


def is_initialized() -> bool:
    """Whether the pinned host pool has been created (by a first allocation)."""
    return _existing() is not None


class _PinnedBlock:
    """What ``cupy.cuda.PinnedMemoryPointer`` wraps: an address, a size, and
    (here) the pool block it keeps alive."""

    __slots__ = ("ptr", "size", "block")

    def __init__(self, block: _core.Allocation, size: int) -> None:
        self.block = block
        self.ptr = block.ptr
        self.size = size


def pinned_allocator(size: int) -> Any:
    """Pinned host memory for CuPy: ``cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)``.

    Returns a ``cupy.cuda.PinnedMemoryPointer``; the block goes back to the
    pool when CuPy lets go of it (after its asynchronous copies, which CuPy
    tracks itself)."""
    from cupy.cuda.pinned_memory import PinnedMemoryPointer
    block = caching_allocator().allocate(size, 0, "cupy")
    return PinnedMemoryPointer(_PinnedBlock(block, size), 0)


def caching_host_alloc(size: int) -> int:
    """Allocate ``size`` bytes of pinned host memory; returns the address."""
    return _host_registry().alloc(size, 0, 0)


def caching_host_delete(ptr: int) -> None:
    """Free memory from :func:`caching_host_alloc`."""
    _host_registry().delete(ptr)


def host_memory_stats() -> "collections.OrderedDict[str, Any]":
    r"""Return a dictionary of pinned (host) allocator statistics.

    Core statistics, each ``.{current,peak,allocated,freed}``:

    - ``"allocated"``: number of allocation requests received by the host allocator.
    - ``"allocated_bytes"``: amount of allocated (handed out) host memory.
    - ``"segment"``: number of reserved segments from the pinning runtime.
    - ``"reserved_bytes"``: amount of reserved host memory.

    PyTorch 2.9 and later also name ``"active_requests"`` (blocks checked out:
    counted when handed out, uncounted when reusable again, after the stream
    work recorded on them), ``"active_bytes"`` (their bytes) and
    ``"allocations"`` (blocks created from the runtime, i.e. segments); those
    keys are served too. (In
    those versions ``"allocated_bytes"`` means reserved bytes; here it keeps
    the earlier meaning, allocated bytes, consistently with the device stats.)

    Event statistics:

    - ``"num_host_alloc"``: number of pinning allocation calls (``cudaHostAlloc``,
      SYCL ``malloc_host``, ...).
    - ``"num_host_free"``: number of calls freeing pinned memory.

    Timing, in microseconds, of those calls:

    - ``"host_alloc_time.{total,max,min,count,avg}"``
    - ``"host_free_time.{total,max,min,count,avg}"``

    Before the first pinned allocation every key is there, zero, as in
    PyTorch once CUDA is initialized.

    The figures are what this pool reserved and handed out after its own
    rounding (512 bytes, best fit, split from 2 MiB segments), not PyTorch's
    (each request rounded up to a power of two, one block each): see
    :mod:`unimem.host`.
    """
    pool = _existing()
    if pool is None:        # not created yet: nothing counted (and no runtime probed to create it)
        return _host_stats_from(collections.defaultdict(int), _ZERO_TIMING)
    return _host_stats_from(pool.memory_stats(), pool.backend_timing())


_METRICS = ("current", "peak", "allocated", "freed")
_TIMING_FIELDS = ("total", "max", "min", "count", "avg")
_ZERO_TIMING: Dict[str, Dict[str, int]] = {which: dict.fromkeys(_TIMING_FIELDS, 0) for which in ("alloc", "free")}


def _host_stats_from(stats: Mapping[str, int],
                     timing: Mapping[str, Mapping[str, int]]) -> "collections.OrderedDict[str, Any]":
    """The host statistics, named as PyTorch names them, from the host pool's
    core statistics and backend timing."""
    out: Dict[str, int] = {}
    for metric in _METRICS:
        out[f"allocated.{metric}"] = stats[f"allocation.all.{metric}"]
        out[f"allocated_bytes.{metric}"] = stats[f"allocated_bytes.all.{metric}"]
        out[f"segment.{metric}"] = stats[f"segment.all.{metric}"]
        out[f"reserved_bytes.{metric}"] = stats[f"reserved_bytes.all.{metric}"]
        # Active until reusable: a freed block whose recorded stream work
        # still runs stays active (the core's active statistics, as PyTorch's).
        out[f"active_requests.{metric}"] = stats[f"active.all.{metric}"]
        out[f"active_bytes.{metric}"] = stats[f"active_bytes.all.{metric}"]
        out[f"allocations.{metric}"] = stats[f"segment.all.{metric}"]
    out["num_host_alloc"] = stats["num_device_alloc"]
    out["num_host_free"] = stats["num_device_free"]
    for key, which in (("host_alloc_time", "alloc"), ("host_free_time", "free")):
        for field in _TIMING_FIELDS:
            out[f"{key}.{field}"] = timing[which][field]
    return collections.OrderedDict(sorted(out.items()))


def host_memory_stats_as_nested_dict() -> Dict[str, Any]:
    r"""Return the result of :func:`host_memory_stats` as a nested dictionary."""
    return nest_stats(host_memory_stats())


def reset_peak_host_memory_stats() -> None:
    r"""Reset the "peak" stats tracked by the host memory allocator."""
    pool = _existing()
    if pool is not None:
        pool.reset_peak_stats()


def reset_accumulated_host_memory_stats() -> None:
    r"""Reset the "accumulated" (historical) stats tracked by the host memory allocator.

    Accumulated stats correspond to the `"allocated"` and `"freed"` keys in each
    individual stat dict, and the call counts and times.
    """
    pool = _existing()
    if pool is not None:
        pool.reset_accumulated_stats()


def empty_host_cache() -> None:
    r"""Release all unoccupied cached host (pinned) memory currently held by the host caching
    allocator so that it can be used by other applications.

    As PyTorch's, it does not wait for stream events: a freed block whose
    recorded stream work (``record_stream``) is still running stays cached.
    Giving a wholly free segment back does wait for the work queued where
    it was used, as PyTorch's ``cudaFreeHost`` synchronizes the device: the
    SYCL pool frees it after a wait on its queue (``sycl::free`` must not
    free memory a kernel may still read)."""
    pool = _existing()
    if pool is not None:
        pool.empty_cache(wait=False)


empty_cache = empty_host_cache
