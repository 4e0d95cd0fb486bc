"""What the HTML memory report shows, derived from a snapshot (drawing is
:mod:`unimem._observe.report`'s).

The timeline itself is :class:`unimem._observe.timeline.Timeline`'s, as for
``plot``; here it is cut down to what a screen shows (a trace of 100,000
entries becomes a few thousand points per line and a few hundred bands), and
the snapshot's segments are summed by stream and by pool. Nothing here opens
a file a snapshot names: a place is its recorded file, line and function.
"""
from __future__ import annotations

import heapq
import html
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple


from .._core import format_size
from .._runtime.pools import named_pools
from .timeline import (GROWS, MAX_SEGMENT_BLOCKS, MiB, NO_FRAMES, SHRINKS, Frame, Timeline, allocation_site,
                       band_polygon, drawn_steps, segment_rows, shorten)

MAX_BANDS = 200           # the largest allocations drawn as their own bands; the rest are "other"
# Corners of the bands' outlines, all bands together (see drawn_steps): 2,400
# frees below 200 bands in a 0.1 MB pickle made 10 MB of outlines.
BAND_POINTS = 40_000
MAX_SEGMENT_ROWS = 48
LARGEST_LIVE = 20
# Rows of the per-stream and per-pool tables; the others are summed in one.
MAX_TABLE_ROWS = 32
STACK_FRAMES = 16         # frames shown in a hover; deeper stacks say how many more
# Characters of stacks the hovers of one report carry: this many, and as
# many again as its snapshot has bytes pickled. Each hover repeats its stack,
# and a snapshot may share one list of frames (a pickle refers to it again
# in two bytes) among all its blocks: 12,000 blocks of one 16-frame stack
# made a 61 MB page of a 0.38 MB pickle. Past it, a hover says so.
STACK_TEXT_FLOOR = 256 << 10
STACK_LEFT_OUT = "(stack left out, as the header says)"
ALLOCATED, PENDING_FREE, FREE = "active_allocated", "active_pending_free", "inactive"
UNDRAWN = "undrawn"       # the blocks of a segment past MAX_SEGMENT_BLOCKS, one bar
UNDRAWN_STATES = 4        # the states an undrawn bar names; the others it sums


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


def pickled_size(snapshot: Any) -> int:
    """The bytes of ``snapshot`` pickled, each object shared within it
    counted once (as a file shares it): what the report's size is held to.
    0 for a hand-made snapshot that does not pickle."""
    try:
        return len(pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL))
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
        return 0


class StackTexts:
    """The stacks of a report's hovers (:func:`stack_text`), within
    ``budget`` characters in all.

    Each list of frames is written out once, however many blocks share it
    (the work); every hover that shows it counts its length against the
    budget (the page); past the budget a hover shows :data:`STACK_LEFT_OUT`.
    Ask for the most telling stacks first."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.left_out = 0
        self._made: Dict[int, Tuple[List[Frame], str]] = {}    # id -> (the list, kept alive; its text)

    def __call__(self, frames: Optional[List[Frame]]) -> str:
        frames = frames or []
        made = self._made.get(id(frames))
        if made is None or made[0] is not frames:
            made = self._made[id(frames)] = (frames, stack_text(frames))
        text = made[1]
        if len(text) > max(self.left, len(NO_FRAMES)):
            self.left_out += 1
            return STACK_LEFT_OUT
        self.left -= len(text)
        return text


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
    for k, steps in zip(chosen, drawn_steps([timeline.bands[k] for k in chosen], BAND_POINTS)):
        band = timeline.bands[k]
        outline = band_polygon(band, timeline.end_time, steps)
        end = band["end"] if band["end"] is not None else timeline.end_time
        middle = (band["start"] + end) / 2
        bottom = next((y for t, y in reversed(steps) if t <= middle), steps[0][1] if steps else 0.0)
        # to the microsecond and the byte: all a screen shows, in half the characters
        bands.append(Band(band["size"], band["site"], band["frames"], band["start"], band["end"],
                          [round(x, 6) for x, _ in outline], [round(y, 6) for _, y in outline],
                          (middle, (bottom + band["size"] / 2) / MiB)))
    return bands


@dataclass
class SegmentMap:
    """The segments at the end of the trace: one row each, its blocks by state."""
    rows: List[str] = field(default_factory=list)            # top to bottom
    # state -> parallel lists: row (its number), offset (MiB), size (MiB), hover text, site
    blocks: Dict[str, Dict[str, list]] = field(default_factory=dict)
    hidden_segments: int = 0
    undrawn_blocks: int = 0    # blocks summed in their segment's last bar (past MAX_SEGMENT_BLOCKS)


def segment_map(segments: List[Dict[str, Any]], stacks: Optional[StackTexts] = None) -> SegmentMap:
    """The largest segments (at most ``MAX_SEGMENT_ROWS``), by address, each
    block at its offset: ``MAX_SEGMENT_BLOCKS`` blocks in all (the largest
    segments' first), the rest of each segment one bar. ``stacks``: what
    writes the hovers' stacks (the largest blocks' first)."""
    stacks = stacks or StackTexts(STACK_TEXT_FLOOR)
    rows = segment_rows(segments, MAX_SEGMENT_ROWS)
    out = SegmentMap(hidden_segments=len(segments) - len(rows))
    out.blocks = {state: {"row": [], "offset": [], "size": [], "text": [], "site": []}
                  for state in (ALLOCATED, PENDING_FREE, FREE, UNDRAWN)}
    placed: List[Tuple[int, int, Dict[str, Any]]] = []       # (row, offset, block) of those drawn one by one
    summaries: Dict[Tuple[int, int], Tuple[List[Dict[str, Any]], int, int, str]] = {}
    for number, (segment, drawn) in enumerate(rows):
        # a row is an axis label, where Plotly renders tags (links too): escaped
        segment_type = html.escape(shorten(str(segment["segment_type"])), quote=False)
        out.rows.append(f"{number + 1}. {segment_type} {format_size(segment['total_size'])} "
                        f"(stream {segment.get('stream', 0)})")
        offset = 0
        for block in segment["blocks"][:drawn]:
            placed.append((number, offset, block))
            offset += block["size"]
        _add_undrawn(out, number, offset, segment["blocks"], drawn, summaries)
    in_use = sorted((k for k, (_, _, block) in enumerate(placed) if block["state"] != FREE),
                    key=lambda k: -placed[k][2]["size"])
    stack_of = {k: stacks(placed[k][2].get("frames")) for k in in_use}        # the largest first
    sites: Dict[int, str] = {}
    for k, (number, offset, block) in enumerate(placed):
        state = block["state"] if block["state"] in (ALLOCATED, PENDING_FREE, FREE) else ALLOCATED
        frames = block.get("frames") or []
        where = f"{format_size(block['size'])} {state.replace('_', ' ')} at offset {format_size(offset)}"
        drawn_state = out.blocks[state]
        drawn_state["row"].append(number)
        drawn_state["offset"].append(offset / MiB)
        drawn_state["size"].append(block["size"] / MiB)
        drawn_state["text"].append(where if state == FREE else f"{where}<br>{stack_of[k]}")
        if state != FREE and id(frames) not in sites:
            sites[id(frames)] = site_of(frames)
        drawn_state["site"].append(sites[id(frames)] if state != FREE else "")
    return out


def _add_undrawn(out: SegmentMap, row: int, offset: int, blocks: List[Dict[str, Any]], drawn: int,
                 summaries: Dict[Tuple[int, int], Tuple[List[Dict[str, Any]], int, int, str]]) -> None:
    """The blocks of a segment past its first ``drawn`` (at ``offset``), as
    one bar that sums them up. ``summaries``: what rows that share one list
    of blocks share, summed once (the list kept, so that its id names it)."""
    key = (id(blocks), drawn)
    if key not in summaries:
        rest = blocks[drawn:]
        size, parts = _sum_undrawn(rest)
        summaries[key] = (blocks, len(rest), size,
                          f"{len(rest):,} more blocks from offset {format_size(offset)}, not drawn one by one "
                          f"(the map draws {MAX_SEGMENT_BLOCKS:,}): {parts}")
    _, count, size, text = summaries[key]
    if not count:
        return
    bar = out.blocks[UNDRAWN]
    bar["row"].append(row)
    bar["offset"].append(offset / MiB)
    bar["size"].append(size / MiB)
    bar["text"].append(text)
    bar["site"].append("")
    out.undrawn_blocks += count


def _sum_undrawn(rest: List[Dict[str, Any]]) -> Tuple[int, str]:
    """The bytes of ``rest`` and what its bar says: bytes and blocks per
    state, the UNDRAWN_STATES states of most bytes by name, the others
    summed (a snapshot's states are any strings: 20,000 blocks of distinct
    states in one list that 48 segments shared made a 124 MB page of a
    2.5 MB pickle)."""
    by_state: Dict[str, List[int]] = {}
    for block in rest:
        counted = by_state.setdefault(block["state"], [0, 0])
        counted[0] += 1
        counted[1] += block["size"]
    size = sum(total for _, total in by_state.values())
    named = heapq.nsmallest(UNDRAWN_STATES, by_state.items(), key=lambda item: (-item[1][1], str(item[0])))
    parts = [f"{format_size(total)} {html.escape(shorten(str(state)).replace('_', ' '))} in {count:,}"
             for state, (count, total) in sorted(named, key=lambda item: str(item[0]))]
    others = len(by_state) - len(named)
    if others:
        other_blocks = len(rest) - sum(count for _, (count, _) in named)
        other_bytes = size - sum(total for _, (_, total) in named)
        parts.append(f"{format_size(other_bytes)} in {other_blocks:,} of {others:,} other states")
    return size, ", ".join(parts)


def largest_live(segments: List[Dict[str, Any]], count: int = LARGEST_LIVE) -> List[Dict[str, Any]]:
    """The ``count`` largest blocks still allocated at the end of the trace,
    largest first: ``size``, ``site``, ``frames``, ``stream``, ``address``."""
    live = ((block["size"], segment, block) for segment in segments for block in segment["blocks"]
            if block["state"] == ALLOCATED)
    return [dict(size=size, site=site_of(block.get("frames") or []), frames=block.get("frames") or [],
                 stream=segment.get("stream", 0), address=block.get("address"))
            for size, segment, block in heapq.nlargest(count, live, key=lambda found: found[0])]


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
    return _at_most_rows(_sum_segments(dict(sorted(groups.items()))), "pools")


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
    return _at_most_rows(rows, "streams")


def totals_by_client(segments: List[Dict[str, Any]], events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per client (the framework a block was handed out to: unimem's
    snapshots say it, PyTorch's do not): the bytes of its blocks at the end,
    allocated and pending free, how many it holds, and over the trace how
    many allocations it made and their bytes; [] when nothing in the
    snapshot names a client."""
    at_end: Dict[str, List[int]] = {}
    for segment in segments:
        for block in segment["blocks"]:
            client = block.get("client")
            if client is None or block["state"] == FREE:
                continue
            counted = at_end.setdefault(str(client), [0, 0, 0])
            if block["state"] == PENDING_FREE:
                counted[1] += block["size"]
            else:
                counted[0] += block["size"]
                counted[2] += 1
    made: Dict[str, List[int]] = {}
    for e in events:
        if e["action"] == "alloc" and e.get("client") is not None:
            counted = made.setdefault(str(e["client"]), [0, 0])
            counted[0] += 1
            counted[1] += e["size"]
    rows = [{"key": client, "allocated": at_end.get(client, [0, 0, 0])[0],
             "pending free": at_end.get(client, [0, 0, 0])[1],
             "live allocations": at_end.get(client, [0, 0, 0])[2],
             "allocations in the trace": made.get(client, [0, 0])[0],
             "bytes allocated in the trace": made.get(client, [0, 0])[1]}
            for client in sorted(set(at_end) | set(made))]
    rows.sort(key=lambda row: (-row["allocated"], -row["bytes allocated in the trace"], row["key"]))
    # a snapshot's clients are any strings: as many rows as streams at most
    return _at_most_rows(rows, "clients", lambda row: (row["allocated"], row["bytes allocated in the trace"]))


def _reserved_weight(row: Dict[str, Any]) -> Tuple[int, int]:
    return row["reserved"], row.get("bytes allocated in the trace", 0)


def _at_most_rows(rows: List[Dict[str, Any]], what: str,
                  weight: Callable[[Dict[str, Any]], Any] = _reserved_weight) -> List[Dict[str, Any]]:
    """``rows``, or where there are more than MAX_TABLE_ROWS, those of the
    most memory (by ``weight``: reserved, then allocated in the trace) in
    their order and one row that sums the others (each of a snapshot's
    entries may name a stream of its own)."""
    if len(rows) <= MAX_TABLE_ROWS:
        return rows
    kept = set(sorted(range(len(rows)), key=lambda k: weight(rows[k]), reverse=True)[:MAX_TABLE_ROWS - 1])
    others = [row for k, row in enumerate(rows) if k not in kept]
    summed: Dict[str, Any] = {"key": f"{len(others):,} other {what}"}
    for column in rows[0]:
        if column != "key":
            summed[column] = (max if column == "largest free block" else sum)(row[column] for row in others)
    return [row for k, row in enumerate(rows) if k in kept] + [summed]


def device_name(snapshot: Dict[str, Any]) -> str:
    """How the summary table names the snapshot's memory ("XPU", "CPU", "host"; "GPU" for PyTorch's)."""
    pool = snapshot.get("allocator_settings", {}).get("pool")
    if pool is None:                 # PyTorch's snapshots are of CUDA memory
        return "GPU"
    return next((p.display_name for p in named_pools() if p.name == pool), shorten(str(pool)))


# trace action -> (statistic, +1/-1 to its count and bytes). A trace entry
# has the size the allocation asked for (PyTorch's orig_size and
# requested_size), not its block's: it tells requested memory, not
# allocated or active memory.
_CHANGES = {"alloc": (("allocation", "requested_bytes", 1), ("active", None, 1)),
            "free_requested": (("allocation", "requested_bytes", -1),),
            "free_completed": (("active", None, -1),)}
# The figures a trace tells the peaks and totals of.
_TRACED = ("allocation", "active", "requested_bytes", "reserved_bytes", "segment")


def snapshot_memory_stats(snapshot: Dict[str, Any], device: int) -> Dict[str, int]:
    """``memory_stats``-shaped figures of one device, from a snapshot alone
    (which holds no statistics), with only the keys the snapshot tells:

    * ``current`` of every figure, from its segments (requested memory where
      every live block records its ``requested_size``);
    * with a trace, ``peak``, ``allocated`` and ``freed`` over the trace of
      the counts (allocations, active allocations, segments), of requested
      memory and of reserved memory, and ``num_ooms``. A trace entry has the
      size asked for, not the block's, so allocated, active and
      non-releasable memory have only ``current``;
    * the oversize figures, all 0, where the allocator splits blocks of any
      size (``max_split_size`` -1 in ``allocator_settings``).

    A trace that began after the pool's first allocation (or lost its first
    entries to ``max_entries``) tells the peaks and totals of its own span."""
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    blocks = [b for s in segments for b in s["blocks"]]
    allocated = [b for b in blocks if b["state"] == ALLOCATED]
    split = [b for s in segments if len(s["blocks"]) > 1 and not s.get("is_expandable")
             for b in s["blocks"] if b["state"] == FREE]
    current = {"allocated_bytes": sum(b["size"] for b in allocated),
               "allocation": len(allocated),
               "active_bytes": sum(b["size"] for b in blocks if b["state"] != FREE),
               "active": sum(1 for b in blocks if b["state"] != FREE),
               "reserved_bytes": sum(s["total_size"] for s in segments),
               "segment": len(segments),
               "inactive_split_bytes": sum(b["size"] for b in split),
               "inactive_split": len(split)}
    if all("requested_size" in b for b in allocated):
        current["requested_bytes"] = sum(b["requested_size"] for b in allocated)
    stats = {f"{key}.all.current": now for key, now in current.items()}
    if snapshot.get("allocator_settings", {}).get("max_split_size") == -1:
        stats.update({f"{key}.{figure}": 0 for key in ("oversize_allocations", "oversize_segments")
                      for figure in ("current", "peak", "allocated", "freed")})
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    if not events:
        return stats
    running = dict.fromkeys(_TRACED, 0)
    highest = dict.fromkeys(_TRACED, 0)
    made = dict.fromkeys(_TRACED, 0)
    gone = dict.fromkeys(_TRACED, 0)
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
            if bytes_key is not None:
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
    stats["num_ooms"] = ooms
    for key in _TRACED:
        now = current.get(key)
        if now is None:                    # no current value to count the trace from
            continue
        at_start = now - running[key]
        stats[f"{key}.all.peak"] = max(now, at_start + highest[key])
        stats[f"{key}.all.allocated"] = made[key]
        stats[f"{key}.all.freed"] = gone[key]
    return stats
