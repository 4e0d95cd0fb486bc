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
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional

from . import _core, _devices

ACTIONS = _core.TRACE_ACTIONS
OOM_SNAPSHOT_ENV = "UNIMEM_OOM_SNAPSHOT"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# unimem's own modules are left out of recorded stacks; its example programs
# (the demo) are user code and stay in.
_USER_CODE_IN_PACKAGE = (os.path.join(_PACKAGE_DIR, "demo.py"),)
# The core's clock is the monotonic one; snapshots carry wall-clock microseconds.
_MONOTONIC_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()

Frame = Dict[str, Any]


def python_frames(limit: int = 64) -> List[Frame]:
    """The caller's Python stack, innermost first, without unimem's own frames."""
    frame = sys._getframe(1)
    frames: List[Frame] = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(_PACKAGE_DIR) or filename in _USER_CODE_IN_PACKAGE:
            frames.append({"filename": filename, "line": frame.f_lineno, "name": code.co_name})
        frame = frame.f_back
    return frames


class History:
    """The recorded history of one pool ("xpu", "cpu", "host", ...)."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.enabled: Optional[str] = None
        self.context: Optional[str] = None
        self.max_entries = sys.maxsize
        self.skip_actions: frozenset = frozenset()
        self.traces: Dict[int, Deque[Dict[str, Any]]] = {}
        self.block_frames: Dict[int, Dict[int, List[Frame]]] = {}
        self.segment_frames: Dict[int, Dict[int, List[Frame]]] = {}
        self.lock = threading.Lock()

    def configure(self, enabled: Optional[str], context: Optional[str], stacks: str,
                  max_entries: int, clear_history: bool, skip_actions: Optional[List[str]]) -> None:
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        if context not in (None, "state", "alloc", "all"):
            raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        skip = frozenset(skip_actions or ())
        unknown = skip - set(ACTIONS) - {"snapshot"}
        if unknown:
            raise ValueError(f"unknown actions in skip_actions: {sorted(unknown)}")
        with self.lock:
            self.enabled = enabled
            self.context = context if enabled else None
            self.skip_actions = skip
            if clear_history or max_entries != self.max_entries:
                self.traces = {d: collections.deque(t if not clear_history else (), maxlen=max_entries)
                               for d, t in self.traces.items()}
            self.max_entries = max_entries
            if clear_history:
                self.block_frames.clear()
                self.segment_frames.clear()

    def hook_for(self, allocator: _core.CachingAllocator) -> Callable[[list], None]:
        # The allocator holds the hook: the hook holds the allocator weakly
        # (a cycle would have the collector tear down its backend first).
        device = allocator.device
        allocator_ref = weakref.ref(allocator)

        def hook(events: list) -> None:
            context = self.context
            frames: Optional[List[Frame]] = None
            with self.lock:
                trace = self.traces.get(device)
                if trace is None:
                    trace = self.traces[device] = collections.deque(maxlen=self.max_entries)
                blocks = self.block_frames.setdefault(device, {})
                segments = self.segment_frames.setdefault(device, {})
                for action, addr, size, stream, time_ns in events:
                    is_free = action in ("free_requested", "free_completed")
                    wants_frames = context is not None and (context == "all" or not is_free)
                    entry_frames: List[Frame] = []
                    if wants_frames:
                        if frames is None:
                            frames = python_frames()
                        entry_frames = frames
                    if action == "alloc" and wants_frames:
                        blocks[addr] = entry_frames
                    elif action == "free_completed":
                        blocks.pop(addr, None)
                    elif action == "segment_alloc" and wants_frames:
                        segments[addr] = entry_frames
                    elif action == "segment_free":
                        segments.pop(addr, None)
                    if self.enabled != "all" or action in self.skip_actions:
                        continue
                    entry = {"action": action, "addr": addr, "size": size, "stream": stream,
                             "time_us": (time_ns + _MONOTONIC_TO_EPOCH_NS) // 1000,
                             "frames": entry_frames if context in ("alloc", "all") or
                             (context == "state" and action == "alloc") else []}
                    if action == "oom":
                        del entry["addr"]
                        try:
                            entry["device_free"] = allocator_ref().backend.memory_info(device)[0]
                        except Exception:
                            entry["device_free"] = 0
                    trace.append(entry)
        return hook

    def segments(self, allocators: Dict[int, _core.CachingAllocator]) -> List[Dict[str, Any]]:
        for allocator in allocators.values():
            allocator.flush_history()        # frees done by finalizers are buffered
        out: List[Dict[str, Any]] = []
        with self.lock:
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


_histories: Dict[str, History] = {}
_histories_lock = threading.Lock()


def history(pool: str) -> History:
    with _histories_lock:
        found = _histories.get(pool)
        if found is None:
            found = _histories[pool] = History(pool)
        return found


def _attach(pool: str, allocator: _core.CachingAllocator) -> None:
    """Every new allocator: the history hook (if recording) and the OOM dispatcher."""
    recorder = _histories.get(pool)
    if recorder is not None and recorder.enabled:
        allocator.set_trace_hook(recorder.hook_for(allocator))
    allocator.add_oom_observer(_OOMDispatcher(pool, allocator))


_devices.on_allocator_created(_attach)


def record_memory_history(pool: str, registry: _core.DeviceRegistry, enabled: Optional[str] = "all",
                          context: Optional[str] = "all", stacks: str = "python",
                          max_entries: int = sys.maxsize, clear_history: bool = False,
                          skip_actions: Optional[List[str]] = None) -> None:
    recorder = history(pool)
    recorder.configure(enabled, context, stacks, max_entries, clear_history, skip_actions)
    for allocator in registry.initialized().values():
        allocator.set_trace_hook(recorder.hook_for(allocator) if enabled else None)


def snapshot(pool: str, registry: _core.DeviceRegistry) -> Dict[str, Any]:
    recorder = history(pool)
    allocators = registry.initialized()
    settings = next(iter(allocators.values())).settings if allocators else {}
    return {
        "segments": recorder.segments(allocators),
        "device_traces": recorder.device_traces(registry.device_count),
        "allocator_settings": dict(settings, pool=pool),
        "external_annotations": [],
    }


def dump_snapshot(pool: str, registry: _core.DeviceRegistry, filename: str) -> None:
    data = snapshot(pool, registry)
    with open(filename, "wb") as f:
        pickle.dump(data, f)


# ---------------------------------------------------------------------------
# out-of-memory observers
# ---------------------------------------------------------------------------
OOMObserver = Callable[[Any, int, "collections.OrderedDict[str, int]"], Any]
_oom_observers: List[OOMObserver] = []
_registries_by_pool: Dict[str, Callable[[], _core.DeviceRegistry]] = {}


def attach_out_of_memory_observer(observer: OOMObserver) -> None:
    """Call ``observer(device, requested_bytes, memory_stats)`` on every
    out-of-memory error of any unimem pool, before it is raised. ``device``
    is a :class:`unimem.device` (``device("xpu", 0)``; the pinned pool is
    ``device("cpu", 0)``)."""
    if not callable(observer):
        raise TypeError("an out-of-memory observer must be callable")
    _oom_observers.append(observer)


def detach_out_of_memory_observer(observer: OOMObserver) -> None:
    _oom_observers.remove(observer)


def register_pool(pool: str, registry: Callable[[], _core.DeviceRegistry]) -> None:
    """Tell the OOM snapshot writer where the allocators of ``pool`` live."""
    _registries_by_pool[pool] = registry


class _OOMDispatcher:
    """The core's observer on one allocator: runs the user's observers and
    writes ``UNIMEM_OOM_SNAPSHOT``."""

    def __init__(self, pool: str, allocator: _core.CachingAllocator) -> None:
        self.pool = pool
        self.allocator = weakref.ref(allocator)      # the allocator holds this observer

    def __call__(self, device: int, requested: int, allocated: int, reserved: int, free: Any) -> None:
        allocator = self.allocator()
        if allocator is None:
            return
        stats = allocator.memory_stats()
        kind = self.pool if self.pool in _devices.KNOWN_TYPES else "cpu" if self.pool == "host" else "xpu"
        where = _devices.device(kind, device)
        for observer in list(_oom_observers):
            observer(where, requested, stats)
        path = os.environ.get(OOM_SNAPSHOT_ENV)
        if path:
            dump_snapshot(self.pool, registry_of(self.pool), path)


def registry_of(pool: str) -> _core.DeviceRegistry:
    """The registry of a pool: a device type's, or one registered by its module."""
    if pool in _registries_by_pool:
        return _registries_by_pool[pool]()
    return _devices.get_type(pool).registry
