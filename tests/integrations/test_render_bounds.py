"""What ``plot`` and ``view`` draw is bounded by the snapshot's size, whatever
the snapshot shares by reference.

A pickle refers to an object again in two bytes, so a small file can hold one
list of frames, one trace entry or one block many thousands of times over.
The loader bounds how many references there are; these tests hold the
drawings to the file: what they draw is counted (never timed), and the
report's page and the memory that writing it takes are measured against the
pickle's size.
"""
import os
import pickle
import tracemalloc

import pytest

from unimem._observe import plot as plot_module
from unimem._observe import report, report_data
from unimem._observe.snapshot_file import load_snapshot
from unimem._observe.timeline import MAX_OOM_MARKS, MAX_SEGMENT_BLOCKS, Timeline

# The longest names a chart shows (MAX_NAME is 120: longer ones are cut).
FILENAME = "/home/someone/" + "a" * 120 + ".py"
FUNCTION = "f" * 120


def stack(depth=16):
    return [{"filename": FILENAME, "line": k + 1, "name": FUNCTION} for k in range(depth)]


def segment(address, blocks, stream=0):
    return {"device": 0, "address": address, "total_size": sum(b["size"] for b in blocks), "stream": stream,
            "segment_type": "large", "blocks": blocks}


def alloc(addr, size, time_us, frames, stream=0):
    return {"action": "alloc", "addr": addr, "size": size, "stream": stream, "time_us": time_us, "frames": frames}


# --- snapshots that share sub-objects ------------------------------------------
def one_stack_for_12000_blocks():
    """One segment of 12,000 blocks that share one 16-frame stack (the
    segment map drew every block of its largest segment, each with the stack:
    a 0.3 MB pickle made a 55 MB page)."""
    frames = stack()
    blocks = [{"address": 4096 + 512 * k, "size": 512, "state": "active_allocated", "frames": frames}
              for k in range(12_000)]
    return {"segments": [segment(4096, blocks)], "device_traces": []}


def one_frame_in_every_list():
    """5,000 blocks, each its own list of 16 references to one frame."""
    frame = stack(1)[0]
    blocks = [{"address": 4096 + 1024 * k, "size": 512 + k, "state": "active_allocated", "frames": [frame] * 16}
              for k in range(5000)]
    trace = [alloc(b["address"], b["size"], k, b["frames"]) for k, b in enumerate(blocks)]
    return {"segments": [segment(4096, blocks)], "device_traces": [trace]}


def one_oom_entry_50000_times():
    """50,000 references to one out-of-memory entry (one hover each in the report)."""
    frames = stack(1)
    oom = {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0, "time_us": 5, "frames": frames}
    return {"segments": [], "device_traces": [[alloc(4096, 512, 1, frames)] + [oom] * 50_000]}


def frees_that_move_every_band():
    """200 allocations, then 2,400 frees of memory from before the recording:
    each free moves every band (the outlines of 200 bands of 2,400 steps each)."""
    frames = stack(2)
    trace = [alloc(4096 * (k + 1), 1 << 20, k, frames) for k in range(200)]
    trace += [{"action": "free_completed", "addr": 1 << 40, "size": 1, "stream": 0, "time_us": 1000 + k,
               "frames": []} for k in range(2400)]
    blocks = [{"address": 4096 * (k + 1), "size": 1 << 20, "state": "active_allocated", "frames": frames}
              for k in range(200)]
    return {"segments": [segment(4096, blocks)], "device_traces": [trace]}


def one_blocks_list_for_48_segments():
    """48 segments that share one list of 2,000 blocks."""
    frames = stack(1)
    blocks = [{"address": 0, "size": 512, "state": "active_allocated", "frames": frames} for _ in range(2000)]
    return {"segments": [segment(k << 30, blocks) for k in range(48)], "device_traces": []}


def distinct_states_in_one_blocks_list_for_48_segments():
    """48 segments that share one list of 20,000 blocks, each of a state of
    its own of 107 characters (each segment's bar of undrawn blocks named
    every state: a 2.5 MB pickle made a 124 MB page)."""
    frames = stack(1)
    blocks = [{"address": 0, "size": 512, "state": f"state {k:05d} " + "s" * 96, "frames": frames}
              for k in range(20_000)]
    return {"segments": [segment(k << 30, blocks) for k in range(48)], "device_traces": []}


def a_stream_for_every_entry():
    """40,000 allocations, each on a stream of its own (a row each in the per-stream table)."""
    frames = []
    return {"segments": [], "device_traces": [[alloc(k, 1, k, frames, stream=k) for k in range(40_000)]]}


def a_pool_name_of_2_mb():
    snapshot = one_stack_for_12000_blocks()
    snapshot["segments"][0]["blocks"] = snapshot["segments"][0]["blocks"][:100]
    snapshot["segments"][0]["total_size"] = 100 * 512
    snapshot["allocator_settings"] = {"pool": "p" * 2_000_000}
    return snapshot


SHARING = [one_stack_for_12000_blocks, one_frame_in_every_list, one_oom_entry_50000_times,
           frees_that_move_every_band, one_blocks_list_for_48_segments,
           distinct_states_in_one_blocks_list_for_48_segments, a_stream_for_every_entry, a_pool_name_of_2_mb]


def written(tmp_path, snapshot):
    """The snapshot as a file, and as the loader reads it back."""
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL))
    return path, load_snapshot(path)


def plotly_js_bytes():
    import plotly.offline
    return len(plotly.offline.get_plotlyjs().encode())


@pytest.mark.parametrize("make", SHARING, ids=lambda make: make.__name__)
def test_the_report_of_a_snapshot_that_shares_stays_near_its_size(tmp_path, make):
    """Beyond plotly.js, the page holds at most 2 MiB and twice the pickle;
    writing it takes at most 128 MiB and 16 times the pickle (it took 440 MiB
    and made a 55 MB page for the 0.3 MB pickle of one_stack_for_12000_blocks)."""
    path, snapshot = written(tmp_path, make())
    size = path.stat().st_size
    out = tmp_path / "memory.html"
    import plotly.graph_objects  # noqa: F401 - imported before measuring, as any report does first
    tracemalloc.start()
    try:
        report.write_report(snapshot, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    content = out.stat().st_size - plotly_js_bytes()
    print(f"\n{make.__name__}: pickle {size:,} B, page beyond plotly.js {content:,} B, peak {peak / 2**20:.0f} MiB")
    assert content <= (2 << 20) + 2 * size
    assert peak <= (128 << 20) + 16 * size


def test_the_segment_map_draws_a_bounded_number_of_blocks_and_sums_the_rest():
    """The largest segment was never cut: every one of its 12,000 blocks was
    drawn, each with its hover. Now MAX_SEGMENT_BLOCKS are drawn one by one
    and one bar sums the rest, so the row still spans the whole segment."""
    snapshot = one_stack_for_12000_blocks()
    drawn = report_data.segment_map(snapshot["segments"])
    one_by_one = sum(len(drawn.blocks[state]["row"]) for state in
                     (report_data.ALLOCATED, report_data.PENDING_FREE, report_data.FREE))
    assert one_by_one == MAX_SEGMENT_BLOCKS
    assert drawn.undrawn_blocks == 12_000 - MAX_SEGMENT_BLOCKS
    assert len(drawn.blocks[report_data.UNDRAWN]["row"]) == 1
    total = sum(sum(blocks["size"]) for blocks in drawn.blocks.values()) * (1 << 20)
    assert total == pytest.approx(snapshot["segments"][0]["total_size"])
    assert "7,000 more blocks" in drawn.blocks[report_data.UNDRAWN]["text"][0]


def test_a_bar_of_undrawn_blocks_names_the_states_of_most_bytes_and_sums_the_others():
    """The bar named every state of the blocks past the cap, and a
    snapshot's states are any strings. Now the UNDRAWN_STATES of most bytes
    (by name), the others summed in one part."""
    frames = stack(1)
    drawn = [{"address": 0, "size": 512, "state": "active_allocated", "frames": frames}] * MAX_SEGMENT_BLOCKS
    rest = ([{"address": 0, "size": 8192, "state": "active_allocated", "frames": frames}] * 2
            + [{"address": 0, "size": 4096, "state": "inactive", "frames": []}] * 3
            + [{"address": 0, "size": 512, "state": f"odd {k}", "frames": frames} for k in range(10)])
    bars = report_data.segment_map([segment(4096, drawn + rest)]).blocks[report_data.UNDRAWN]
    assert bars["size"] == [pytest.approx((2 * 8192 + 3 * 4096 + 10 * 512) / (1 << 20))]
    assert bars["text"] == ["15 more blocks from offset 2.44 MiB, not drawn one by one (the map draws 5,000): "
                            "16.00 KiB active allocated in 2, 12.00 KiB inactive in 3, 512 bytes odd 0 in 1, "
                            "512 bytes odd 1 in 1, 4.00 KiB in 8 of 8 other states"]


def test_hovers_share_one_budget_of_stack_text():
    """A list of frames is written out once however many blocks share it;
    each hover that shows it counts, and past the budget a hover says the
    stack was left out."""
    frames = stack()
    stacks = report_data.StackTexts(budget=10 * len(report_data.stack_text(frames)))
    texts = [stacks(frames) for _ in range(25)]
    assert texts[:10] == [report_data.stack_text(frames)] * 10
    assert texts[10:] == [report_data.STACK_LEFT_OUT] * 15 and stacks.left_out == 15
    assert stacks([]) == report_data.NO_FRAMES           # "no frames" is never left out


# --- plot ------------------------------------------------------------------------
@pytest.fixture
def drawn_figures(monkeypatch):
    """The figures plot_snapshot draws, kept as they are saved."""
    import matplotlib.figure
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        figures.append(figure)
        return save(figure, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def oom_snapshot(count):
    frames = stack(1)
    oom = {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0, "time_us": 5, "frames": frames}
    return {"segments": [], "device_traces": [[alloc(4096, 512, 1, frames)] + [oom] * count]}


def test_plot_marks_at_most_max_oom_marks_out_of_memory_errors(tmp_path, drawn_figures):
    """Every OOM entry was a line and a note (about 12 ms each: one shared
    entry 50,000 times took the plot 10 minutes). As in the report, the
    first MAX_OOM_MARKS are marked and the legend says how many there were."""
    path, snapshot = written(tmp_path, oom_snapshot(3 * MAX_OOM_MARKS))
    plot_module.plot_snapshot(snapshot, str(tmp_path / "out.png"))
    top = drawn_figures[0].axes[0]
    notes = [text for text in top.texts if text.get_text().startswith("out of memory")]
    lines = [line for line in top.lines if line.get_color() == "red" and line.get_linestyle() == "--"]
    assert len(notes) == len(lines) == MAX_OOM_MARKS
    legend = [text.get_text() for text in top.get_legend().get_texts()]
    assert f"out of memory (300 errors, the first {MAX_OOM_MARKS} marked)" in legend


def test_the_report_marks_at_most_max_oom_marks_out_of_memory_errors():
    """The report capped its lines but gave every OOM a marker and a hover."""
    snapshot = oom_snapshot(3 * MAX_OOM_MARKS)
    tl = Timeline(snapshot, 0, site=report_data.site_of, tracked=report_data.MAX_BANDS)
    figure = report.timeline_figure(tl, report_data.largest_bands(tl), report._Colours([]))
    markers = [trace for trace in figure.data if trace.meta == "oom"]
    assert len(markers) == 1 and len(markers[0].x) == len(markers[0].hovertext) == MAX_OOM_MARKS
    assert markers[0].name == f"out of memory (300 errors, the first {MAX_OOM_MARKS} marked)"
    assert len(figure.layout.shapes) == 2 * MAX_OOM_MARKS          # a line across each of the two charts


def rectangles(axes):
    return sum(len(collection.get_paths()) for collection in axes.collections)


@pytest.mark.parametrize("history", [False, True])
def test_plot_draws_a_bounded_number_of_blocks_in_its_segment_map(tmp_path, drawn_figures, history):
    """Without history, every block of a segment was a rectangle (12,000 of
    one segment); with it, every allocation live at the peak (one shared
    entry 12,000 times: 12,000 at one address). Now MAX_SEGMENT_BLOCKS at
    most, the rest of a segment one bar."""
    snapshot = one_stack_for_12000_blocks()
    if history:
        frames = stack(1)
        entry = alloc(4096, 512, 1, frames)
        snapshot["device_traces"] = [[entry] * 12_000]
    path, snapshot = written(tmp_path, snapshot)
    plot_module.plot_snapshot(snapshot, str(tmp_path / "out.png"))
    bottom = drawn_figures[0].axes[1]
    background = 1                                  # the segment's row, in grey
    undrawn = 0 if history else 1                   # the bar that sums the blocks past the cap
    assert rectangles(bottom) == background + MAX_SEGMENT_BLOCKS + undrawn


def test_plot_draws_the_bands_outlines_within_its_corners(tmp_path, drawn_figures):
    """2,400 frees below 200 bands: each band's outline had a corner for
    each of its 2,400 steps (about a million, 340 MiB for a 0.1 MB pickle).
    Now BAND_CORNERS in all, shared among the bands."""
    path, snapshot = written(tmp_path, frees_that_move_every_band())
    plot_module.plot_snapshot(snapshot, str(tmp_path / "out.png"))
    from matplotlib.collections import PolyCollection
    bands = [c for c in drawn_figures[0].axes[0].collections if isinstance(c, PolyCollection)
             and len(c.get_paths()) == 200]
    assert len(bands) == 1
    corners = sum(len(outline.vertices) for outline in bands[0].get_paths())
    assert corners <= plot_module.BAND_CORNERS + 4 * 200      # and a few for each band's ends
