"""Private memory pools (``MemPool``, ``use_mem_pool``) and the cache switch
(``caching_allocator_enable``, ``caching_allocator_disabled``), in PyTorch
2.13's names and wording.

A pool lives inside its device's caching allocator (the core's private
pools, ``unimem/_core_pools.pxi``): its blocks count in the device's
statistics and limits, its segments serve only its allocations. This module
is the Python face: pool ids, the MemPool object's life (its death releases
the pool), and the per-thread routing context.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy

from .. import _core
from .._runtime.devices import DeviceLike, current_type, device_index, get_type, on_allocator_created
from .._runtime.pools import Pool, PoolKind
from .arguments import check_bool, native_bool
from .device_type import DeviceTypeAPI

# PyTorch's user-created pool ids: (0, n), n counting up from 1 in the process.
_next_id = itertools.count(1)
_id_lock = threading.Lock()

# Device types whose cache is off: allocators made later start with it off too.
_caching_off: set = set()


def _new_pool_id() -> Tuple[int, int]:
    with _id_lock:
        return (0, next(_next_id))


def generate_graph_pool_handle() -> Tuple[int, int]:
    r"""
    Returns a unique handle that identifies a graph memory pool.

    This function does not create an actual memory pool and does not allocate any resources.
    The returned handle is purely an identifier and intended to be passed to graph capture APIs
    to control memory sharing and isolation between graphs.

    Returns:
        tuple[int, int]: An unique identifier for a graph memory pool.

    As PyTorch's, it is taken from the ids user-created pools take
    (:attr:`MemPool.id`, ``(0, n)``): no :class:`MemPool` has it, nor will.
    unimem captures no graphs; the handle names no pool in
    ``memory_snapshot(mempool_id=...)``.
    """
    return _new_pool_id()


def _apply_caching_switch(pool: Pool, allocator: _core.CachingAllocator) -> None:
    if pool.kind is PoolKind.DEVICE and pool.device_type in _caching_off:
        allocator.set_caching(False)


on_allocator_created(_apply_caching_switch)


class MemPool:
    r"""MemPool represents a pool of memory in a caching allocator.

    Memory allocated while the pool is active (:func:`use_mem_pool`) comes
    from the pool's own segments, which serve no other allocation; they still
    count in the device's statistics and its memory limits. The pool belongs
    to the device that is current when it is made.

    Args:
        allocator(optional): an allocator with ``malloc(size, device, stream)``
            and ``free(ptr, size, device, stream)`` (a ``CUDAPluggableAllocator``,
            ``XPUPluggableAllocator`` or :class:`unimem.PluggableAllocator`)
            that supplies the pool's memory. If :attr:`allocator` is ``None``
            (default), memory comes from the device's own backend.
        use_on_oom(bool): a bool that indicates if this pool can be used
            as a last resort if a memory allocation outside of the pool fails due
            to Out Of Memory. This is False by default.
        no_split(bool): a bool that indicates if this pool should not split a segment.
            This is False by default.

    When the MemPool object dies, the pool's free memory goes back to the
    device; memory of it still in use goes back once freed, at the next
    ``empty_cache()``.
    """

    # The device type the class makes pools for (None: the current accelerator).
    _type_name: Optional[str] = None

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False) -> None:
        use_on_oom = native_bool("use_on_oom", use_on_oom)
        no_split = native_bool("no_split", no_split)
        dtype = get_type(self._type_name) if self._type_name is not None else current_type()
        index = dtype.current_index()
        core = dtype.allocator(index)
        _core.check_pool_allocator(allocator)   # before an id is taken
        pool_id = _new_pool_id()
        core.create_pool(pool_id, allocator, use_on_oom, no_split)
        self._id = pool_id
        self._allocator = allocator
        self._device_type = dtype.name
        self._device = index
        self._core = core
        # The pool's use by this object ends with it, in a cycle too. Not at
        # interpreter exit: the process is ending, as for the allocators.
        self._finalizer = weakref.finalize(self, _release, core, pool_id)
        self._finalizer.atexit = False

    @property
    def id(self) -> Tuple[int, int]:
        r"""Returns the ID of this pool as a tuple of two ints."""
        return self._id

    @property
    def allocator(self) -> Any:
        r"""Returns the allocator this MemPool routes allocations to."""
        return self._allocator

    @property
    def device(self) -> int:
        """The index of the device the pool belongs to."""
        return self._device

    def use_count(self) -> int:
        r"""Returns the reference count of this pool: 1 for the MemPool
        object, plus one for each :func:`use_mem_pool` context using it."""
        return self._core.pool_use_count(self._id)

    def snapshot(self, include_traces: bool = True) -> List[Dict[str, Any]]:
        r"""Return a snapshot of the pool's segments: ``memory_snapshot(pool.id)``.

        Args:
            include_traces: accepted for PyTorch's signature; segments carry
                no trace entries.
        """
        check_bool("include_traces", include_traces)
        return self._core.snapshot(self._id)

    def sleep(self, offload: bool = True) -> None:
        r"""Give the memory of this pool's segments back while every live
        block of it keeps its address (:func:`sleep` for this pool only;
        beyond PyTorch). The device's other memory is untouched.

        Allocating from the pool (inside :func:`use_mem_pool`) raises
        ``RuntimeError`` until :meth:`wake_up`; its blocks may be freed
        meanwhile. Asleep already: nothing is done.

        Args:
            offload (bool): copy the bytes of the pool's live blocks to host
                memory first, for :meth:`wake_up` to copy back (default).
                ``False`` keeps no contents (faster).

        A pool whose MemPool object dies while asleep stops sleeping: what
        of it is still in use wakes up (its offloaded bytes copied back), its
        free memory goes back to the device without waking (at the next
        ``empty_cache()`` when the death comes inside another allocator call).
        ``RuntimeError`` while the device itself sleeps (its :func:`wake_up`
        would bring the pool's memory back): wake the device first.

        A pool made with its own ``allocator`` sleeps through that allocator,
        which handed its memory out: its ``release_pages``/``restore_pages``
        give the memory back and back it again, and with ``offload`` the
        bytes are copied directly (``host_accessible``) or through its
        ``copy_to_host``/``copy_from_host`` (the sleep-mode members of
        :class:`unimem.backends.base.Backend`). An allocator without them
        (a plain ``PluggableAllocator``: ``page_release_unavailable_reason``
        is not ``""``) cannot sleep: ``NotImplementedError`` naming the
        pool, the allocator and what is missing, with nothing changed; the
        device's :func:`sleep` is refused the same way while such a pool
        holds memory.
        """
        check_bool("offload", offload)
        self._core.sleep_pool(self._id, offload)

    def wake_up(self) -> None:
        r"""Back the pool's memory again at the same addresses, with the bytes
        :meth:`sleep` offloaded; allocation from the pool works again."""
        self._core.wake_up_pool(self._id)

    def is_sleeping(self) -> bool:
        r"""Return whether the pool is asleep (:meth:`sleep` without :meth:`wake_up`)."""
        return bool(self._core.is_sleeping(self._id))

    def __repr__(self) -> str:
        return f"<unimem.{self._device_type}.MemPool {self._id} on {self._device_type}:{self._device}>"


# The class under another name, for PrivatePoolAPI, whose ``MemPool`` is its subclass.
_PoolObject = MemPool


def _release(core: _core.CachingAllocator, pool_id: Tuple[int, int]) -> None:
    core.release_pool(pool_id)


def _snapshot_filter(mempool_id: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
    """The pool a snapshot is limited to (None: every segment)."""
    if mempool_id is None:
        return None
    if not (isinstance(mempool_id, (tuple, list)) and len(mempool_id) == 2
            and all(isinstance(part, int) and not isinstance(part, bool) for part in mempool_id)):
        raise TypeError(f"mempool_id must be a tuple of two ints (a MemPool's id), got {mempool_id!r}")
    mempool_id = tuple(mempool_id)        # a list too (a JSON round trip), as torch only indexes it
    if not all(0 <= part < 1 << 64 for part in mempool_id):      # PyTorch's ids are unsigned
        raise ValueError(f"{mempool_id!r} is not the id of a memory pool (two ints from 0 to 2**64 - 1)")
    return None if mempool_id == (0, 0) else mempool_id


class PrivatePoolAPI(DeviceTypeAPI):
    """MemPool, use_mem_pool and the cache switch of one device type."""

    _mempool_class: Optional[type] = None

    @property
    def MemPool(self) -> type:
        """The MemPool class of this device type (pools of its current device)."""
        if self._mempool_class is None:
            self._mempool_class = type("MemPool", (_PoolObject,), {
                "_type_name": self.type_name, "__module__": f"unimem.{self.type_name}",
                "__doc__": MemPool.__doc__})
        return self._mempool_class

    @contextlib.contextmanager
    def use_mem_pool(self, pool: _PoolObject, device: DeviceLike = None) -> Iterator[None]:
        r"""A context manager that routes allocations to a given pool.

        Args:
            pool(MemPool): a MemPool object to be made active so that
                allocations route to this pool.
            device (int, str or device, optional): selected device. Uses MemPool on
                the current device, given by :func:`current_device`,
                if :attr:`device` is ``None`` (default).

        .. note::
            This context manager makes only current thread's allocations route to
            the given pool. If a new thread is spawned inside the context manager
            the allocations in that thread will not route to the given pool.
        """
        core = self._pool_allocator(pool, device)
        core.begin_pool(pool.id)
        try:
            yield
        finally:
            core.end_pool(pool.id)

    def _pool_allocator(self, pool: Any, device: DeviceLike) -> _core.CachingAllocator:
        """The allocator ``pool`` lives in, after checking that it serves
        ``device`` of this device type."""
        if not isinstance(pool, _PoolObject):
            raise TypeError(f"use_mem_pool expects a MemPool, got {type(pool).__name__}")
        dtype = self._type()
        if pool._device_type != dtype.name:
            raise ValueError(f"{pool!r} is a pool of {pool._device_type}, not of {dtype.name}")
        index = device_index(device, dtype)
        if index != pool.device:
            raise ValueError(f"{pool!r} belongs to device {pool.device}, not to device {index}: "
                             f"make the pool with that device current")
        if dtype.registry.peek(index) is not pool._core:
            raise ValueError(f"{pool!r} was made before the {dtype.name} allocator was replaced")
        return pool._core

    def caching_allocator_enable(self, value: bool = True) -> None:
        r"""Enable or disable the caching allocator. On by default.

        Disabled, every allocation asks the backend for memory of its own
        (its rounded size), every free gives it back at once, and the
        statistics are still kept; what is cached when it is disabled goes
        back too. :func:`use_mem_pool` routes nothing while it is disabled.
        ``value`` must be a bool or a NumPy bool (``TypeError`` otherwise,
        changing nothing), as in PyTorch: ``None`` read as false would give
        the cache back.
        """
        if not isinstance(value, (bool, numpy.bool_)):
            raise TypeError(f"caching_allocator_enable expects a bool, not {type(value).__name__}")
        if value:
            _caching_off.discard(self.type_name)
        else:
            _caching_off.add(self.type_name)
        for allocator in self._initialized():
            allocator.set_caching(bool(value))

    @contextlib.contextmanager
    def caching_allocator_disabled(self) -> Iterator[None]:
        r"""Context manager that temporarily disables the caching allocator."""
        previous = self.type_name not in _caching_off
        self.caching_allocator_enable(False)
        try:
            yield
        finally:
            self.caching_allocator_enable(previous)
