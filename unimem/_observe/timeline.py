"""The timeline of a snapshot, swept once: what ``plot`` (a PNG) and ``view``
(an HTML report) both draw.

:class:`Timeline` reads one device's trace: every allocation's lifetime and
its place in the stack of live allocations over time (as PyTorch's "Active
Memory Timeline" stacks them), active and reserved memory after every event,
the out-of-memory errors and the peak. :func:`allocation_site` names where an
allocation was made from its recorded frames, without reading any file
unless asked to.
"""
from __future__ import annotations

import functools
import os
import site
import sysconfig
from typing import Any, Callable, Dict, List, Optional, Tuple

from .history import is_unimem_code
from .snapshot_file import read_source_line

Frame = Dict[str, Any]
# Trace actions that change reserved memory: segments, and the pages that
# expandable segments map and unmap (PyTorch's segment_map/segment_unmap).
GROWS = ("segment_alloc", "segment_map")
SHRINKS = ("segment_free", "segment_unmap")
NO_FRAMES = "(no Python frame recorded)"
MiB = float(1 << 20)


def pick_device(snapshot: Dict[str, Any], device: Optional[int]) -> int:
    """The device of ``snapshot`` to draw: ``device`` if the snapshot has it
    (``ValueError`` otherwise), else the one with the longest trace, else the
    first with segments."""
    traces = snapshot.get("device_traces") or []
    if device is not None:
        if device < 0:
            raise ValueError(f"a device index is not negative, got {device}")
        if device >= len(traces) and not any(s.get("device") == device for s in snapshot["segments"]):
            raise ValueError(f"the snapshot has no device {device}")
        return device
    if traces and any(traces):
        return max(range(len(traces)), key=lambda d: len(traces[d]))
    devices = sorted({s.get("device", 0) for s in snapshot["segments"]})
    return devices[0] if devices else 0


# The folders installers put packages in: how a frame recorded by another
# interpreter (whose folders this one does not know) shows it is library code.
_INSTALL_FOLDER_NAMES = ("site-packages", "dist-packages")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> Tuple[str, ...]:
    """This interpreter's folders of installed packages and of the standard
    library, each ending in a separator (so ``/lib/python3.1`` is no prefix
    of ``/lib/python3.11``)."""
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    found.update(getattr(site, "getsitepackages", list)())     # absent in some old virtualenvs
    found.add(site.getusersitepackages())
    with_links_resolved = found | {os.path.realpath(d) for d in found}
    return tuple(os.path.join(d, "") for d in sorted(with_links_resolved) if d)


def _is_library_code(filename: str) -> bool:
    """Whether ``filename`` is an installed package's, the standard library's
    (frozen modules included) or unimem's, rather than the user's."""
    return (filename.startswith(_library_dirs()) or filename.startswith("<frozen ")
            or is_unimem_code(filename)
            or any(part in _INSTALL_FOLDER_NAMES for part in filename.split(os.sep)))


def allocation_site(frames: List[Frame], read_source: bool = False) -> str:
    """Where an allocation was made: ``file:line name`` (with ``read_source``,
    the source line instead of the function's name when the file is readable).

    The place is the innermost frame of the user's code: an array library
    (dpnp, CuPy) allocates in its own frames, which would name every band
    alike; when every frame is library code, the innermost."""
    if not frames:
        return NO_FRAMES
    f = next((f for f in frames if not _is_library_code(f["filename"])), frames[0])
    # read_source_line, not linecache: a snapshot may name /dev/zero or a FIFO.
    source = read_source_line(f["filename"], f["line"]) if read_source else ""
    if len(source) > 34:
        source = source[:33] + "…"
    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {source or f['name']}"


class Timeline:
    """The trace of one device, swept once: allocation lifetimes, their
    stacked positions over time, active and reserved memory after each
    event, OOMs, and the peak. ``site`` names an allocation's place from its
    frames (:func:`allocation_site` by default, which opens no file)."""

    def __init__(self, snapshot: Dict[str, Any], device: int,
                 site: Callable[[List[Frame]], str] = allocation_site) -> None:
        traces = snapshot.get("device_traces") or []
        events = [e for e in (traces[device] if device < len(traces) else [])
                  if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
                                     "segment_unmap", "oom")]
        self.segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
        self.has_history = bool(events)
        start_us = events[0].get("time_us", 0) if events else 0
        self.times = [(e.get("time_us", i) - start_us) / 1e6 if "time_us" in e else float(i)
                      for i, e in enumerate(events)]
        self.ooms: List[Tuple[float, int]] = []
        self.reserved: List[float] = []
        self.active: List[float] = []
        # Sizes still alive at the end but not allocated in the trace, and
        # frees of allocations made before it: memory from before the recording.
        allocated_in_trace = set()
        open_at_end: Dict[int, int] = {}
        freed_before: List[Tuple[int, int]] = []
        for i, e in enumerate(events):
            if e["action"] == "alloc":
                allocated_in_trace.add(e["addr"])
                open_at_end[e["addr"]] = e["size"]
            elif e["action"] == "free_completed":
                if e["addr"] in open_at_end:
                    del open_at_end[e["addr"]]
                else:
                    freed_before.append((i, e["size"]))
        final_active = sum(b["size"] for s in self.segments for b in s["blocks"] if b["state"] != "inactive")
        base_end = max(final_active - sum(open_at_end.values()), 0)
        base = base_end + sum(size for _, size in freed_before)

        # The sweep: the live allocations in stacking order, each one's
        # bottom recorded whenever it moves.
        self.bands: List[Dict[str, Any]] = []     # addr, size, site, frames, start, end, steps [(t, bottom)]
        live: List[Dict[str, Any]] = []
        index_of: Dict[int, Dict[str, Any]] = {}
        reserved = sum(s["total_size"] for s in self.segments) - sum(
            e["size"] if e["action"] in GROWS else -e["size"]
            for e in events if e["action"] in GROWS + SHRINKS)
        self.base_steps: List[Tuple[float, float]] = []
        self.peak = (0.0, -1)                     # (active bytes, event index)
        self.live_at_peak: List[Dict[str, Any]] = []
        for i, e in enumerate(events):
            t = self.times[i]
            action = e["action"]
            moved_from = None
            if action == "alloc":
                frames = e.get("frames", [])
                band = {"addr": e["addr"], "size": e["size"], "site": site(frames), "frames": frames,
                        "start": t, "end": None, "steps": []}
                live.append(band)
                index_of[e["addr"]] = band
                self.bands.append(band)
                moved_from = len(live) - 1
            elif action == "free_completed":
                band = index_of.pop(e["addr"], None)
                if band is not None:
                    band["end"] = t
                    position = live.index(band)
                    live.pop(position)
                    moved_from = position
                else:
                    base -= e["size"]
                    moved_from = 0
                    self.base_steps.append((t, base))
            elif action in GROWS:
                reserved += e["size"]
            elif action in SHRINKS:
                reserved -= e["size"]
            elif action == "oom":
                self.ooms.append((t, e["size"]))
            self.reserved.append(reserved)
            y = float(base)
            for position, band in enumerate(live):
                if moved_from is not None and position >= moved_from:
                    if not band["steps"] or band["steps"][-1][1] != y:
                        band["steps"].append((t, y))
                y += band["size"]
            self.active.append(y)
            if y > self.peak[0]:
                self.peak = (y, i)
                self.live_at_peak = list(live)
        if not self.base_steps or self.base_steps[0][0] != (self.times[0] if events else 0.0):
            first = base_end + sum(size for _, size in freed_before)
            self.base_steps.insert(0, (self.times[0] if events else 0.0, float(first)))
        self.end_time = self.times[-1] if events else 0.0

    def site_totals(self) -> List[Tuple[str, int]]:
        """Allocation sites by the bytes they hold at the peak (then by total)."""
        at_peak: Dict[str, int] = {}
        for band in self.live_at_peak:
            at_peak[band["site"]] = at_peak.get(band["site"], 0) + band["size"]
        overall: Dict[str, int] = {}
        for band in self.bands:
            overall[band["site"]] = overall.get(band["site"], 0) + band["size"]
        return sorted(overall.items(), key=lambda kv: (at_peak.get(kv[0], 0), kv[1]), reverse=True)


def band_polygon(band: Dict[str, Any], end_time: float,
                 steps: Optional[List[Tuple[float, float]]] = None) -> List[Tuple[float, float]]:
    """A step-shaped polygon, in (seconds, MiB): the band's bottom as it moves
    (``steps``, by default the band's own), its top size above."""
    end = band["end"] if band["end"] is not None else end_time
    steps = steps or band["steps"] or [(band["start"], 0.0)]
    lower: List[Tuple[float, float]] = []
    for k, (t, y) in enumerate(steps):
        if k:
            lower.append((t, steps[k - 1][1] / MiB))
        lower.append((t, y / MiB))
    lower.append((end, steps[-1][1] / MiB))
    upper = [(t, y + band["size"] / MiB) for t, y in reversed(lower)]
    return lower + upper
