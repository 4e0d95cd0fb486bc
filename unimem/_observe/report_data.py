"""What the HTML memory report shows, derived from a snapshot (drawing is
:mod:`unimem._observe.report`'s).

The timeline itself is :class:`unimem._observe.timeline.Timeline`'s, as for
``plot``; here it is cut down to what a screen shows (a trace of 100,000
entries becomes a few thousand points per line and a few hundred bands), and
the snapshot's segments are summed by stream and by pool. Nothing here opens
a file a snapshot names: a place is its recorded file, line and function.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy

from .._core import format_size
from .._runtime.pools import named_pools
from .timeline import GROWS, MiB, NO_FRAMES, SHRINKS, Frame, Timeline, allocation_site, band_polygon, shorten

# A screen is a few thousand pixels wide: a line keeps at most four points
# (first, lowest, highest, last) in each of this many slices of time, so that
# every peak and trough stays where it was.
TIME_SLICES = 1000
BAND_TIME_SLICES = 300
MAX_BANDS = 200           # the largest allocations drawn as their own bands; the rest are "other"
MAX_SEGMENT_ROWS = 48
MAX_SEGMENT_BLOCKS = 5000
LARGEST_LIVE = 20
STACK_FRAMES = 16         # frames shown in a hover; deeper stacks say how many more
ALLOCATED, PENDING_FREE, FREE = "active_allocated", "active_pending_free", "inactive"


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


def stack_text(frames: List[Frame], limit: int = STACK_FRAMES) -> str:
    """A recorded stack as hover text (HTML-escaped, one frame a line, innermost first)."""
    if not frames:
        return NO_FRAMES
    lines = [html.escape(f"{shorten(str(f.get('name', '?')))} "
                         f"({shorten(str(f.get('filename', '?')))}:{f.get('line', '?')})")
             for f in frames[:limit]]
    if len(frames) > limit:
        lines.append(f"... {len(frames) - limit} more frames")
    return "<br>".join(lines)


# Before Python 3.12 a comprehension runs in a frame of its own, which would
# name the place "<listcomp>"; the function it is in says more.
_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def site_of(frames: List[Frame]) -> str:
    """The report's name for where a block was allocated (no file is read),
    a comprehension named by the function around it."""
    frames = frames or []
    named = [f for k, f in enumerate(frames)
             if not (f.get("name") in _COMPREHENSIONS and k + 1 < len(frames)
                     and frames[k + 1].get("filename") == f.get("filename"))]
    return allocation_site(named)


@dataclass
class Band:
    """One allocation drawn as its own band of the timeline."""
    size: int
    site: str
    frames: List[Frame]
    start: float
    end: Optional[float]
    x: List[float]            # the outline, in seconds and MiB
    y: List[float]
    centre: Tuple[float, float]   # the middle of its lifetime, halfway up the band


def largest_bands(timeline: Timeline, count: int = MAX_BANDS) -> List[Band]:
    """The ``count`` largest allocations of the trace (the longest lived
    first among equals), in the order they were made, each with its outline
    at its place in the stack (its bottom cut down to what a screen shows)."""
    order = sorted((k for k, band in enumerate(timeline.bands) if band["tracked"]), key=lambda k: (
        -timeline.bands[k]["size"],
        -((timeline.bands[k]["end"] if timeline.bands[k]["end"] is not None else timeline.end_time)
          - timeline.bands[k]["start"]), k))
    chosen = sorted(order[:count])
    bands = []
    for k in chosen:
        band = timeline.bands[k]
        steps = band["steps"]
        if len(steps) > 4 * BAND_TIME_SLICES:
            xs, ys = downsample([t for t, _ in steps], [y for _, y in steps], BAND_TIME_SLICES)
            steps = list(zip(xs.tolist(), ys.tolist()))
        outline = band_polygon(band, timeline.end_time, steps)
        end = band["end"] if band["end"] is not None else timeline.end_time
        middle = (band["start"] + end) / 2
        bottom = next((y for t, y in reversed(steps) if t <= middle), steps[0][1] if steps else 0.0)
        bands.append(Band(band["size"], band["site"], band["frames"], band["start"], band["end"],
                          [x for x, _ in outline], [y for _, y in outline],
                          (middle, (bottom + band["size"] / 2) / MiB)))
    return bands


@dataclass
class SegmentMap:
    """The segments at the end of the trace: one row each, its blocks by state."""
    rows: List[str] = field(default_factory=list)            # top to bottom
    # state -> parallel lists: row, offset (MiB), size (MiB), hover text, site
    blocks: Dict[str, Dict[str, list]] = field(default_factory=dict)
    hidden_segments: int = 0


def segment_map(segments: List[Dict[str, Any]]) -> SegmentMap:
    """The largest segments (at most ``MAX_SEGMENT_ROWS``, and ``MAX_SEGMENT_BLOCKS``
    blocks), by address, each block at its offset."""
    shown = sorted(segments, key=lambda s: s["total_size"], reverse=True)[:MAX_SEGMENT_ROWS]
    blocks_so_far = 0
    for k, segment in enumerate(shown):
        blocks_so_far += len(segment["blocks"])
        if blocks_so_far > MAX_SEGMENT_BLOCKS and k:
            shown = shown[:k]
            break
    shown.sort(key=lambda s: s["address"])
    out = SegmentMap(hidden_segments=len(segments) - len(shown))
    out.blocks = {state: {"row": [], "offset": [], "size": [], "text": [], "site": []}
                  for state in (ALLOCATED, PENDING_FREE, FREE)}
    for number, segment in enumerate(shown):
        # a row is an axis label, where Plotly renders tags (links too): escaped
        segment_type = html.escape(shorten(str(segment["segment_type"])), quote=False)
        row = (f"{number + 1}. {segment_type} {format_size(segment['total_size'])} "
               f"(stream {segment.get('stream', 0)})")
        out.rows.append(row)
        offset = 0
        for block in segment["blocks"]:
            state = block["state"] if block["state"] in out.blocks else ALLOCATED
            frames = block.get("frames") or []
            where = f"{format_size(block['size'])} {state.replace('_', ' ')} at offset {format_size(offset)}"
            drawn = out.blocks[state]
            drawn["row"].append(row)
            drawn["offset"].append(offset / MiB)
            drawn["size"].append(block["size"] / MiB)
            drawn["text"].append(where if state == FREE else f"{where}<br>{stack_text(frames)}")
            drawn["site"].append(site_of(frames) if state != FREE else "")
            offset += block["size"]
    return out


def largest_live(segments: List[Dict[str, Any]], count: int = LARGEST_LIVE) -> List[Dict[str, Any]]:
    """The ``count`` largest blocks still allocated at the end of the trace,
    largest first: ``size``, ``site``, ``frames``, ``stream``, ``address``."""
    live = [dict(size=block["size"], site=site_of(block.get("frames") or []), frames=block.get("frames") or [],
                 stream=segment.get("stream", 0), address=block.get("address"))
            for segment in segments for block in segment["blocks"] if block["state"] == ALLOCATED]
    live.sort(key=lambda b: b["size"], reverse=True)
    return live[:count]


def _pool_name(segment: Dict[str, Any]) -> str:
    pool_id = tuple(segment.get("segment_pool_id") or (0, 0))
    kind = shorten(str(segment["segment_type"]))
    name = f"{kind} pool"
    if pool_id != (0, 0):
        name = shorten(f"private pool {pool_id} ({kind})")
    return name + (" (expandable)" if segment.get("is_expandable") else "")


def _sum_segments(groups: Dict[Any, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    rows = []
    for key, segments in groups.items():
        blocks = [b for s in segments for b in s["blocks"]]
        free = [b["size"] for b in blocks if b["state"] == FREE]
        rows.append({"key": key, "segments": len(segments),
                     "reserved": sum(s["total_size"] for s in segments),
                     "allocated": sum(b["size"] for b in blocks if b["state"] == ALLOCATED),
                     "pending free": sum(b["size"] for b in blocks if b["state"] == PENDING_FREE),
                     "free": sum(free), "largest free block": max(free, default=0),
                     "live allocations": sum(1 for b in blocks if b["state"] == ALLOCATED)})
    return rows


def totals_by_pool(segments: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per pool (large, small, private pools, expandable): segments, reserved,
    allocated, pending free and free bytes, the largest free block."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for segment in segments:
        groups.setdefault(_pool_name(segment), []).append(segment)
    return _sum_segments(dict(sorted(groups.items())))


def totals_by_stream(segments: List[Dict[str, Any]], events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per stream: the segments' totals at the end and, over the trace, how
    many allocations were made on it and their bytes."""
    groups: Dict[int, List[Dict[str, Any]]] = {}
    for segment in segments:
        groups.setdefault(segment.get("stream", 0), []).append(segment)
    made: Dict[int, List[int]] = {}
    for e in events:
        if e["action"] == "alloc":
            counted = made.setdefault(e.get("stream", 0), [0, 0])
            counted[0] += 1
            counted[1] += e["size"]
    for stream in made:
        groups.setdefault(stream, [])
    rows = _sum_segments(dict(sorted(groups.items(), key=lambda kv: str(kv[0]))))
    for row in rows:
        row["allocations in the trace"], row["bytes allocated in the trace"] = made.get(row["key"], [0, 0])
    return rows


def device_name(snapshot: Dict[str, Any]) -> str:
    """How the summary table names the snapshot's memory ("XPU", "CPU", "host"; "GPU" for PyTorch's)."""
    pool = snapshot.get("allocator_settings", {}).get("pool")
    if pool is None:                 # PyTorch's snapshots are of CUDA memory
        return "GPU"
    return next((p.display_name for p in named_pools() if p.name == pool), str(pool))


# trace action -> (statistic, +1/-1 to its count and bytes)
_CHANGES = {"alloc": (("allocation", "allocated_bytes", 1), ("active", "active_bytes", 1)),
            "free_requested": (("allocation", "allocated_bytes", -1),),
            "free_completed": (("active", "active_bytes", -1),)}


def snapshot_memory_stats(snapshot: Dict[str, Any], device: int) -> Dict[str, int]:
    """``memory_stats``-shaped figures of one device, from a snapshot alone
    (which holds no statistics): "current" from its segments; "peak",
    "allocated" and "freed" over the recorded trace (the peak at least the
    current value; requested and non-releasable memory only current). The
    trace gives each allocation the size it asked for, not its block's, so
    the counts, reserved bytes and OOMs are exact and allocated and active
    bytes over time are what was asked for."""
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    blocks = [b for s in segments for b in s["blocks"]]
    split = [b for s in segments if len(s["blocks"]) > 1 and not s.get("is_expandable")
             for b in s["blocks"] if b["state"] == FREE]
    current = {"allocated_bytes": sum(b["size"] for b in blocks if b["state"] == ALLOCATED),
               "allocation": sum(1 for b in blocks if b["state"] == ALLOCATED),
               "active_bytes": sum(b["size"] for b in blocks if b["state"] != FREE),
               "active": sum(1 for b in blocks if b["state"] != FREE),
               "requested_bytes": sum(b.get("requested_size", b["size"]) for b in blocks if b["state"] == ALLOCATED),
               "reserved_bytes": sum(s["total_size"] for s in segments),
               "segment": len(segments),
               "inactive_split_bytes": sum(b["size"] for b in split),
               "inactive_split": len(split)}
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    running = dict.fromkeys(current, 0)
    highest = dict.fromkeys(current, 0)
    made = dict.fromkeys(current, 0)
    gone = dict.fromkeys(current, 0)
    ooms = 0

    def change(key: str, amount: int) -> None:
        running[key] += amount
        if amount > 0:
            made[key] += amount
            highest[key] = max(highest[key], running[key])
        else:
            gone[key] -= amount

    for e in events:
        action = e["action"]
        for count_key, bytes_key, sign in _CHANGES.get(action, ()):
            change(count_key, sign)
            change(bytes_key, sign * e["size"])
        if action in GROWS:
            change("reserved_bytes", e["size"])
            if action == "segment_alloc":
                change("segment", 1)
        elif action in SHRINKS:
            change("reserved_bytes", -e["size"])
            if action == "segment_free":
                change("segment", -1)
        elif action == "oom":
            ooms += 1
    stats = {"num_ooms": ooms}
    for key, now in current.items():
        at_start = now - running[key]
        stats[f"{key}.all.current"] = now
        stats[f"{key}.all.peak"] = max(now, at_start + highest[key])
        stats[f"{key}.all.allocated"] = made[key]
        stats[f"{key}.all.freed"] = gone[key]
    return stats
