"""Memory history, snapshots and out-of-memory observers.

``_record_memory_history``, ``_snapshot`` and ``_dump_snapshot`` follow
``torch.cuda.memory``: the snapshot is a dict with ``segments`` (the
allocator's segments and blocks, with the Python frames that allocated them)
and ``device_traces`` (one list per device of ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free`` and ``oom`` entries),
the layout ``torch.cuda._memory_viz`` and pytorch.org/memory_viz read.

The core reports its actions to a hook only while recording is on; the hook
(here) adds Python frames and keeps the last ``max_entries`` entries.
"""
from __future__ import annotations

import collections
import functools
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

from .. import _core
from .._runtime import devices as _devices
from .._runtime.registry import DeviceRegistry
from .._runtime import fork as _fork
from .._runtime.pools import Pool

ACTIONS = _core.TRACE_ACTIONS
OOM_SNAPSHOT_ENV = "UNIMEM_OOM_SNAPSHOT"
# With a trailing separator: /site/unimem_experiments/ is not unimem's code.
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
# unimem's own modules are left out of recorded stacks; its example programs
# (the demo) are user code and stay in.
_USER_CODE_IN_PACKAGE = (os.path.join(_PACKAGE_DIR, "cli", "demo.py"),)
# The core's clock is the monotonic one; snapshots carry wall-clock microseconds.
_MONOTONIC_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()

Frame = Dict[str, Any]


class HistoryOptionError(ValueError, RuntimeError):
    """A ``_record_memory_history`` option (``enabled``, ``context``,
    ``stacks``, ``skip_actions``) that names nothing: a ``ValueError``, as
    unimem's other bad arguments, and the ``RuntimeError`` PyTorch's option
    checks raise."""


class HistoryArgumentTypeError(ValueError, TypeError):
    """A ``max_entries`` that is no count, or an ``enabled``, ``context`` or
    ``stacks`` that is no string: a ``ValueError``, and the ``TypeError``
    PyTorch's binding raises for it (pybind11's conversion to a ``size_t``
    or an ``std::string``)."""


def is_unimem_code(filename: str) -> bool:
    """Whether ``filename`` is unimem's own code, left out of recorded stacks
    (its example programs are user code)."""
    return filename.startswith(_PACKAGE_DIR) and filename not in _USER_CODE_IN_PACKAGE


def python_frames(limit: int = 64) -> List[Frame]:
    """The caller's Python stack, innermost first, without unimem's own frames."""
    frame = sys._getframe(1)
    frames: List[Frame] = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        filename = code.co_filename
        # is_unimem_code(filename), inlined: this runs for every frame of
        # every allocation recorded, and the call would cost it about 5%
        if not filename.startswith(_PACKAGE_DIR) or filename in _USER_CODE_IN_PACKAGE:
            frames.append({"filename": filename, "line": frame.f_lineno, "name": code.co_name})
        frame = frame.f_back
    return frames


class History:
    """The recorded history of one pool (``unimem.xpu``'s, the pinned host pool, ...).

    As in PyTorch's caching allocator, two things are kept: the trace (the
    last ``max_entries`` actions with ``enabled="all"``, the last one with
    ``"state"``) and the frames
    that allocated each live block and segment (whenever ``context`` is set),
    which the snapshot attaches to its segments and blocks.
    """

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.enabled: Optional[str] = None
        self.context: Optional[str] = None
        self.max_entries = sys.maxsize
        self.skip_actions: frozenset = frozenset()
        self.traces: Dict[int, Deque[Dict[str, Any]]] = {}
        self.block_frames: Dict[int, Dict[int, List[Frame]]] = {}
        self.segment_frames: Dict[int, Dict[int, List[Frame]]] = {}
        # While recording is off the core reports nothing, so a block freed
        # then cannot be seen leaving. Per device: the free counters when
        # recording stopped; once they move, the remembered frames may
        # belong to freed memory and are dropped (see _drop_stale_frames).
        self.paused_counters: Dict[int, Tuple[int, int]] = {}
        # Reentrant: Python runs while it is held (the hook builds frames and
        # entries, which may start the cyclic collector, and a signal handler
        # may run between any two bytecodes), and a finalizer's free or a
        # handler's _snapshot() comes back here on the same thread.
        self.lock = threading.RLock()

    @staticmethod
    def check_arguments(enabled: Optional[str], context: Optional[str], stacks: str,
                        max_entries: int, skip_actions: Optional[List[str]]) -> frozenset:
        """The arguments of ``_record_memory_history`` checked; the actions to skip."""
        for name, value, optional in (("enabled", enabled, True), ("context", context, True),
                                      ("stacks", stacks, False)):
            if not isinstance(value, str) and not (optional and value is None):
                expected = "a str or None" if optional else "a str"
                raise HistoryArgumentTypeError(f"{name} must be {expected}, not {type(value).__name__}")
        if enabled not in (None, "state", "all"):
            raise HistoryOptionError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        if context not in (None, "state", "alloc", "all"):
            raise HistoryOptionError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
        if stacks not in ("python", "all"):
            raise HistoryOptionError(f"stacks must be 'python' or 'all', got {stacks!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or not 0 <= max_entries < 1 << 64:
            # PyTorch's max_entries is a size_t
            raise HistoryArgumentTypeError(f"max_entries must be an int from 0 to 2**64 - 1, got {max_entries!r}")
        if (not isinstance(skip_actions, (list, tuple, set, frozenset, type(None)))
                or not all(isinstance(action, str) for action in skip_actions or ())):
            raise TypeError(f"skip_actions must be a list of action names, got {skip_actions!r}")
        skip = frozenset(skip_actions or ())
        unknown = skip - set(ACTIONS) - {"snapshot"}
        if unknown:
            raise HistoryOptionError(f"unknown actions in skip_actions: {sorted(unknown)}")
        return skip

    def configure(self, enabled: Optional[str], context: Optional[str], stacks: str,
                  max_entries: int, clear_history: bool, skip_actions: Optional[List[str]]) -> None:
        """Set what is recorded, with ``_record_memory_history``'s arguments."""
        skip = self.check_arguments(enabled, context, stacks, max_entries, skip_actions)
        self._apply(enabled, context, max_entries, clear_history, skip)

    def _apply(self, enabled: Optional[str], context: Optional[str], max_entries: int,
               clear_history: bool, skip: frozenset) -> None:
        with self.lock:
            self.enabled = enabled
            self.context = context if enabled else None
            self.skip_actions = skip
            # PyTorch's recordHistory: disabling, or clear_history, drops the
            # recorded actions; re-enabling without it appends to them.
            drop = enabled is None or clear_history
            # As PyTorch's _record_memory_history: "state" keeps one entry, the
            # last; and at least one (its max(1, max_entries)). A deque holds
            # at most sys.maxsize: more is no limit either.
            max_entries = min(max(max_entries, 1), sys.maxsize) if enabled == "all" else 1
            self.traces = {d: collections.deque(() if drop else t, maxlen=max_entries)
                           for d, t in self.traces.items()}
            self.max_entries = max_entries

    def pause(self, allocators: Dict[int, _core.CachingAllocator]) -> None:
        """Recording stops: remember where the free counters stand."""
        with self.lock:
            for device, allocator in allocators.items():
                if device not in self.paused_counters:
                    self.paused_counters[device] = _free_counters(allocator)

    def resume(self, allocators: Dict[int, _core.CachingAllocator]) -> None:
        """Recording starts again: forget the frames of what was freed meanwhile."""
        with self.lock:
            self._drop_stale_frames(allocators)
            self.paused_counters.clear()

    def _drop_stale_frames(self, allocators: Dict[int, _core.CachingAllocator]) -> None:
        """Drop the frames that may describe memory freed while recording was
        off (called with the lock held). Which blocks were freed is not known,
        so when any block (segment) was freed every remembered block
        (segment) frame of that device goes: a missing stack rather than a
        wrong one."""
        for device, before in list(self.paused_counters.items()):
            allocator = allocators.get(device)
            now = _free_counters(allocator) if allocator is not None else (-1, -1)
            if now[0] != before[0]:
                self.block_frames.pop(device, None)
            if now[1] != before[1]:
                self.segment_frames.pop(device, None)
            self.paused_counters[device] = now

    def hook_for(self, allocator: _core.CachingAllocator) -> Callable[[list], Callable[[], None]]:
        # The allocator holds the hook: the hook holds the allocator weakly
        # (a cycle would have the collector tear down its backend first).
        device = allocator.device
        allocator_ref = weakref.ref(allocator)

        def hook(events: list) -> Callable[[], None]:
            # Runs on the thread whose operations made the events (its
            # frames are the caller's); the returned commit runs in the
            # allocator's order of batches (_core_history.pxi).
            # PyTorch's RecordContext: "state" keeps the allocating stack of
            # live blocks and segments only; "alloc" also puts it on the
            # trace entries (a free's entry carries the stack that allocated
            # the block); "all" gives frees the freeing stack.
            context = self.context
            here: Optional[List[Frame]] = None
            if context is not None and any(e[0] in ("alloc", "segment_alloc", "oom") for e in events) \
                    or context == "all":
                here = python_frames()
            device_free = 0
            if any(e[0] == "oom" for e in events):
                try:
                    device_free = allocator_ref().backend.memory_info(device)[0]
                except Exception:
                    device_free = 0
            return functools.partial(self._commit, device, events, context, here or [], device_free)
        return hook

    def _commit(self, device: int, events: list, context: Optional[str], here: List[Frame],
                device_free: int) -> None:
        """Put one batch of ``device``'s events into the history, in turn."""
        on_entries = context in ("alloc", "all")
        with self.lock:
            trace = self.traces.get(device)
            if trace is None:
                trace = self.traces[device] = collections.deque(maxlen=self.max_entries)
            blocks = self.block_frames.setdefault(device, {})
            segments = self.segment_frames.setdefault(device, {})
            for action, addr, size, stream, time_ns, client in events:
                entry_frames: List[Frame] = []
                if action in ("alloc", "segment_alloc", "oom") or context == "all":
                    entry_frames = here
                known = blocks if action in ("alloc", "free_requested", "free_completed") else segments
                if action in ("alloc", "segment_alloc"):
                    if context is not None:
                        known[addr] = entry_frames
                    else:
                        known.pop(addr, None)
                elif action in ("free_requested", "free_completed", "segment_free"):
                    if context == "alloc":
                        entry_frames = known.get(addr, [])
                    if action != "free_requested":
                        known.pop(addr, None)
                if action in self.skip_actions:
                    continue
                entry = {"action": action, "addr": addr, "size": size, "stream": stream,
                         "time_us": (time_ns + _MONOTONIC_TO_EPOCH_NS) // 1000,
                         "frames": entry_frames if on_entries else []}
                if client is not None:       # a block's event: whose block (unimem's addition)
                    entry["client"] = client
                if action == "oom":
                    del entry["addr"]
                    entry["device_free"] = device_free
                trace.append(entry)

    def segments(self, allocators: Dict[int, _core.CachingAllocator]) -> List[Dict[str, Any]]:
        for allocator in allocators.values():
            allocator.flush_history()        # frees done by finalizers are buffered
        out: List[Dict[str, Any]] = []
        with self.lock:
            self._drop_stale_frames(allocators)
            for device, allocator in allocators.items():
                blocks = self.block_frames.get(device, {})
                seg_frames = self.segment_frames.get(device, {})
                for seg in allocator.snapshot():
                    seg["frames"] = seg_frames.get(seg["address"], [])
                    for block in seg["blocks"]:
                        if block["state"] != "inactive":
                            block["frames"] = blocks.get(block["address"], [])
                    out.append(seg)
        return out

    def device_traces(self, device_count: int) -> List[List[Dict[str, Any]]]:
        with self.lock:
            return [list(self.traces.get(d, ())) for d in range(device_count)]


def _free_counters(allocator: _core.CachingAllocator) -> Tuple[int, int]:
    """How many blocks and segments ``allocator`` has freed (counts that only
    grow, but for a reset of the accumulated statistics, which also shows)."""
    stats = allocator.memory_stats()
    return stats.get("allocation.all.freed", 0), stats.get("segment.all.freed", 0)


_histories: Dict[Pool, History] = {}
_histories_lock = threading.Lock()


def history(pool: Pool) -> History:
    with _histories_lock:
        found = _histories.get(pool)
        if found is None:
            found = _histories[pool] = History(pool)
        return found


def _attach(pool: Pool, allocator: _core.CachingAllocator) -> None:
    """Every new allocator: debug mode's stacks (``UNIMEM_DEBUG``, where the
    host can read the memory), the history hook (if recording) and the OOM
    dispatcher."""
    if _devices.debug_mode_requested() and getattr(allocator.backend, "host_accessible", False):
        allocator.enable_debug(python_frames)
    recorder = _histories.get(pool)
    if recorder is not None and recorder.enabled:
        allocator.set_trace_hook(recorder.hook_for(allocator))
    allocator.add_oom_observer(_OOMDispatcher(pool, allocator))


_devices.on_allocator_created(_attach)


def record_memory_history(pool: Pool, registry: DeviceRegistry, enabled: Optional[str] = "all",
                          context: Optional[str] = "all", stacks: str = "python",
                          max_entries: int = sys.maxsize, clear_history: bool = False,
                          skip_actions: Optional[List[str]] = None) -> None:
    """``_record_memory_history`` for every allocator of ``pool`` (whose
    registry is ``registry``), present and future."""
    skip = History.check_arguments(enabled, context, stacks, max_entries, skip_actions)
    recorder = history(pool)
    was_enabled = recorder.enabled
    allocators = registry.initialized()
    if was_enabled and not enabled:
        # Counted before the buffered actions reach the hook: one that slips
        # in between moves the counters, and the frames it concerns are dropped.
        recorder.pause(allocators)
        for allocator in allocators.values():
            allocator.flush_history()
    recorder._apply(enabled, context, max_entries, clear_history, skip)
    if enabled and not was_enabled:
        recorder.resume(allocators)
    for allocator in allocators.values():
        allocator.set_trace_hook(recorder.hook_for(allocator) if enabled else None)


def snapshot(pool: Pool, registry: DeviceRegistry) -> Dict[str, Any]:
    """``_snapshot`` of ``pool`` (whose registry is ``registry``): its
    segments and the recorded traces, in PyTorch's layout."""
    recorder = history(pool)
    allocators = registry.initialized()
    settings = next(iter(allocators.values())).settings if allocators else {}
    return {
        "segments": recorder.segments(allocators),
        "device_traces": recorder.device_traces(registry.device_count),
        "allocator_settings": dict(settings, pool=pool.name),
        "external_annotations": [],
    }


PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def dump_snapshot(pool: Pool, registry: DeviceRegistry, filename: PathLike) -> None:
    """Pickle :func:`snapshot` of ``pool`` into ``filename``."""
    # open() would also take an int as a file descriptor, and close it.
    if not isinstance(filename, (str, bytes, os.PathLike)):
        raise TypeError(f"filename must be a path (str or os.PathLike), got {type(filename).__name__}")
    data = snapshot(pool, registry)
    with open(filename, "wb") as f:
        pickle.dump(data, f)


# ---------------------------------------------------------------------------
# out-of-memory observers
# ---------------------------------------------------------------------------
OOMObserver = Callable[[int, int, int, int], Any]
OOMStatsObserver = Callable[[_devices.device, int, "collections.OrderedDict[str, int]"], Any]
_oom_observers: List[OOMObserver] = []
_oom_stats_observers: List[OOMStatsObserver] = []


def attach_out_of_memory_observer(observer: OOMObserver) -> None:
    r"""Attach an out-of-memory observer to every unimem pool.

    ``observer(device, alloc, device_allocated, device_free)`` is called on
    every out-of-memory error, before it is raised, with PyTorch's arguments
    (``torch._C._cuda_attach_out_of_memory_observer``), all ints: the device
    index, the bytes the allocator tried to get from the device, the bytes
    allocated on the device by the pool, and the bytes free on the device
    (0 where the device does not say).

    PyTorch's C++ passes the device's total memory (or the memory fraction's
    limit) as ``device_allocated``; unimem passes what the name says. The
    index does not say which pool ran out (``xpu`` 0 or the pinned pool):
    :func:`attach_out_of_memory_stats_observer` does.

    An exception raised by one observer does not stop the others; it is
    reported through :func:`sys.unraisablehook` after they ran.
    ``KeyboardInterrupt`` and ``SystemExit`` reach the program at once.
    """
    if not callable(observer):
        raise TypeError("an out-of-memory observer must be callable")
    _oom_observers.append(observer)


def detach_out_of_memory_observer(observer: OOMObserver) -> None:
    """Detach an observer attached with :func:`attach_out_of_memory_observer`
    (``ValueError`` if it is not attached)."""
    _oom_observers.remove(observer)


def attach_out_of_memory_stats_observer(observer: OOMStatsObserver) -> None:
    """Call ``observer(device, requested, memory_stats)`` on every
    out-of-memory error of any unimem pool, before it is raised: ``device``
    is a :class:`unimem.device` naming the pool's device (``device("xpu", 0)``;
    the pinned pool is ``device("cpu", 0)``, a ``unimem.cuda.MemoryPool``'s
    are on ``cuda`` devices), ``requested`` the bytes asked
    for, ``memory_stats`` the pool's statistics at the failure."""
    if not callable(observer):
        raise TypeError("an out-of-memory observer must be callable")
    _oom_stats_observers.append(observer)


def detach_out_of_memory_stats_observer(observer: OOMStatsObserver) -> None:
    """Detach an observer attached with :func:`attach_out_of_memory_stats_observer`."""
    _oom_stats_observers.remove(observer)


class _OOMDispatcher:
    """The core's observer on one allocator: runs the user's observers and
    writes ``UNIMEM_OOM_SNAPSHOT``."""

    def __init__(self, pool: Pool, allocator: _core.CachingAllocator) -> None:
        self.pool = pool
        self.allocator = weakref.ref(allocator)      # the allocator holds this observer

    def __call__(self, device: int, requested: int, allocated: int, reserved: int, free: Any) -> None:
        allocator = self.allocator()
        if allocator is None:
            return
        calls: List[Callable[[], Any]] = [
            functools.partial(observer, device, requested, allocated, free or 0)
            for observer in list(_oom_observers)]
        if _oom_stats_observers:
            stats = allocator.memory_stats()
            where = _devices.device(self.pool.device_type, device)
            calls += [functools.partial(observer, where, requested, stats)
                      for observer in list(_oom_stats_observers)]
        path = os.environ.get(OOM_SNAPSHOT_ENV)
        if path:
            calls.append(lambda: dump_snapshot(self.pool, self.pool.registry(), path))
        # One failing observer must not silence the others; only Exception is
        # held back (KeyboardInterrupt and SystemExit go through at once).
        errors: List[Exception] = []
        for call in calls:
            try:
                call()
            except Exception as exc:
                if errors:
                    exc.__context__ = errors[-1]
                errors.append(exc)
        if errors:
            raise errors[-1]


# ---------------------------------------------------------------------------
# fork(): a lock held by another thread at the fork stays held in the child
# ---------------------------------------------------------------------------
def _new_locks_in_child() -> None:
    """In a forked child only the forking thread lives on: a history lock held
    by any other thread (inside the history hook) would never be released."""
    global _histories_lock
    _histories_lock = threading.Lock()
    for recorder in list(_histories.values()):
        recorder.lock = threading.Lock()


_fork.on_fork_in_child(_new_locks_in_child)
