"""A snapshot as one self-contained, interactive HTML page.

``python -m unimem view SNAPSHOT -o memory.html`` (and ``python -m unimem run
--report memory.html script.py``) writes one file that opens anywhere, offline
too: Plotly's JavaScript is inside it and the page asks no network for
anything. It shows

* the active-memory timeline, as PyTorch's "Active Memory Timeline": the
  largest allocations as bands stacked in the order they were made (hover:
  size, lifetime and the Python stack that made it), every other one in the
  grey beneath them, out-of-memory errors marked;
* reserved against active memory over the same time;
* the segments at the end of the trace, their blocks at their offsets, free
  space visible;
* the largest allocations still live, their stacks on hover;
* totals per stream, per pool and per client (the framework each block was
  handed out to: PyTorch, CuPy, dpnp, Numba, C, unimem), and the memory
  summary table.

A long trace is cut down to what a screen shows, and what each chart draws
is bounded (see :mod:`unimem._observe.report_data`): beyond plotly.js, the
file stays within a few times the size of the snapshot pickled, whatever it
shares by reference, and draws in a second or two.
"""
from __future__ import annotations

import html
import os
from typing import Any, Dict, List, Mapping, Optional

from .._core import format_size
from . import report_data as data
from .summary import OWN_CLIENT, memory_summary_table
from .timeline import MiB, Timeline, downsample, oom_marks, pick_device, shorten

FREE_COLOUR = "#e3e3e3"
OTHER_COLOUR = "#cfcfcf"
BEFORE_COLOUR = "#9a9a9a"
PENDING_COLOUR = "#ef8636"
RESERVED_COLOUR = "#222222"
OOM_COLOUR = "#d62728"
UNDRAWN_COLOUR = "#9db7d5"
# What "n/a" in the summary table made from a snapshot stands for.
UNKNOWN = "n/a"
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}
# Each figure's script counts itself drawn: window.unimemReport.drawnAt is
# when the last one was (milliseconds since the page began loading).
POST_SCRIPT = ("var r = window.unimemReport; r.drawn += 1;"
               " if (r.drawn === r.figures) { r.drawnAt = performance.now(); }")


def _palette() -> List[str]:
    import plotly.colors
    return list(plotly.colors.qualitative.D3) + list(plotly.colors.qualitative.Set3)


class _Colours:
    """One colour per allocation site, the heaviest sites first, across every chart."""

    def __init__(self, sites: List[str]) -> None:
        self.palette = _palette()
        self.of: Dict[str, str] = {}
        for site in sites:
            self(site)

    def __call__(self, site: str) -> str:
        if site not in self.of:
            self.of[site] = self.palette[len(self.of) % len(self.palette)]
        return self.of[site]


def timeline_figure(tl: Timeline, bands: List[data.Band], colour: _Colours,
                    stacks: Optional[data.StackTexts] = None) -> Any:
    """Active memory over time (bands of the largest allocations over the grey
    of all the others) above reserved and active memory, OOMs marked.
    ``stacks`` writes the hovers' stacks."""
    from plotly.subplots import make_subplots

    drawn = ("every allocation a band" if len(bands) == len(tl.bands) else
             f"the {len(bands)} largest allocations each a band, the {len(tl.bands) - len(bands):,} others in grey")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08,
                        subplot_titles=(f"Active memory timeline: {drawn} (hover for the stacks)",
                                        "Reserved (segments) and active memory"))
    if not tl.has_history:
        fig.add_annotation(text="no history in this snapshot (record it with _record_memory_history)",
                           xref="x domain", yref="y domain", x=0.5, y=0.5, showarrow=False)
    else:
        _add_active_memory(fig, tl)
        _add_bands(fig, bands, colour, stacks or data.StackTexts(data.STACK_TEXT_FLOOR), tl.timed)
        _add_ooms_and_peak(fig, tl)
    fig.update_xaxes(title_text="time since the first recorded event (s)" if tl.timed
                     else "trace entry (the trace records no times)", row=2, col=1)
    fig.update_yaxes(title_text="MiB", rangemode="tozero")
    fig.update_layout(height=720, hovermode="closest", legend={"font": {"size": 10}, "tracegroupgap": 2},
                      margin={"t": 50, "l": 60, "r": 20, "b": 50})
    return fig


def _step_line(x: Any, y: Any, name: str, meta: str, what: str, **style: Any) -> Any:
    import plotly.graph_objects as go
    return go.Scatter(x=x, y=y / MiB, mode="lines", line_shape="hv", name=name, meta=meta,
                      hovertemplate=f"%{{y:.2f}} MiB {what} at %{{x:.4f}} s<extra></extra>", **style)


def _add_active_memory(fig: Any, tl: Timeline) -> None:
    """All active memory in grey (on top), what was there before the recording
    darker beneath; below, reserved and active memory as lines."""
    active_times, active = downsample(*tl.active_steps())
    fig.add_trace(_step_line(active_times, active, "active memory (grey: the allocations not drawn as bands)",
                             "active", "active", fill="tozeroy", fillcolor=OTHER_COLOUR,
                             line={"color": "#8c8c8c", "width": 0.8}), row=1, col=1)
    before_times, before = downsample([t for t, _ in tl.base_steps] + [tl.end_time],
                                           [y for _, y in tl.base_steps] + [tl.base_steps[-1][1]])
    if before.any():
        fig.add_trace(_step_line(before_times, before, "allocated before the recording", "before",
                                 "allocated before the recording", fill="tozeroy", fillcolor=BEFORE_COLOUR,
                                 line={"width": 0}), row=1, col=1)
    reserved_times, reserved = downsample(*tl.reserved_steps())
    fig.add_trace(_step_line(reserved_times, reserved, "reserved", "reserved", "reserved",
                             line={"color": RESERVED_COLOUR, "width": 1.5}, legendrank=2000), row=2, col=1)
    fig.add_trace(_step_line(active_times, active, "active", "allocated", "active",
                             line={"color": "#1f77b4", "width": 1.2}, legendrank=2000), row=2, col=1)


def _add_bands(fig: Any, bands: List[data.Band], colour: _Colours, stacks: data.StackTexts, timed: bool) -> None:
    """The bands: one trace per place (a few hundred traces would take seconds
    to draw), its bands separate shapes. A hover on a band's middle tells that
    allocation's story, anywhere else on it its place's."""
    import plotly.graph_objects as go

    # each allocation's own stack before its place's (the budget of stacks may end between)
    hovers = [f"<b>{format_size(b.size)}</b> allocated at {_at(b.start, timed)}, "
              f"{f'freed at {_at(b.end, timed)}' if b.end is not None else 'still live at the end'}<br>"
              f"{stacks(b.frames)}" for b in bands]
    by_site: Dict[str, List[data.Band]] = {}
    for band in bands:
        by_site.setdefault(band.site, []).append(band)
    for site, group in by_site.items():
        largest = max(group, key=lambda b: b.size)
        fig.add_trace(go.Scatter(
            x=_joined([b.x for b in group]), y=_joined([b.y for b in group]), mode="lines", fill="toself",
            fillcolor=colour(site), line={"width": 0.5, "color": "white"}, hoveron="fills", hoverinfo="text",
            name=html.escape(site, quote=False), meta="bands",      # Plotly renders tags in names
            text=(f"<b>{html.escape(site)}</b>: {len(group)} of the allocations drawn, "
                  f"{format_size(sum(b.size for b in group))}; the stack of the largest "
                  f"({format_size(largest.size)}):<br>{stacks(largest.frames)}")), row=1, col=1)
    if bands:
        fig.add_trace(go.Scatter(
            x=[b.centre[0] for b in bands], y=[b.centre[1] for b in bands], mode="markers",
            marker={"size": 8, "opacity": 0}, showlegend=False, meta="allocations", name="allocation",
            customdata=[b.size for b in bands], hoverinfo="text", hovertext=hovers), row=1, col=1)


def _add_ooms_and_peak(fig: Any, tl: Timeline) -> None:
    import plotly.graph_objects as go

    marked, label = oom_marks(tl.ooms)
    # A line across both charts at each, set at once: fig.add_vline checks
    # every shape the figure has again (100 of them took 50 s).
    fig.update_layout(shapes=list(fig.layout.shapes) + [
        {"type": "line", "x0": t, "x1": t, "xref": xref, "y0": 0, "y1": 1, "yref": f"{yref} domain",
         "line": {"color": OOM_COLOUR, "dash": "dash", "width": 1.5}}
        for t, _ in marked for xref, yref in (("x", "y"), ("x2", "y2"))])
    if marked:
        top = max(tl.active_steps()[1], default=0) / MiB
        fig.add_trace(go.Scatter(
            x=[t for t, _ in marked], y=[top] * len(marked), mode="markers", name=label,
            marker={"symbol": "x", "size": 11, "color": OOM_COLOUR}, meta="oom", hoverinfo="text",
            hovertext=[f"out of memory: {format_size(size)} requested at {_at(t, tl.timed)}" for t, size in marked]),
            row=1, col=1)
    if tl.peak[1] >= 0:
        fig.add_annotation(x=tl.times[tl.peak[1]], y=tl.peak[0] / MiB, text=f"peak {format_size(int(tl.peak[0]))}",
                           showarrow=True, arrowhead=2, ax=30, ay=-25, row=1, col=1)


def _at(t: float, timed: bool) -> str:
    """When on the timeline: seconds, or the entry's number in a trace that records no times."""
    return f"{t:.4f} s" if timed else f"trace entry {int(t)}"


def _joined(shapes: List[List[float]]) -> List[Optional[float]]:
    """Several outlines as one line, a gap (None) between two."""
    out: List[Optional[float]] = []
    for shape in shapes:
        if out:
            out.append(None)
        out.extend(shape)
    return out


def segment_map_figure(segments: data.SegmentMap, colour: _Colours) -> Any:
    """The segments at the end of the trace, each a row, blocks at their offsets."""
    import numpy
    import plotly.graph_objects as go

    fig = go.Figure()
    looks = {data.ALLOCATED: ("allocated", None), data.PENDING_FREE: ("pending free (a stream still uses it)",
                                                                      PENDING_COLOUR),
             data.FREE: ("free", FREE_COLOUR),
             data.UNDRAWN: (f"blocks past the first {data.MAX_SEGMENT_BLOCKS:,} (not drawn one by one)",
                            UNDRAWN_COLOUR)}
    for state, (name, fixed) in looks.items():
        blocks = segments.blocks[state]
        if not blocks["row"]:
            continue
        colours = fixed or [colour(site) for site in blocks["site"]]
        # Rows by number (their names once, as the axis' labels) and numbers
        # as arrays (written in binary): a block costs the page a few bytes
        # besides its hover.
        fig.add_trace(go.Bar(orientation="h", y=numpy.array(blocks["row"], dtype=numpy.int32),
                             x=numpy.array(blocks["size"]), base=numpy.array(blocks["offset"]), name=name,
                             marker={"color": colours, "line": {"color": "white", "width": 0.5}},
                             hovertext=blocks["text"], hoverinfo="text", meta=f"segment {state}"))
    hidden = f" (the {len(segments.rows)} largest shown)" if segments.hidden_segments else ""
    fig.update_layout(barmode="overlay", height=140 + 24 * max(len(segments.rows), 2),
                      title=f"Segments at the end of the trace{hidden}: allocations coloured by where they were "
                            "made, free space in grey",
                      xaxis_title="offset in the segment (MiB)",
                      yaxis={"autorange": "reversed", "tickmode": "array", "tickvals": list(range(len(segments.rows))),
                             "ticktext": segments.rows, "automargin": True, "zeroline": False},
                      margin={"t": 50, "l": 60, "r": 20, "b": 50}, hovermode="closest")
    if not segments.rows:
        fig.add_annotation(text="no segments", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    return fig


def largest_live_figure(live: List[Dict[str, Any]], colour: _Colours,
                        stacks: Optional[data.StackTexts] = None) -> Any:
    """The largest allocations still live at the end, their stacks on hover
    (written by ``stacks``)."""
    import plotly.graph_objects as go

    stacks = stacks or data.StackTexts(data.STACK_TEXT_FLOOR)

    # axis labels render Plotly's HTML subset (links too): the site is the snapshot's text
    labels = [f"{k + 1}. {format_size(b['size'])} {html.escape(b['site'], quote=False)}" for k, b in enumerate(live)]
    fig = go.Figure(go.Bar(orientation="h", y=labels, x=[b["size"] / MiB for b in live], meta="largest",
                           marker={"color": [colour(b["site"]) for b in live]}, hoverinfo="text",
                           hovertext=[f"<b>{format_size(b['size'])}</b> on stream {b['stream']}<br>"
                                      f"{stacks(b['frames'])}" for b in live]))
    fig.update_layout(title=f"The {len(live)} largest allocations live at the end (hover for the stack that "
                            "made each)", xaxis_title="MiB", yaxis={"autorange": "reversed", "automargin": True},
                      height=140 + 26 * max(len(live), 2), margin={"t": 50, "l": 60, "r": 20, "b": 50})
    return fig


_COUNTS = ("segments", "live allocations", "allocations in the trace")


def totals_table(title: str, rows: List[Dict[str, Any]], key_name: str) -> str:
    """Per-stream or per-pool totals as an HTML table. Plain HTML rather than
    a Plotly table: it is static text, and each Plotly table costs the page a
    tenth of a second to draw."""
    columns = [c for c in (rows[0] if rows else {}) if c != "key"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [key_name] + columns)
    body = "".join(
        "<tr><td>" + html.escape(str(row["key"])) + "</td>"
        + "".join(f"<td>{row[c]:,}</td>" if c in _COUNTS else f"<td>{format_size(row[c])}</td>" for c in columns)
        + "</tr>" for row in rows)
    return f"<h2>{html.escape(title)}</h2>\n<table><tr>{head}</tr>{body}</table>"


def report_html(snapshot: Dict[str, Any], device: Optional[int] = None, title: Optional[str] = None,
                stats: Optional[Mapping[str, int]] = None) -> str:
    """The report of ``snapshot`` (device ``device``, by default the one with
    the longest trace) as one HTML page. ``stats``: the pool's
    ``memory_stats`` for the summary table; without it, the table is made
    from the snapshot (current values from its segments, the rest from its
    trace). ``ValueError`` for a device the snapshot does not have."""
    import plotly.io

    device = pick_device(snapshot, device)
    tl = Timeline(snapshot, device, site=data.site_of, tracked=data.MAX_BANDS)
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    # The hovers' stacks within a budget that grows with the snapshot, the
    # most telling first: the largest live allocations, the bands, the blocks.
    stacks = data.StackTexts(data.STACK_TEXT_FLOOR + data.pickled_size(snapshot))
    colour = _Colours([site for site, _ in tl.site_totals()])
    largest = largest_live_figure(data.largest_live(tl.segments), colour, stacks)
    timeline = timeline_figure(tl, data.largest_bands(tl), colour, stacks)
    segment_map = segment_map_figure(data.segment_map(tl.segments, stacks), colour)
    figures = [("timeline", timeline), ("largest", largest), ("segments", segment_map)]
    tables = [totals_table("Per stream: the segments at the end, and the allocations of the trace",
                           data.totals_by_stream(tl.segments, events), "stream"),
              totals_table("Per pool: the segments at the end", data.totals_by_pool(tl.segments), "pool")]
    # As memory_summary's section: once a framework other than unimem's own
    # functions is named (PyTorch's snapshots name no client)
    by_client = data.totals_by_client(tl.segments, events)
    if any(row["key"] != OWN_CLIENT for row in by_client):
        tables.append(totals_table("Per client: who holds the memory at the end, and who allocated in the trace",
                                   by_client, "client"))
    divs = [plotly.io.to_html(fig, config=PLOTLY_CONFIG, include_plotlyjs=(k == 0), full_html=False,
                              div_id=f"unimem-{name}", post_script=POST_SCRIPT, default_height=None)
            for k, (name, fig) in enumerate(figures)]

    name = data.device_name(snapshot)
    pool = snapshot.get("allocator_settings", {}).get("pool")
    where = f"{shorten(str(pool))} device {device}" if pool else f"device {device}"
    if stats is None:
        stats = data.snapshot_memory_stats(snapshot, device)
        table = memory_summary_table(stats, name, device, abbreviated=True, unknown=UNKNOWN)
        table_note = _snapshot_table_note(len(events))
    else:
        table = memory_summary_table(stats, name, device)
        table_note = "The pool's statistics when the report was written."
    facts = [html.escape(where), trace_extent(events),
             f"peak active {format_size(int(tl.peak[0])) if tl.peak[1] >= 0 else 'n/a'}",
             f"{format_size(sum(s['total_size'] for s in tl.segments))} reserved in {len(tl.segments)} segments "
             "at the end"]
    if events:                                    # without a trace, how many there were is not known
        facts.append(f"{len(tl.ooms):,} out-of-memory errors")
    if stacks.left_out:
        facts.append(f"{stacks.left_out:,} hovers without their stack (the report keeps near its snapshot's size)")
    heading = html.escape(title or f"unimem memory report: {where}")
    return _PAGE.format(title=heading, facts=" &middot; ".join(facts), figures=len(figures),
                        note=html.escape(table_note), table=html.escape(table),
                        divs="\n".join(f'<div class="figure">{d}</div>' for d in divs), tables="\n".join(tables))


def trace_extent(events: List[Dict[str, Any]]) -> str:
    """The report's header on the trace: how many entries, over what time."""
    if not events:
        return "no trace (the snapshot has no history)"
    if not all("time_us" in e for e in events):
        return f"{len(events):,} trace entries (the trace records no times)"
    times = [e["time_us"] for e in events]
    return f"{len(events):,} trace entries over {format_duration(max(times) - min(times))}"


def format_duration(microseconds: float) -> str:
    """A span of time in the unit that shows it: 740 µs, 12.5 ms, 3.204 s."""
    if microseconds < 1:
        return "less than 1 µs"
    if microseconds < 1000:
        return f"{microseconds:.0f} µs"
    if microseconds < 1_000_000:
        return f"{microseconds / 1000:.1f} ms"
    return f"{microseconds / 1e6:.3f} s"


def _snapshot_table_note(entries: int) -> str:
    """What the summary table made from a snapshot can tell, and what it cannot."""
    if not entries:
        return ("Made from the snapshot, which holds no statistics and no trace: only \"Cur Usage\", from its "
                f"segments. {UNKNOWN} marks what it cannot tell; rows it cannot tell at all are left out.")
    return ("Made from the snapshot, which holds no statistics: \"Cur Usage\" from its segments; peaks and "
            f"totals over its {entries:,} trace entries (all of the pool's history only if recording began "
            "before its first allocation) of the counts, of requested and reserved memory, and the OOMs. A "
            "trace entry has the size the allocation asked for, not its block's: allocated, active and "
            f"non-releasable memory are only current. {UNKNOWN} marks what the snapshot cannot tell; rows it "
            "cannot tell at all are left out.")


def write_report(snapshot: Dict[str, Any], output: "str | os.PathLike[str]", device: Optional[int] = None,
                 title: Optional[str] = None, stats: Optional[Mapping[str, int]] = None) -> str:
    """Write :func:`report_html` of ``snapshot`` into ``output``; returns the path."""
    page = report_html(snapshot, device=device, title=title, stats=stats)
    # A file name Python could not decode (recorded with a lone surrogate,
    # as "caf\udce9.py") is written as its escape, not refused half-way
    # through the file.
    with open(output, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(page)
    return os.fspath(output)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.2em 2em; color: #222; }}
h1 {{ font-size: 1.4em; margin-bottom: 0.2em; }}
.facts {{ color: #555; margin-bottom: 1em; }}
.figure {{ margin: 0.5em 0 1.5em; }}
h2 {{ font-size: 1.1em; margin-top: 1.5em; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
pre {{ font-size: 12px; background: #f6f6f6; padding: 0.8em; overflow-x: auto; }}
</style>
<script>window.unimemReport = {{figures: {figures}, drawn: 0, drawnAt: null}};</script>
</head>
<body>
<h1>{title}</h1>
<div class="facts">{facts}</div>
{divs}
{tables}
<h2>Memory summary</h2>
<p>{note}</p>
<pre id="unimem-summary">{table}</pre>
</body>
</html>
"""
