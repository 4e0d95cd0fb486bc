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
* totals per stream and per pool, and the memory summary table.

A long trace is cut down to what a screen shows (see
:mod:`unimem._observe.report_data`): the file stays a few times the size of
the pickle and draws in a second or two.
"""
from __future__ import annotations

import html
import os
from typing import Any, Dict, List, Mapping, Optional

from .._core import format_size
from . import report_data as data
from .summary import memory_summary_table
from .timeline import MiB, Timeline, pick_device

FREE_COLOUR = "#e3e3e3"
OTHER_COLOUR = "#cfcfcf"
BEFORE_COLOUR = "#9a9a9a"
PENDING_COLOUR = "#ef8636"
RESERVED_COLOUR = "#222222"
OOM_COLOUR = "#d62728"
MAX_OOM_LINES = 100
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


def timeline_figure(tl: Timeline, bands: List[data.Band], colour: _Colours) -> Any:
    """Active memory over time (bands of the largest allocations over the grey
    of all the others) above reserved and active memory, OOMs marked."""
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
        _add_bands(fig, bands, colour)
        _add_ooms_and_peak(fig, tl)
    fig.update_xaxes(title_text="time since the first recorded event (s)", row=2, col=1)
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
    active_times, active = data.downsample(*tl.active_steps())
    fig.add_trace(_step_line(active_times, active, "active memory (grey: the allocations not drawn as bands)",
                             "active", "active", fill="tozeroy", fillcolor=OTHER_COLOUR,
                             line={"color": "#8c8c8c", "width": 0.8}), row=1, col=1)
    before_times, before = data.downsample([t for t, _ in tl.base_steps] + [tl.end_time],
                                           [y for _, y in tl.base_steps] + [tl.base_steps[-1][1]])
    if before.any():
        fig.add_trace(_step_line(before_times, before, "allocated before the recording", "before",
                                 "allocated before the recording", fill="tozeroy", fillcolor=BEFORE_COLOUR,
                                 line={"width": 0}), row=1, col=1)
    reserved_times, reserved = data.downsample(*tl.reserved_steps())
    fig.add_trace(_step_line(reserved_times, reserved, "reserved", "reserved", "reserved",
                             line={"color": RESERVED_COLOUR, "width": 1.5}, legendrank=2000), row=2, col=1)
    fig.add_trace(_step_line(active_times, active, "active", "allocated", "active",
                             line={"color": "#1f77b4", "width": 1.2}, legendrank=2000), row=2, col=1)


def _add_bands(fig: Any, bands: List[data.Band], colour: _Colours) -> None:
    """The bands: one trace per place (a few hundred traces would take seconds
    to draw), its bands separate shapes. A hover on a band's middle tells that
    allocation's story, anywhere else on it its place's."""
    import plotly.graph_objects as go

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
                  f"({format_size(largest.size)}):<br>{data.stack_text(largest.frames)}")), row=1, col=1)
    if bands:
        fig.add_trace(go.Scatter(
            x=[b.centre[0] for b in bands], y=[b.centre[1] for b in bands], mode="markers",
            marker={"size": 8, "opacity": 0}, showlegend=False, meta="allocations", name="allocation",
            customdata=[b.size for b in bands], hoverinfo="text",
            hovertext=[f"<b>{format_size(b.size)}</b> allocated at {b.start:.4f} s, "
                       f"{f'freed at {b.end:.4f} s' if b.end is not None else 'still live at the end'}<br>"
                       f"{data.stack_text(b.frames)}" for b in bands]), row=1, col=1)


def _add_ooms_and_peak(fig: Any, tl: Timeline) -> None:
    import plotly.graph_objects as go

    for t, _ in tl.ooms[:MAX_OOM_LINES]:
        fig.add_vline(x=t, line={"color": OOM_COLOUR, "dash": "dash", "width": 1.5})
    if tl.ooms:
        top = max(tl.active_steps()[1], default=0) / MiB
        fig.add_trace(go.Scatter(
            x=[t for t, _ in tl.ooms], y=[top] * len(tl.ooms), mode="markers", name="out of memory",
            marker={"symbol": "x", "size": 11, "color": OOM_COLOUR}, meta="oom", hoverinfo="text",
            hovertext=[f"out of memory: {format_size(size)} requested at {t:.4f} s" for t, size in tl.ooms]),
            row=1, col=1)
    if tl.peak[1] >= 0:
        fig.add_annotation(x=tl.times[tl.peak[1]], y=tl.peak[0] / MiB, text=f"peak {format_size(int(tl.peak[0]))}",
                           showarrow=True, arrowhead=2, ax=30, ay=-25, row=1, col=1)


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
    import plotly.graph_objects as go

    fig = go.Figure()
    looks = {data.ALLOCATED: ("allocated", None), data.PENDING_FREE: ("pending free (a stream still uses it)",
                                                                      PENDING_COLOUR),
             data.FREE: ("free", FREE_COLOUR)}
    for state, (name, fixed) in looks.items():
        blocks = segments.blocks[state]
        if not blocks["row"]:
            continue
        colours = fixed or [colour(site) for site in blocks["site"]]
        fig.add_trace(go.Bar(orientation="h", y=blocks["row"], x=blocks["size"], base=blocks["offset"], name=name,
                             marker={"color": colours, "line": {"color": "white", "width": 0.5}},
                             hovertext=blocks["text"], hoverinfo="text", meta=f"segment {state}"))
    hidden = f" (the {len(segments.rows)} largest shown)" if segments.hidden_segments else ""
    fig.update_layout(barmode="overlay", height=140 + 24 * max(len(segments.rows), 2),
                      title=f"Segments at the end of the trace{hidden}: allocations coloured by where they were "
                            "made, free space in grey",
                      xaxis_title="offset in the segment (MiB)",
                      yaxis={"autorange": "reversed", "categoryorder": "array", "categoryarray": segments.rows},
                      margin={"t": 50, "l": 60, "r": 20, "b": 50}, hovermode="closest")
    if not segments.rows:
        fig.add_annotation(text="no segments", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    return fig


def largest_live_figure(live: List[Dict[str, Any]], colour: _Colours) -> Any:
    """The largest allocations still live at the end, their stacks on hover."""
    import plotly.graph_objects as go

    # axis labels render Plotly's HTML subset (links too): the site is the snapshot's text
    labels = [f"{k + 1}. {format_size(b['size'])} {html.escape(b['site'], quote=False)}" for k, b in enumerate(live)]
    fig = go.Figure(go.Bar(orientation="h", y=labels, x=[b["size"] / MiB for b in live], meta="largest",
                           marker={"color": [colour(b["site"]) for b in live]}, hoverinfo="text",
                           hovertext=[f"<b>{format_size(b['size'])}</b> on stream {b['stream']}<br>"
                                      f"{data.stack_text(b['frames'])}" for b in live]))
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
    bands = data.largest_bands(tl)
    live = data.largest_live(tl.segments)
    segments = data.segment_map(tl.segments)
    colour = _Colours([site for site, _ in tl.site_totals()])
    figures = [("timeline", timeline_figure(tl, bands, colour)),
               ("largest", largest_live_figure(live, colour)),
               ("segments", segment_map_figure(segments, colour))]
    tables = [totals_table("Per stream: the segments at the end, and the allocations of the trace",
                           data.totals_by_stream(tl.segments, events), "stream"),
              totals_table("Per pool: the segments at the end", data.totals_by_pool(tl.segments), "pool")]
    divs = [plotly.io.to_html(fig, config=PLOTLY_CONFIG, include_plotlyjs=(k == 0), full_html=False,
                              div_id=f"unimem-{name}", post_script=POST_SCRIPT, default_height=None)
            for k, (name, fig) in enumerate(figures)]

    name = data.device_name(snapshot)
    pool = snapshot.get("allocator_settings", {}).get("pool")
    where = f"{pool} device {device}" if pool else f"device {device}"
    if stats is None:
        stats = data.snapshot_memory_stats(snapshot, device)
        table_note = ("Made from the snapshot, which holds no statistics: \"Cur Usage\" from its segments; "
                      "peaks and totals over the recorded trace only, where an allocation counts the size "
                      "it asked for (the trace records no block sizes).")
        abbreviated = True
    else:
        table_note, abbreviated = "The pool's statistics when the report was written.", False
    table = memory_summary_table(stats, name, device, abbreviated=abbreviated)
    span = f"{tl.end_time:.3f} s" if tl.has_history else "no history"
    facts = (f"{html.escape(where)} &middot; {len(events):,} trace entries over {span} &middot; "
             f"peak active {format_size(int(tl.peak[0])) if tl.peak[1] >= 0 else 'n/a'} &middot; "
             f"{format_size(sum(s['total_size'] for s in tl.segments))} reserved in {len(tl.segments)} segments "
             f"at the end &middot; {len(tl.ooms)} out-of-memory errors")
    heading = html.escape(title or f"unimem memory report: {where}")
    return _PAGE.format(title=heading, facts=facts, figures=len(figures), note=html.escape(table_note),
                        table=html.escape(table), divs="\n".join(f'<div class="figure">{d}</div>' for d in divs),
                        tables="\n".join(tables))


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
