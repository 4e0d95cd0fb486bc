"""Pictures of a snapshot: the active-memory timeline and the segment map.

``python -m unimem plot SNAPSHOT -o timeline.png`` draws, from a snapshot
with history (``_dump_snapshot``):

* top: active memory over time, each allocation a band stacked on those
  allocated before it and coloured by where it was allocated (the innermost
  Python frame of the user's code, not of an installed package, the standard
  library or unimem; the heaviest places are named in the legend), what was
  allocated before the recording began in grey at the bottom, reserved memory
  as a line, and every out-of-memory error marked;
* bottom: the segments at the moment of peak active memory, each a row, the
  live allocations in their segment's colour and the free space in grey.

Without history, the top panel says so and the segment map shows the
snapshot's own block states.

Files are read by :mod:`unimem._observe.snapshot_file` (no code the file
names ever runs).
"""
from __future__ import annotations

import bisect
import heapq
from typing import Any, Dict, List, Optional, Tuple

from .._core import format_size
from .timeline import (MAX_SEGMENT_BLOCKS, MiB, Timeline, allocation_site, band_polygon, drawn_steps, oom_marks,
                       pick_device, segment_rows, shorten)
# The loader lives in snapshot_file; these names stay importable from here for existing callers.
from .snapshot_file import SnapshotError, load_snapshot

__all__ = ["SnapshotError", "Timeline", "load_snapshot", "plot_snapshot"]

MAX_DRAWN = 2_000         # allocations drawn individually (fewer on a long trace); the rest are grey
BAND_CORNERS = 400_000    # corners of their outlines, all together (see drawn_steps)
MAX_SEGMENT_ROWS = 40
LEGEND_SITES = 8
FREE_COLOUR = "#e3e3e3"
BEFORE_COLOUR = "#a8a8a8"
OTHER_COLOUR = "#cfcfcf"     # active memory with no band of its own (as the report)
PENDING_COLOUR = "#ef8636"
UNDRAWN_COLOUR = "#9db7d5"   # the blocks of a segment not drawn one by one


def _site(frames: List[Dict[str, Any]], source_lines: bool = False) -> str:
    """Where an allocation was made: ``file:line function``, or with
    ``source_lines`` the source line for the function where the file is a
    readable regular file. A snapshot may come from anyone: without
    ``source_lines`` no path it names is opened."""
    return allocation_site(frames, read_source=source_lines)


def _literal(text: str) -> str:
    """``text`` shown as it is: matplotlib reads text between two ``$`` as
    TeX, and a snapshot's names (files, functions, pools) may hold any; a
    file name Python could not decode (a lone surrogate, "caf\\udce9.py")
    is drawn as its escape, and a long name cut to MAX_NAME characters."""
    return shorten(text).encode("utf-8", "backslashreplace").decode("utf-8").replace("$", r"\$")


def plot_snapshot(snapshot: Dict[str, Any], output: str, device: Optional[int] = None,
                  title: Optional[str] = None, source_lines: bool = False) -> str:
    """Draw ``snapshot`` (as :func:`load_snapshot` returns it) into ``output``
    (a PNG); returns the path. ``source_lines`` names allocation sites by
    their source line, read from the files the frames name (regular files
    only, the first MiB at most); without it no path in the snapshot is opened."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    device = pick_device(snapshot, device)
    tl = Timeline(snapshot, device, site=lambda frames: _site(frames, source_lines), tracked=MAX_DRAWN)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 9), gridspec_kw={"height_ratios": [3, 2]})
    pool = snapshot.get("allocator_settings", {}).get("pool", "device")
    fig.suptitle(title or f"unimem memory: {_literal(pool)} device {device}", fontsize=13)

    # --- colours by allocation site -----------------------------------------
    palette = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Set3"].colors
    sites = tl.site_totals()
    colour_of = {site: palette[k % len(palette)] for k, (site, _) in enumerate(sites)}

    # --- active memory timeline ---------------------------------------------
    handles: List[Any] = []
    if tl.has_history:
        end = tl.end_time if tl.end_time > 0 else 1.0
        base_x = [t for t, _ in tl.base_steps] + [end]
        base_y = [y / MiB for _, y in tl.base_steps]
        # All active memory in grey beneath: what has no band of its own shows
        active_times, active = tl.active_steps()
        top.fill_between(active_times + [end], [a / MiB for a in active] + [active[-1] / MiB], step="post",
                         color=OTHER_COLOUR, linewidth=0)
        if len(tl.tracked_bands) < len(tl.bands):
            handles.append(Patch(color=OTHER_COLOUR, label="smaller allocations (no band of their own)"))
        if any(base_y):
            top.fill_between(base_x[:-1] + [end], base_y + [base_y[-1]], step="post",
                             color=BEFORE_COLOUR, linewidth=0)
            handles.append(Patch(color=BEFORE_COLOUR, label="allocated before the recording"))
        drawn = tl.tracked_bands
        top.add_collection(PolyCollection([band_polygon(b, end, steps)
                                           for b, steps in zip(drawn, drawn_steps(drawn, BAND_CORNERS))],
                                          facecolors=[colour_of[b["site"]] for b in drawn],
                                          edgecolors="none"))
        reserved_times, reserved = tl.reserved_steps()
        top.step(reserved_times, [r / MiB for r in reserved], where="post", color="black",
                 linewidth=1.4)
        handles.append(plt.Line2D([], [], color="black", linewidth=1.4, label="reserved (segments)"))
        ymax = max(max(reserved, default=0), tl.peak[0]) / MiB * 1.15 or 1.0
        top.set_xlim(0, end)
        top.set_ylim(0, ymax)
        marked, oom_label = oom_marks(tl.ooms)
        for t, size in marked:
            top.axvline(t, color="red", linestyle="--", linewidth=1.5)
            top.annotate(f"out of memory: {format_size(size)} requested", (t, ymax * 0.97),
                         color="red", ha="right", va="top", fontsize=9)
        if marked:
            handles.append(plt.Line2D([], [], color="red", linestyle="--", label=oom_label))
        if tl.peak[1] >= 0:
            peak_t = tl.times[tl.peak[1]]
            top.axvline(peak_t, color="#444444", linestyle=":", linewidth=1)
            top.annotate(f"peak {format_size(tl.peak[0])}", (peak_t, tl.peak[0] / MiB),
                         xytext=(4, 4), textcoords="offset points", fontsize=8, color="#444444")
        for site, _ in sites[:LEGEND_SITES]:
            handles.append(Patch(color=colour_of[site], label=_literal(site)))
        if len(sites) > LEGEND_SITES:
            handles.append(Patch(color="white", label=f"... {len(sites) - LEGEND_SITES} more places"))
        top.legend(handles=handles, loc="upper left", fontsize=7.5, ncol=2, framealpha=0.9)
    else:
        top.text(0.5, 0.5, "no history in this snapshot\n(record it with _record_memory_history)",
                 ha="center", va="center", transform=top.transAxes)
    top.set_title("Active memory over time: each allocation a band, coloured by where it was "
                  "allocated; reserved memory as a line", fontsize=10)
    top.set_xlabel("time (s)" if tl.timed else "trace entry (the trace records no times)")
    top.set_ylabel("MiB")
    top.grid(alpha=0.3)

    # --- segment map -----------------------------------------------------------
    rows = segment_rows(tl.segments, MAX_SEGMENT_ROWS)
    segments = [seg for seg, _ in rows]
    if tl.has_history and tl.peak[1] >= 0:
        live = tl.live_at_peak
        peak_t = tl.times[tl.peak[1]]
        when = f"at peak active memory ({f't = {peak_t:.2f} s' if tl.timed else f'trace entry {int(peak_t)}'})"
    else:
        live = None
        when = "at the snapshot"
    spans_of, live_in_rows = _live_spans(rows, live, colour_of) if live is not None else (None, 0)
    undrawn = False
    for row, (seg, drawn) in enumerate(rows):
        mib = seg["total_size"] / MiB
        bottom.broken_barh([(0, mib)], (row - 0.4, 0.8), facecolors=FREE_COLOUR)
        if spans_of is not None:
            spans = spans_of[row]
        else:
            spans, offset = [], 0
            for b in seg["blocks"][:drawn]:
                if b["state"] != "inactive":
                    colour = "#3b75af" if b["state"] == "active_allocated" else PENDING_COLOUR
                    spans.append((offset / MiB, b["size"] / MiB, colour))
                offset += b["size"]
            rest = sum(b["size"] for b in seg["blocks"][drawn:])
            if rest:
                spans.append((offset / MiB, rest / MiB, UNDRAWN_COLOUR))
                undrawn = True
        if spans:
            bottom.broken_barh([(x, w) for x, w, _ in spans], (row - 0.4, 0.8),
                               facecolors=[c for _, _, c in spans], edgecolors="white", linewidth=0.4)
    bottom.set_yticks(range(len(segments)))
    bottom.set_yticklabels([f"{_literal(s['segment_type'])} {format_size(s['total_size'])}" for s in segments],
                           fontsize=7 if len(segments) > 16 else 8)
    bottom.invert_yaxis()
    hidden = len(tl.segments) - len(segments)
    bottom.set_title(f"{len(tl.segments)} segments {when}"
                     f"{f', the {len(segments)} largest shown' if hidden else ''}: "
                     f"allocations in their colours, free space in grey", fontsize=10)
    bottom.set_xlabel("offset in segment (MiB)")
    legend = [Patch(color=FREE_COLOUR, label="free")]
    if live is None:
        legend = [Patch(color="#3b75af", label="allocated"), Patch(color=PENDING_COLOUR, label="pending free")] + legend
        if undrawn:
            legend.append(Patch(color=UNDRAWN_COLOUR, label=f"blocks past the first {MAX_SEGMENT_BLOCKS:,} "
                                                            "(not drawn one by one)"))
    elif live_in_rows > MAX_SEGMENT_BLOCKS:
        legend.append(Patch(color="white", label=f"the {MAX_SEGMENT_BLOCKS:,} largest live allocations drawn"))
    bottom.legend(handles=legend, loc="lower right", fontsize=8)
    if not segments:
        bottom.text(0.5, 0.5, "no segments", ha="center", va="center", transform=bottom.transAxes)
    fig.tight_layout()
    fig.savefig(output, dpi=100, format="png")     # a PNG whatever the name ends with (x.foo too)
    plt.close(fig)
    return output


def _live_spans(rows: List[Tuple[Dict[str, Any], int]], live: List[Dict[str, Any]],
                colour_of: Dict[str, Any]) -> Tuple[List[List[Tuple[float, float, Any]]], int]:
    """Per row, the allocations live at the peak as ``(offset MiB, MiB,
    colour)`` spans, the largest :data:`MAX_SEGMENT_BLOCKS` in all (a trace
    may repeat one shared entry: 50,000 allocations at one address); and
    how many there were."""
    starts = sorted((seg["address"], seg["address"] + seg["total_size"], row) for row, (seg, _) in enumerate(rows))
    lows = [lo for lo, _, _ in starts]
    found = []
    for band in live:
        k = bisect.bisect_right(lows, band["addr"]) - 1
        if k >= 0 and band["addr"] < starts[k][1]:
            found.append((band["size"], starts[k][2], band))
    spans: List[List[Tuple[float, float, Any]]] = [[] for _ in rows]
    for size, row, band in heapq.nlargest(MAX_SEGMENT_BLOCKS, found, key=lambda f: f[0]):
        lo = rows[row][0]["address"]
        spans[row].append(((band["addr"] - lo) / MiB, size / MiB, colour_of.get(band["site"], "#3b75af")))
    return spans, len(found)
