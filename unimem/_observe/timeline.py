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

import bisect
import functools
import os
import site
import sysconfig
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from .history import is_unimem_code
from .snapshot_file import read_source_line

Frame = Dict[str, Any]
# Trace actions that change reserved memory: segments, and the pages that
# expandable segments map and unmap (PyTorch's segment_map/segment_unmap).
GROWS = ("segment_alloc", "segment_map")
SHRINKS = ("segment_free", "segment_unmap")
NO_FRAMES = "(no Python frame recorded)"
MiB = float(1 << 20)
# Characters of one name (a file, a function, a source line) shown in a
# chart, a legend or a hover. A snapshot may come from anyone: one
# 10,000-character file name shared by every frame of 2,000 blocks turned a
# 140 KB pickle into a 362 MB report (and a 200,000-character name took
# the plot a minute).
MAX_NAME = 120


def shorten(text: str, limit: int = MAX_NAME) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"
# The band steps one timeline records at most (a band's bottom each time it
# moves): what a screen shows, within a second or two and well under a GiB.
STEP_BUDGET = 500_000
# A screen is a few thousand pixels wide: a line keeps at most four points
# (first, lowest, highest, last) in each of this many slices of time, so that
# every peak and trough stays where it was; a band's bottom, in this many.
TIME_SLICES = 1000
BAND_TIME_SLICES = 300
# Out-of-memory errors marked one by one (the plot: a line and a note each;
# the report: a line and a marker each). A trace may hold any number of
# them: 50,000 references to one shared entry fit a 100 KB pickle, and each
# mark cost the plot about 12 ms (10 minutes in all). Past this many, the
# first ones are marked and the legend says how many there were.
MAX_OOM_MARKS = 100
# Blocks a segment map draws one by one, in all (the largest segment's
# first): one segment of 12,000 blocks made a 61 MB report from a 0.38 MB
# pickle. The rest of each segment is one bar that sums them up.
MAX_SEGMENT_BLOCKS = 5000


def oom_marks(ooms: List[Tuple[float, int]]) -> Tuple[List[Tuple[float, int]], str]:
    """The out-of-memory errors ``(time, requested bytes)`` to mark one by
    one (the first :data:`MAX_OOM_MARKS`), and the legend's name for them."""
    if len(ooms) <= MAX_OOM_MARKS:
        return ooms, "out of memory"
    return ooms[:MAX_OOM_MARKS], f"out of memory ({len(ooms):,} errors, the first {MAX_OOM_MARKS} marked)"


def segment_rows(segments: List[Dict[str, Any]], max_rows: int,
                 max_blocks: int = MAX_SEGMENT_BLOCKS) -> List[Tuple[Dict[str, Any], int]]:
    """The rows of a segment map: the ``max_rows`` largest segments, by
    address, each with how many of its blocks (from its start) are drawn one
    by one, ``max_blocks`` in all, the largest segments' first."""
    largest = sorted(range(len(segments)), key=lambda k: segments[k]["total_size"], reverse=True)[:max_rows]
    left, drawn = max_blocks, {}
    for k in largest:
        drawn[k] = min(len(segments[k]["blocks"]), left)
        left -= drawn[k]
    return [(segments[k], drawn[k]) for k in sorted(largest, key=lambda k: (segments[k]["address"], k))]


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


# Per file name, not per allocation: a snapshot may share one long name
# among all its frames (a 1 MiB name, 2,000 allocations: a minute per view).
@functools.lru_cache(maxsize=4096)
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
    return f"{_file_label(f['filename'])}:{f['line']} {shorten(source or f['name'])}"


@functools.lru_cache(maxsize=4096)
def _file_label(filename: str) -> str:
    """A file's name without its folders, shortened (cached: see _is_library_code)."""
    return shorten(filename.rsplit("/", 1)[-1])


def _live_from_before(segments: List[Dict[str, Any]], open_at_end: Dict[int, int]) -> int:
    """Bytes still live at the end that the trace did not allocate: the
    live blocks at no address of an allocation still open in the trace.
    Block sizes are rounded and the trace's sizes are the requests, so the
    difference of the two totals would count the rounding as memory from
    before the recording. A snapshot whose blocks lack addresses falls back
    to that difference."""
    live = [b for s in segments for b in s["blocks"] if b["state"] != "inactive"]
    if all("address" in b for b in live):
        return sum(b["size"] for b in live if b["address"] not in open_at_end)
    return max(sum(b["size"] for b in live) - sum(open_at_end.values()), 0)


class Timeline:
    """The trace of one device, swept once: allocation lifetimes, their
    stacked positions over time, active and reserved memory after each
    event, OOMs, and the peak. ``site`` names an allocation's place from its
    frames (:func:`allocation_site` by default, which opens no file).
    ``tracked``: how many of the largest allocations get a band of their own
    (at most; fewer on a long trace, see STEP_BUDGET)."""

    def __init__(self, snapshot: Dict[str, Any], device: int,
                 site: Callable[[List[Frame]], str] = allocation_site, tracked: int = 20_000) -> None:
        traces = snapshot.get("device_traces") or []
        events = [e for e in (traces[device] if device < len(traces) else [])
                  if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
                                     "segment_unmap", "oom")]
        self.segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
        self.has_history = bool(events)
        # Seconds since the first entry where every entry has its time_us;
        # else the entries' numbers in the trace (a mix of the two would
        # put entries out of order).
        self.timed = all("time_us" in e for e in events)
        start_us = events[0]["time_us"] if events and self.timed else 0
        self.times = ([(e["time_us"] - start_us) / 1e6 for e in events] if self.timed
                      else [float(i) for i in range(len(events))])
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
        base_end = _live_from_before(self.segments, open_at_end)
        base = base_end + sum(size for _, size in freed_before)

        # Which allocations get their own band (their bottom recorded as it
        # moves): the ``tracked`` largest, the longest lived first among
        # equals, as long as their steps stay within STEP_BUDGET. A band moves
        # whenever one below it is freed, so a trace that frees its oldest
        # allocations first moves every band at every free: recording them
        # all cost time and memory growing with the square of the live
        # allocations.
        with_band = _bands_within_budget(events, self.times, tracked)

        # The sweep: the live allocations in stacking order (the order they
        # were made); of the tracked ones, each one's bottom recorded
        # whenever it moves.
        self.bands: List[Dict[str, Any]] = []     # addr, size, site, frames, start, end, tracked, steps [(t, bottom)]
        index_of: Dict[int, Dict[str, Any]] = {}
        tracked_orders: List[int] = []             # the live tracked bands, by the order they were made
        tracked_live: List[Dict[str, Any]] = []
        live_bytes = 0
        reserved = sum(s["total_size"] for s in self.segments) - sum(
            e["size"] if e["action"] in GROWS else -e["size"]
            for e in events if e["action"] in GROWS + SHRINKS)
        self.base_steps: List[Tuple[float, float]] = []
        # The levels just before the first event (memory from before the
        # recording, freed by it, counts too): the peak may be there.
        self.active_at_start = float(base)
        self.reserved_at_start = float(reserved)
        self.peak = (self.active_at_start, 0) if events else (0.0, -1)   # (active bytes, event index)
        site_of_list: Dict[int, str] = {}          # id of a list of frames (alive in events) -> its site
        for i, e in enumerate(events):
            t = self.times[i]
            action = e["action"]
            if action == "alloc":
                frames = e.get("frames", [])
                # Once per list of frames: a snapshot may share one among all its entries.
                place = site_of_list.get(id(frames))
                if place is None:
                    place = site_of_list[id(frames)] = site(frames)
                band = {"addr": e["addr"], "size": e["size"], "site": place, "frames": frames,
                        "start": t, "end": None, "tracked": i in with_band, "steps": [],
                        "order": len(self.bands), "first": i, "last": None}
                if band["tracked"]:
                    band["bottom"] = float(base + live_bytes)
                    band["steps"].append((t, band["bottom"]))
                    tracked_orders.append(band["order"])
                    tracked_live.append(band)
                live_bytes += e["size"]
                index_of[e["addr"]] = band
                self.bands.append(band)
            elif action == "free_completed":
                band = index_of.pop(e["addr"], None)
                if band is not None:
                    band["end"] = t
                    band["last"] = i
                    live_bytes -= band["size"]
                    above = bisect.bisect_right(tracked_orders, band["order"])
                    if band["tracked"]:
                        del tracked_orders[above - 1], tracked_live[above - 1]
                        above -= 1
                    _move_down(tracked_live, above, band["size"], t)
                else:
                    base -= e["size"]
                    self.base_steps.append((t, base))
                    _move_down(tracked_live, 0, e["size"], t)
            elif action in GROWS:
                reserved += e["size"]
            elif action in SHRINKS:
                reserved -= e["size"]
            elif action == "oom":
                self.ooms.append((t, e["size"]))
            self.reserved.append(reserved)
            y = float(base + live_bytes)
            self.active.append(y)
            if y > self.peak[0]:
                self.peak = (y, i)
        peak = self.peak[1]
        self.live_at_peak = [b for b in self.bands
                             if b["first"] <= peak and (b["last"] is None or b["last"] > peak)]
        if not self.base_steps or self.base_steps[0][0] != (self.times[0] if events else 0.0):
            first = base_end + sum(size for _, size in freed_before)
            self.base_steps.insert(0, (self.times[0] if events else 0.0, float(first)))
        self.end_time = self.times[-1] if events else 0.0

    def active_steps(self) -> Tuple[List[float], List[float]]:
        """Active bytes as steps to draw: the level before the first event,
        then after each event."""
        return self._with_start(self.active, self.active_at_start)

    def reserved_steps(self) -> Tuple[List[float], List[float]]:
        """Reserved bytes as steps to draw, as :meth:`active_steps`."""
        return self._with_start(self.reserved, self.reserved_at_start)

    def _with_start(self, after_each: List[float], at_start: float) -> Tuple[List[float], List[float]]:
        if not self.times:
            return [], []
        return [self.times[0]] + self.times, [at_start] + after_each

    @property
    def tracked_bands(self) -> List[Dict[str, Any]]:
        """The allocations with a band of their own, in the order they were made."""
        return [b for b in self.bands if b["tracked"]]

    def site_totals(self) -> List[Tuple[str, int]]:
        """Allocation sites by the bytes they hold at the peak (then by total)."""
        at_peak: Dict[str, int] = {}
        for band in self.live_at_peak:
            at_peak[band["site"]] = at_peak.get(band["site"], 0) + band["size"]
        overall: Dict[str, int] = {}
        for band in self.bands:
            overall[band["site"]] = overall.get(band["site"], 0) + band["size"]
        return sorted(overall.items(), key=lambda kv: (at_peak.get(kv[0], 0), kv[1]), reverse=True)


def _bands_within_budget(events: List[Dict[str, Any]], times: List[float], tracked: int) -> set:
    """The event indices of the allocations that get a band of their own: at
    most ``tracked``, the largest first (the longest lived among equals),
    skipping any whose steps would pass what STEP_BUDGET has left.

    A band's steps are 1 + the frees below it during its life: the frees of
    allocations made before it, and of memory from before the recording. In
    one pass, a Fenwick tree over the order in which allocations were made
    counts the frees so far below each order (position 0: memory from before
    the recording, below everything); the difference between a band's end
    and its start is its count."""
    n_allocs = sum(1 for e in events if e["action"] == "alloc")
    tree = [0] * (n_allocs + 2)

    def add(position: int) -> None:          # one free at ``position`` (0-based)
        position += 1
        while position < len(tree):
            tree[position] += 1
            position += position & -position

    def below(position: int) -> int:          # frees at positions < ``position``
        total = 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total

    order_of: Dict[int, int] = {}             # live address -> (order + 1), 0 kept for "before"
    started: Dict[int, Tuple[int, int]] = {}  # order -> (event index, frees below it at its start)
    steps: Dict[int, int] = {}                # event index of the alloc -> steps
    lifetime: Dict[int, float] = {}
    end_time = times[-1] if times else 0.0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            order = len(started) + 1
            order_of[e["addr"]] = order
            started[order] = (i, below(order))
        elif e["action"] == "free_completed":
            order = order_of.pop(e["addr"], 0)
            if order:
                first, at_start = started[order]
                steps[first] = 1 + below(order) - at_start
                lifetime[first] = times[i] - times[first]
            add(order)
    for order in order_of.values():           # alive at the end
        first, at_start = started[order]
        steps[first] = 1 + below(order) - at_start
        lifetime[first] = end_time - times[first]
    chosen = set()
    left = STEP_BUDGET
    for i in sorted(steps, key=lambda i: (-events[i]["size"], -lifetime[i], i)):
        if len(chosen) == tracked:
            break
        if steps[i] <= left:
            chosen.add(i)
            left -= steps[i]
    return chosen


def _move_down(tracked_live: List[Dict[str, Any]], first: int, size: int, t: float) -> None:
    """The tracked bands from position ``first`` up move ``size`` bytes down at ``t``."""
    for band in tracked_live[first:]:
        band["bottom"] -= size
        band["steps"].append((t, band["bottom"]))


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


def downsample(x: Sequence[float], y: Sequence[float],
               slices: int = TIME_SLICES) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """The points of a step line ``(x, y)`` (``x`` sorted) worth drawing: in
    each of ``slices`` equal slices of ``x``, the first, lowest, highest and
    last point, in order. A line of at most ``4 * slices`` points comes back whole."""
    xs, ys = numpy.asarray(x, dtype=float), numpy.asarray(y, dtype=float)
    if len(xs) <= 4 * slices:
        return xs, ys
    span = xs[-1] - xs[0]
    slice_of = numpy.minimum(((xs - xs[0]) / (span or 1.0) * slices).astype(numpy.int64), slices - 1)
    starts = numpy.flatnonzero(numpy.r_[True, slice_of[1:] != slice_of[:-1]])
    ends = numpy.r_[starts[1:], len(xs)] - 1
    keep = [starts, ends]
    for reduce in (numpy.minimum, numpy.maximum):
        extreme = reduce.reduceat(ys, starts)
        # the first point of each slice that reaches the slice's extreme
        hits = numpy.flatnonzero(ys == numpy.repeat(extreme, ends - starts + 1))
        keep.append(hits[numpy.r_[True, slice_of[hits][1:] != slice_of[hits][:-1]]])
    kept = numpy.unique(numpy.concatenate(keep))
    return xs[kept], ys[kept]


def drawn_steps(bands: List[Dict[str, Any]], corners: int) -> List[List[Tuple[float, float]]]:
    """The steps of each band's bottom as drawn: about ``corners`` corners of
    outline in all (4 a step), shared evenly among the bands that want more
    than their share, and at most ``4 * BAND_TIME_SLICES`` steps a band. A
    band moves at every free below it: a few thousand frees below a few
    hundred bands would be millions of corners, all in a few pixels."""
    wanted = [len(band["steps"]) for band in bands]
    kept = [0] * len(bands)
    left = corners // 4
    for done, k in enumerate(sorted(range(len(bands)), key=wanted.__getitem__)):
        kept[k] = min(wanted[k], 4 * BAND_TIME_SLICES, max(left // (len(bands) - done), 4))
        left -= kept[k]
    drawn = []
    for band, keep in zip(bands, kept):
        steps = band["steps"]
        if len(steps) > keep:
            xs, ys = downsample([t for t, _ in steps], [y for _, y in steps], max(keep // 4, 1))
            steps = list(zip(xs.tolist(), ys.tolist()))
        drawn.append(steps)
    return drawn
