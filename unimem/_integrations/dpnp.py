"""unimem as the allocator of every dpnp array: ``unimem.xpu.set_allocator()``.

What it relies on in dpnp and dpctl, all checked by :func:`set_allocator`
before anything is replaced (a failed check raises ``RuntimeError`` saying
which, and changes nothing):

* dpnp (0.20 and later: ``dpnp.tensor``) allocates an array's memory by
  calling ``dpctl.memory.MemoryUSMDevice`` / ``MemoryUSMShared`` /
  ``MemoryUSMHost`` with the byte count and ``queue=``, looked up on the
  Python module ``dpctl.memory`` at each call. Checked by allocating a
  one-byte dpnp array after installing and seeing it come from the pool.
* dpctl (0.21 and later) lays out its memory objects as its public header
  ``dpctl/memory/_memory.h`` says, holding the memory with a
  ``std::shared_ptr<void>``. Checked against objects dpctl makes itself
  (:func:`unimem._integrations.usm_memory.check_layout`).
* ``dpnp.memory`` subclasses dpctl's classes when it is imported: it is
  imported before the names are replaced, so that its classes stay dpctl's.

The stand-ins replacing the three names are subclasses of dpctl's classes
whose metaclass makes ``isinstance(m, dpctl.memory.MemoryUSMDevice)`` true for
every device memory object, pooled or not, and whose call serves integer
requests on queues unimem serves from the pools (:mod:`unimem._integrations.usm_memory`).
Requests on a queue of another SYCL context, with an alignment above 512
bytes, of zero bytes, or with other arguments go to dpctl, and are counted.
"""
from __future__ import annotations

import contextlib
import copyreg
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from . import usm_memory as _usm_memory
from .._core import CachingAllocator, OutOfMemoryError
from .._runtime.devices import get_type
from ..backends import xpu as _xpu_backend

#: ``pool_for(usm_type, device_index, queue)``: the pool serving that memory
#: and the stream its requests on that queue are cached under, or None when
#: no pool serves it (``unimem.xpu`` provides it).
PoolFor = Callable[[str, int, Any], Optional[Tuple[CachingAllocator, int]]]
#: ``guard_for(device_index)``: what to run before each allocation on the
#: device, or None (``unimem.xpu`` provides it: see its _keep_alive_guard).
GuardFor = Callable[[int], Optional[Callable[[Any], None]]]

#: The oldest versions whose allocation path and memory layout the hook relies on.
MINIMUM_VERSIONS = {"dpctl": (0, 21), "dpnp": (0, 20)}
USM_TYPES = ("device", "shared", "host")
CLASS_OF_USM_TYPE = {"device": "MemoryUSMDevice", "shared": "MemoryUSMShared", "host": "MemoryUSMHost"}

_lock = threading.RLock()
_kinds: Dict[str, _usm_memory.UsmKind] = {}            # dpctl's classes, checked once
_allocators: Dict[str, _usm_memory.UsmAllocator] = {}   # made once, kept for their counters
_originals: Dict[str, type] = {}                         # the names we replaced, while installed
_probed = False                                          # True once dpnp's allocation path was checked


class _StandInType(type):
    """The metaclass of the stand-ins: ``isinstance`` and ``issubclass``
    against a stand-in answer for dpctl's class, and calling it allocates.

    A class a user derives from a stand-in while the allocator is installed
    gets this metaclass too; it is an ordinary subclass of dpctl's class
    (its instances are its own, made by dpctl), so only the stand-ins
    themselves, which hold ``__dpctl_class__`` in their own namespace, answer
    for dpctl's class."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if "__dpctl_class__" in cls.__dict__:
            return isinstance(instance, cls.__dpctl_class__)
        return type.__instancecheck__(cls, instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        if "__dpctl_class__" in cls.__dict__:
            return issubclass(subclass, cls.__dpctl_class__)
        return type.__subclasscheck__(cls, subclass)

    __call__ = _usm_memory.call_stand_in


def _dpctl_memory_class(name: str) -> type:
    """``dpctl.memory.<name>`` as it is where a pickle is loaded: the
    stand-in while the allocator is installed there, else dpctl's own."""
    import dpctl.memory
    return getattr(dpctl.memory, name)


def _reduce_stand_in(cls: _StandInType) -> Union[str, Tuple[Any, ...]]:
    """Pickle a stand-in by its public name: it bears dpctl's module and
    qualified name, where pickle would find dpctl's class, not it, and
    refuse. A class derived from one pickles as any class."""
    if "__dpctl_class__" in cls.__dict__:
        return _dpctl_memory_class, (cls.__name__,)
    return cls.__qualname__


copyreg.pickle(_StandInType, _reduce_stand_in)


def _version(text: str) -> Tuple[int, ...]:
    parts: List[int] = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _check_versions(dpctl: Any, dpnp: Any) -> None:
    for module in (dpctl, dpnp):
        name = module.__name__
        found = _version(getattr(module, "__version__", "0"))
        if found < MINIMUM_VERSIONS[name]:
            wanted = ".".join(map(str, MINIMUM_VERSIONS[name]))
            raise RuntimeError(f"unimem's dpnp allocator needs {name} {wanted} or later, "
                               f"found {getattr(module, '__version__', 'an unknown version')}")


class _Routes:
    """Where each queue's requests go: ``(allocator, stream, queue, cacheable)``
    or the index of a bypass reason."""

    def __init__(self, dpctl: Any, pool_for: PoolFor, guard_for: GuardFor) -> None:
        from dpctl._sycl_queue_manager import get_device_cached_queue
        self.dpctl = dpctl
        self.runtime = _xpu_backend._SyclRuntime.get()
        self.pool = pool_for
        self.guard = guard_for
        self.dpctl_default_queue = lambda: get_device_cached_queue(dpctl.SyclDevice())

    def __call__(self, usm_type: str, queue: Any) -> Union[int, Tuple[CachingAllocator, int, Any, bool, Any]]:
        reasons = _usm_memory.BYPASS_REASONS
        if queue is None:           # what dpctl would use
            queue = self.dpctl_default_queue()
        if not isinstance(queue, self.dpctl.SyclQueue):
            return reasons.index("other_arguments")
        try:
            index = self.runtime.device_index_of(queue)
        except ValueError:
            return reasons.index("no_pool")
        default = self.runtime.default_queues[index]
        is_default = queue is default or queue == default
        if not is_default and queue.sycl_context != default.sycl_context:
            return reasons.index("foreign_context")
        found = self.pool(usm_type, index, queue)
        if found is None:
            return reasons.index("no_pool")
        pool, stream = found
        _usm_memory.pin_allocator(pool)
        return (pool, stream, queue, is_default, self.guard(index))


class USMOutOfMemoryError(OutOfMemoryError):
    """Out of memory in a pool serving dpnp: both :class:`unimem.OutOfMemoryError`
    and dpctl's ``USMAllocationError``, so code written for either catches it."""


def _out_of_memory_error(dpctl_memory: Any) -> type:
    return type("USMOutOfMemoryError", (USMOutOfMemoryError, dpctl_memory.USMAllocationError),
                {"__module__": __name__, "__doc__": USMOutOfMemoryError.__doc__})


def _make_allocators(dpctl: Any, dpctl_memory: Any, pool_for: PoolFor,
                     guard_for: GuardFor) -> Dict[str, _usm_memory.UsmAllocator]:
    """Check dpctl's memory classes against objects it makes itself, and make
    one allocator per USM kind."""
    routes = _Routes(dpctl, pool_for, guard_for)
    error = _out_of_memory_error(dpctl_memory)
    made = {}
    for usm_type, kind in usm_kinds().items():
        def route(queue: Any, usm_type: str = usm_type) -> Any:
            return routes(usm_type, queue)
        made[usm_type] = _usm_memory.UsmAllocator(kind, route, error)
    return made


def usm_kinds() -> Dict[str, _usm_memory.UsmKind]:
    """dpctl's three memory classes by USM type, each checked once against
    an object dpctl made itself (:func:`unimem._integrations.usm_memory.check_layout`):
    what pool blocks are wrapped as, by this hook and by ``unimem.xpu.empty``.
    Raises ``RuntimeError`` when dpctl or dpnp is too old or dpctl's layout
    is not the one unimem writes."""
    with _lock:
        if not _kinds:
            import dpctl
            import dpctl.memory._memory as dpctl_classes   # dpctl's own, whoever replaced the public names
            import dpnp
            _check_versions(dpctl, dpnp)
            queue = _xpu_backend._SyclRuntime.get().default_queues[0]
            kinds = {}
            for usm_type in USM_TYPES:
                cls = getattr(dpctl_classes, CLASS_OF_USM_TYPE[usm_type])
                probe = cls(1, queue=queue)           # one byte of dpctl's own, to compare layouts with
                _usm_memory.check_layout(probe, dpctl_classes._Memory)
                kinds[usm_type] = _usm_memory.UsmKind(cls, usm_type, probe)
                del probe
            _kinds.update(kinds)
        return dict(_kinds)


def _stand_in(cls: type, allocator: _usm_memory.UsmAllocator) -> type:
    return _StandInType(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        "__dpctl_class__": cls, "__unimem_allocator__": allocator})


class _SpyType(_StandInType):
    """A stand-in that only counts its calls and lets dpctl allocate."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == cls.prober:     # other threads may allocate meanwhile
            cls.calls += 1
        return cls.__dpctl_class__(*args, **kwargs)


def _probe_dpnp(dpnp: Any, dpctl_memory: Any, queue: Any) -> None:
    """Check that dpnp allocates an array's memory through
    ``dpctl.memory.MemoryUSMDevice``, with a stand-in that lets dpctl allocate
    (so no pool's statistics see the probe)."""
    cls = dpctl_memory.MemoryUSMDevice
    spy = _SpyType(cls.__name__, (cls,), {"__dpctl_class__": cls, "calls": 0, "prober": threading.get_ident()})
    dpctl_memory.MemoryUSMDevice = spy
    try:
        dpnp.empty(1, dtype="u1", sycl_queue=queue)
    finally:
        dpctl_memory.MemoryUSMDevice = cls
    if spy.calls != 1:
        raise RuntimeError(f"dpnp {dpnp.__version__} does not allocate its arrays through "
                           f"dpctl.memory.MemoryUSMDevice: unimem cannot serve them")


def set_allocator(pool_for: PoolFor, guard_for: GuardFor) -> None:
    """Make the pools ``pool_for`` names the allocator of every dpnp array
    (``unimem.xpu.set_allocator``: unimem's XPU pools), running
    ``guard_for(device)``'s guard before each allocation on a device.

    From then on, every ``dpnp`` and ``dpnp.tensor`` array allocated through
    Python, on any queue of a device unimem serves, takes its memory from
    unimem's pools (device USM from the device pools, shared USM from the
    shared pools, host USM from the pinned host pool) and gives it back when
    its last view is gone and dpnp's kernels using it have finished. As
    ``cupy.cuda.set_allocator(unimem.cuda.allocator)`` does for CuPy.

    Installing twice is a no-op. Raises ``RuntimeError``, changing nothing,
    when dpctl or dpnp is not a version whose allocation path unimem knows
    (see this module's documentation), and when there is no SYCL device.
    """
    global _probed
    with _lock:
        if _originals:
            return
        import dpctl
        import dpctl.memory as dpctl_memory
        import dpnp
        import dpnp.memory  # noqa: F401  (subclasses dpctl's classes: it must not see the stand-ins)
        _check_versions(dpctl, dpnp)
        get_type("xpu")       # raises, saying why, when there is no SYCL device
        if not _allocators:
            _allocators.update(_make_allocators(dpctl, dpctl_memory, pool_for, guard_for))
        current = {usm_type: getattr(dpctl_memory, CLASS_OF_USM_TYPE[usm_type]) for usm_type in USM_TYPES}
        for usm_type, cls in current.items():
            if cls is not _allocators[usm_type].kind.memory_class:
                raise RuntimeError(f"dpctl.memory.{cls.__name__} was replaced by {cls!r} "
                                   f"(another allocator hook?): unimem will not replace it in turn")
        if not _probed:
            # once: how dpnp allocates is a property of its version, and the
            # probe runs a dpnp call, which installing from one thread while
            # others compute should not add (dpnp's kernels submitted from
            # several threads at once can crash the OpenCL CPU runtime)
            _probe_dpnp(dpnp, dpctl_memory, _xpu_backend._SyclRuntime.get().default_queues[0])
            _probed = True
        for usm_type, cls in current.items():
            setattr(dpctl_memory, cls.__name__, _stand_in(cls, _allocators[usm_type]))
        _originals.update(current)


def _restore(dpctl_memory: Any) -> None:
    for cls in _originals.values():
        setattr(dpctl_memory, cls.__name__, cls)
    _originals.clear()


def reset_allocator() -> None:
    """Give dpnp back its own allocator (dpctl's ``sycl::malloc_*``).

    Arrays allocated from the pools until now stay valid; their memory goes
    back to the pools when they are gone. A no-op when not installed."""
    with _lock:
        if _originals:
            import dpctl.memory as dpctl_memory
            _restore(dpctl_memory)


def allocator_installed() -> bool:
    """Whether :func:`set_allocator` is in effect."""
    return bool(_originals)


# using_allocator blocks under way, in all threads, and whether the first
# of them installed the allocator (the last to end then removes it).
_blocks_under_way = 0
_installed_by_blocks = False


@contextlib.contextmanager
def using_allocator(pool_for: PoolFor, guard_for: GuardFor) -> Iterator[None]:
    """A context manager: ``pool_for``'s pools allocate dpnp's arrays inside
    the block; afterwards the allocator that was in effect before is back.

    dpnp has one allocator for the whole process, so the pools serve every
    thread while any thread is inside such a block: blocks of several threads
    overlap, and the allocator goes away only when the last of them ends (if
    none was installed before the first began)."""
    global _blocks_under_way, _installed_by_blocks
    with _lock:
        if _blocks_under_way == 0:
            was_installed = allocator_installed()
            set_allocator(pool_for, guard_for)
            _installed_by_blocks = not was_installed
        _blocks_under_way += 1
    try:
        yield
    finally:
        with _lock:
            _blocks_under_way -= 1
            if _blocks_under_way == 0 and _installed_by_blocks:
                _installed_by_blocks = False
                reset_allocator()


def allocator_counters() -> Dict[str, int]:
    """What the allocator did since the process started: requests served
    from the pools (``pooled.allocations``, ``pooled.bytes``), requests
    passed to dpctl (``bypassed.allocations``, ``bypassed.bytes``) and the
    latter by reason (``bypassed.<reason>.allocations``, ``.bytes``, reasons:
    ``foreign_context``, ``alignment``, ``zero_size``, ``other_arguments``,
    ``no_pool``). All zero before the first :func:`set_allocator`.

    dpnp's compiled code allocates small scratch buffers (packed shapes and
    strides, reduction and sort scratch) with ``sycl::malloc`` directly, out
    of any Python allocator's reach: they are not counted."""
    totals = {"pooled.allocations": 0, "pooled.bytes": 0, "bypassed.allocations": 0, "bypassed.bytes": 0}
    for reason in _usm_memory.BYPASS_REASONS:
        totals[f"bypassed.{reason}.allocations"] = 0
        totals[f"bypassed.{reason}.bytes"] = 0
    for allocator in _allocators.values():
        for key, value in allocator.counters().items():
            totals[key] += value
            if key.startswith("bypassed."):
                totals["bypassed." + key.rsplit(".", 1)[1]] += value
    return totals
