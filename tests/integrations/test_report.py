"""The HTML memory report, opened in a real browser with the network blocked.

Chromium comes from the system's packages (``apt-get install chromium``; .ci/run
installs it), driven headless by Playwright's Python client: no browser is
downloaded. Every request that does not read the report's own file is aborted
and counted. What the page shows is read back from Plotly's data in the page
and compared with what the snapshot says, computed here independently.

``UNIMEM_UPDATE_SCREENSHOT=1`` also writes the README's picture,
docs/memory-report.png.
"""
import base64
import html
import json
import os
import pickle
import shutil
import subprocess
import sys
import re
import textwrap

import numpy
import pytest
from tests.helpers import REPO_ROOT
from unimem._core import format_size

MiB = float(1 << 20)
SCREENSHOT = REPO_ROOT / "docs" / "memory-report.png"

# A small training-shaped program on the cpu pool: three places that allocate,
# weights live to the end, an out-of-memory error at step 8.
TRAINING = textwrap.dedent("""
    import json, sys
    import unimem
    api = unimem.cpu
    api._record_memory_history(max_entries=100_000)

    def load_weights(size):
        return api.caching_allocator_alloc(size)

    def forward(sizes):
        return [api.caching_allocator_alloc(size) for size in sizes]

    def backward(activations, sizes):
        grads = [api.caching_allocator_alloc(size // 2) for size in sizes]
        for p in reversed(activations):
            api.caching_allocator_delete(p)
        return grads

    weights = [load_weights(size) for size in (10 << 20, 6 << 20, 4 << 20, 300 << 10)]
    for step in range(12):
        sizes = [3 << 20, 2 << 20, (5 << 20) + step * (64 << 10), 1 << 20, 700 << 10]
        grads = backward(forward(sizes), sizes)
        if step == 0:
            state = forward([8 << 20, 6 << 20])
        for p in grads:
            api.caching_allocator_delete(p)
        if step == 8:
            try:
                api.caching_allocator_alloc(1 << 50)
            except MemoryError:
                pass
    api._dump_snapshot(sys.argv[1])
    json.dump(dict(api.memory_stats()), open(sys.argv[1] + ".stats.json", "w"))
""")

# 100,000 trace entries: the last ones of a long loop (max_entries keeps them).
LONG_RUN = textwrap.dedent("""
    import random, sys
    import unimem
    api = unimem.cpu
    api._record_memory_history(max_entries=100_000)
    rng = random.Random(0)

    def weights(size):
        return api.caching_allocator_alloc(size)

    def activation(size):
        return api.caching_allocator_alloc(size)

    def scratch(size):
        return api.caching_allocator_alloc(size)

    params = [weights(rng.choice([4 << 20, 8 << 20, 1 << 20])) for _ in range(20)]
    for step in range(2100):
        acts = [activation(rng.choice([256 << 10, 1 << 20, 3 << 20, 512])) for _ in range(rng.randint(5, 40))]
        for _ in range(rng.randint(1, 10)):
            api.caching_allocator_delete(scratch(rng.randint(1, 2 << 20)))
        for p in reversed(acts):
            api.caching_allocator_delete(p)
        if step % 50 == 0:
            api.empty_cache()
    api._dump_snapshot(sys.argv[1])
""")


def make_snapshot(folder, name, program):
    script, path = folder / f"{name}.py", folder / f"{name}.pickle"
    script.write_text(program)
    subprocess.run([sys.executable, str(script), str(path)], check=True, timeout=300,
                   env=dict(os.environ, UNIMEM_DEVICE="cpu"))
    with open(path, "rb") as f:
        return path, script, pickle.load(f)


def unimem_cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "unimem", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO_ROOT), env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """(snapshot path, the program's path, the snapshot, the report's path)."""
    folder = tmp_path_factory.mktemp("training")
    path, script, snapshot = make_snapshot(folder, "training", TRAINING)
    report = folder / "memory.html"
    done = unimem_cli("view", str(path), "-o", str(report))
    assert done.returncode == 0, done.stderr
    return path, script, snapshot, report


# ---------------------------------------------------------------------------
# the browser
# ---------------------------------------------------------------------------
def chromium_path():
    return next(filter(None, (shutil.which(name) for name in ("chromium", "chromium-browser"))), None)


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is in the test extra: "
                                                                 'pip install -e ".[test]"')
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        yield chromium
        chromium.close()


class OpenedReport:
    """A report loaded in a fresh page, every request that leaves the file aborted."""

    def __init__(self, browser, path, width=1280):
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.left_the_file, self.console_errors = [], []
        self.page.route("**/*", self._route)
        self.page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console_errors.append(str(e)))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_function("window.unimemReport && window.unimemReport.drawnAt !== null", timeout=60_000)
        self.drawn_ms = self.page.evaluate("window.unimemReport.drawnAt")

    def _route(self, route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            self.left_the_file.append(route.request.url)
            route.abort()

    def traces(self, figure):
        """The Plotly traces of one figure (``timeline``, ``largest``, ``segments``) as the page holds them."""
        return self.page.evaluate("""figure => {
            const plain = v => (v && ArrayBuffer.isView(v)) ? Array.from(v) : v;
            return document.getElementById('unimem-' + figure).data.map(t => ({
                meta: t.meta, name: t.name, x: plain(t.x), y: plain(t.y), customdata: plain(t.customdata)}));
        }""", figure)

    def hover_text(self, figure, x, y):
        self.page.mouse.move(x, y)
        label = self.page.locator(f"#unimem-{figure} .hoverlayer .hovertext").first
        label.wait_for(timeout=10_000)
        return label.text_content()

    def close(self):
        self.page.close()


def values(array):
    """A Plotly data array: a list, or a typed array as plotly.py writes it ({dtype, bdata})."""
    if isinstance(array, dict):
        return numpy.frombuffer(base64.b64decode(array["bdata"]), dtype=numpy.dtype(array["dtype"])).astype(float)
    return numpy.array(array, dtype=float)


def by_meta(traces, meta):
    found = [t for t in traces if t["meta"] == meta]
    assert found, f"no {meta!r} trace among {[t['meta'] for t in traces]}"
    return found


def expected_timeline(snapshot, device=0):
    """What the snapshot says, swept here: active and reserved bytes at the
    end and at their peaks, the allocation sizes, the out-of-memory errors."""
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    events = snapshot["device_traces"][device]
    final_active = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] != "inactive")
    final_reserved = sum(s["total_size"] for s in segments)

    def peak(final, changes):
        running = numpy.cumsum([0] + changes)
        return final - running[-1] + running.max()
    active_changes = [e["size"] if e["action"] == "alloc" else -e["size"] for e in events
                      if e["action"] in ("alloc", "free_completed")]
    reserved_changes = [e["size"] if e["action"] in ("segment_alloc", "segment_map") else -e["size"]
                        for e in events if e["action"] in ("segment_alloc", "segment_map", "segment_free",
                                                           "segment_unmap")]
    return {"active": (final_active, peak(final_active, active_changes)),
            "reserved": (final_reserved, peak(final_reserved, reserved_changes)),
            "allocations": sorted(e["size"] for e in events if e["action"] == "alloc"),
            "ooms": sum(1 for e in events if e["action"] == "oom"),
            "live": sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"),
                           reverse=True)}


def check_totals(report, snapshot):
    """The page's timeline, reserved line and largest allocations against the snapshot."""
    expected = expected_timeline(snapshot)
    timeline = report.traces("timeline")
    for meta, (final, peak) in (("active", expected["active"]), ("allocated", expected["active"]),
                                ("reserved", expected["reserved"])):
        line = values(by_meta(timeline, meta)[0]["y"]) * MiB
        assert line[-1] == pytest.approx(final, rel=1e-12), meta
        assert line.max() == pytest.approx(peak, rel=1e-12), meta
        assert len(line) <= 4000, f"{meta}: {len(line)} points, more than a screen shows"
    drawn = sorted(values(by_meta(timeline, "allocations")[0]["customdata"]).astype(int).tolist())
    assert drawn == expected["allocations"][-len(drawn):]         # the largest allocations, as bands
    assert len(drawn) == min(200, len(expected["allocations"]))
    assert sum(len(t["x"]) > 0 for t in by_meta(timeline, "bands")) >= 1
    if expected["ooms"]:
        assert len(by_meta(timeline, "oom")[0]["x"]) == expected["ooms"]
    largest = values(by_meta(report.traces("largest"), "largest")[0]["x"]) * MiB
    assert largest.tolist() == pytest.approx(expected["live"][:20])


@pytest.fixture(scope="module")
def opened(browser, training):
    report = OpenedReport(browser, training[3])
    yield report
    report.close()


def test_the_report_opens_offline_without_errors(opened):
    assert opened.left_the_file == [], "the page asked the network for something"
    assert opened.console_errors == []
    assert "CPU memory summary" in opened.page.inner_text("#unimem-summary")
    assert opened.page.locator("table").count() == 2                     # per stream, per pool


# Blocks of three clients on the cpu pool: unimem's own functions, and two
# frameworks' (the names their entry points pass), one freed in the trace.
CLIENTS = textwrap.dedent("""
    import sys
    import unimem
    api = unimem.cpu
    api._record_memory_history(max_entries=100_000)
    pool = api.caching_allocator(0)
    own = [api.caching_allocator_alloc(size) for size in (3 << 20, 1000)]
    numba = [pool.allocate(size, 0, "numba") for size in (5 << 20, 2 << 20)]
    cupy = pool.allocate(7 << 20, 0, "cupy")
    numba.pop().release()
    api._dump_snapshot(sys.argv[1])
""")


def test_the_report_shows_who_holds_the_memory(browser, tmp_path):
    path, _, snapshot = make_snapshot(tmp_path, "clients", CLIENTS)
    report = tmp_path / "memory.html"
    done = unimem_cli("view", str(path), "-o", str(report))
    assert done.returncode == 0, done.stderr
    opened = OpenedReport(browser, report)
    try:
        assert opened.left_the_file == [] and opened.console_errors == []
        tables = opened.page.locator("table")
        assert tables.count() == 3                                     # per stream, per pool, per client
        heading = opened.page.locator("h2", has_text="Per client").inner_text()
        rows = opened.page.evaluate("""() => Array.from(document.querySelectorAll('table')[2].rows)
            .map(r => Array.from(r.cells).map(c => c.textContent))""")
    finally:
        opened.close()
    assert "who holds the memory" in heading
    header, *body = rows
    assert header[:4] == ["client", "allocated", "pending free", "live allocations"]
    by_client = {row[0]: row for row in body}
    assert list(by_client) == ["cupy", "numba", "unimem"]              # the most memory first
    # against the snapshot, summed here
    live = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["client"]] = live.get(block["client"], 0) + block["size"]
    assert live == {"unimem": (3 << 20) + 1024, "numba": 5 << 20, "cupy": 7 << 20}
    order = ("cupy", "numba", "unimem")
    assert [by_client[c][1] for c in order] == [format_size(live[c]) for c in order]
    assert [by_client[c][3] for c in order] == ["1", "1", "2"]
    assert [by_client[c][4] for c in order] == ["1", "2", "2"]       # allocations in the trace


def test_the_timeline_shows_the_snapshots_totals(opened, training):
    snapshot = training[2]
    assert expected_timeline(snapshot)["ooms"] == 1
    check_totals(opened, snapshot)
    segments = opened.traces("segments")
    drawn = sum(values(t["x"]).sum() for t in segments) * MiB       # every block of every segment
    assert drawn == pytest.approx(sum(s["total_size"] for s in snapshot["segments"]))
    assert {"segment active_allocated", "segment inactive"} <= {t["meta"] for t in segments}


def test_hover_names_the_stack_frame_that_allocated(opened, training):
    script = str(training[1])
    bar = opened.page.locator("#unimem-largest .barlayer .point path").first
    bar.scroll_into_view_if_needed()
    box = bar.bounding_box()
    text = opened.hover_text("largest", box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    assert f"load_weights ({script}:" in text, text           # the largest live allocation: a weight
    assert text.startswith("10.00 MiB")

    opened.page.locator("#unimem-timeline").scroll_into_view_if_needed()
    # a band's middle, from data to pixels through Plotly's axes
    x, y, size = opened.page.evaluate("""() => {
        const gd = document.getElementById('unimem-timeline');
        const t = gd.data.find(d => d.meta === 'allocations'), i = t.customdata.indexOf(Math.max(...t.customdata));
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.l2p(t.x[i]), box.top + ya._offset + ya.l2p(t.y[i]), t.customdata[i]];
    }""")
    text = opened.hover_text("timeline", x, y)
    assert size == 10 << 20
    assert text.startswith("10.00 MiB allocated at") and f"load_weights ({script}:" in text, text


def test_screenshot_for_the_readme(browser, training):
    """The README's picture, rewritten with UNIMEM_UPDATE_SCREENSHOT=1; otherwise it must exist."""
    if os.environ.get("UNIMEM_UPDATE_SCREENSHOT") != "1":
        assert SCREENSHOT.exists(), "make it: UNIMEM_UPDATE_SCREENSHOT=1 python -m pytest " + __file__
        return
    report = OpenedReport(browser, training[3], width=1200)
    try:
        bottom = report.page.evaluate("document.getElementById('unimem-largest').getBoundingClientRect().bottom")
        SCREENSHOT.parent.mkdir(exist_ok=True)
        report.page.screenshot(path=str(SCREENSHOT), full_page=True,
                               clip={"x": 0, "y": 0, "width": 1200, "height": bottom + 10})
    finally:
        report.close()


def test_100000_entries_draw_in_seconds_from_a_file_a_few_times_the_pickle(browser, tmp_path):
    path, _, snapshot = make_snapshot(tmp_path, "long_run", LONG_RUN)
    assert len(snapshot["device_traces"][0]) == 100_000
    report_path = tmp_path / "memory.html"
    done = unimem_cli("view", str(path), "-o", str(report_path))
    assert done.returncode == 0, done.stderr
    ratio = report_path.stat().st_size / path.stat().st_size
    # plotly.js alone, drawing one line: what any Plotly page costs this machine now
    baseline_path = tmp_path / "baseline.html"
    import plotly.graph_objects as go
    import plotly.io
    baseline_path.write_text(
        "<script>window.unimemReport = {figures: 1, drawn: 0, drawnAt: null};</script>"
        + plotly.io.to_html(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])), include_plotlyjs=True, full_html=False,
                            post_script="window.unimemReport.drawnAt = performance.now();"))
    timings = {"report": [], "plotly.js alone": []}
    for _ in range(3):
        for name, page_path in (("report", report_path), ("plotly.js alone", baseline_path)):
            opened = OpenedReport(browser, page_path)
            timings[name].append(opened.drawn_ms)
            if name == "report":
                assert opened.left_the_file == [] and opened.console_errors == []
                check_totals(opened, snapshot)
            opened.close()
    report_ms, baseline_ms = min(timings["report"]), min(timings["plotly.js alone"])
    print(f"\n100,000 entries: pickle {path.stat().st_size:,} B, report {report_path.stat().st_size:,} B "
          f"({ratio:.2f}x); drawn in {report_ms:.0f} ms (plotly.js alone: {baseline_ms:.0f} ms), "
          f"load average {os.getloadavg()[0]:.1f}")
    assert ratio <= 5
    # < 3 s; on a machine too busy to load plotly.js itself in 1.5 s, the report's own share < 1.5 s
    assert report_ms < max(3000, baseline_ms + 1500), timings


@pytest.mark.parametrize("kind", ["segments without history", "nothing at all"])
def test_a_snapshot_without_history_opens_too(browser, tmp_path, kind):
    path = tmp_path / "snapshot.pickle"
    if kind == "nothing at all":
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    else:                                         # a pickled memory_snapshot(): segments only
        subprocess.run([sys.executable, "-c", "import pickle, unimem\n"
                        "p = unimem.cpu.caching_allocator_alloc(3 << 20)\n"
                        f"pickle.dump(unimem.cpu.memory_snapshot(), open({str(path)!r}, 'wb'))\n"],
                       check=True, timeout=120, env=dict(os.environ, UNIMEM_DEVICE="cpu"))
    done = unimem_cli("view", str(path), "-o", str(tmp_path / "memory.html"))
    assert done.returncode == 0, done.stderr
    report = OpenedReport(browser, tmp_path / "memory.html")
    try:
        assert report.left_the_file == [] and report.console_errors == []
        assert "no history in this snapshot" in report.page.inner_text("#unimem-timeline")
        live = report.traces("largest")[0]["x"]
        assert values(live).tolist() == ([3.0] if kind == "segments without history" else [])
    finally:
        report.close()


def test_the_summary_made_from_a_snapshot_agrees_with_the_pools_own(training):
    """Recorded from the pool's first allocation, the snapshot says what
    memory_stats counted: every current value (from the segments), and the
    counts, reserved bytes and OOMs over the trace. (The trace records the
    size each allocation asked for, not its block's: allocated bytes over
    time are not in it, and the table made from it says so.)"""
    from unimem._observe.report_data import snapshot_memory_stats
    path, _, snapshot, _ = training
    with open(f"{path}.stats.json") as f:
        real = json.load(f)
    made = snapshot_memory_stats(snapshot, 0)
    exact = [f"{key}.all.current" for key in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                                              "inactive_split_bytes", "allocation", "active", "segment",
                                              "inactive_split")]
    exact += [f"{key}.all.{metric}" for key in ("reserved_bytes", "allocation", "active", "segment")
              for metric in ("peak", "allocated", "freed")]
    # The trace records the size each allocation asked for: requested memory over time.
    exact += [f"requested_bytes.all.{metric}" for metric in ("peak", "allocated", "freed")]
    assert {name: made[name] for name in exact + ["num_ooms"]} == {name: real[name] for name in exact + ["num_ooms"]}
    assert real["num_ooms"] == 1
    # ... and not the blocks' sizes: what it cannot tell is left out, not made up
    untold = [f"{key}.all.{metric}" for key in ("allocated_bytes", "active_bytes", "inactive_split_bytes",
                                               "inactive_split") for metric in ("peak", "allocated", "freed")]
    assert not set(untold + ["num_alloc_retries"]) & set(made)


# A snapshot with no trace: _dump_snapshot while nothing is recorded.
NO_TRACE = textwrap.dedent("""
    import sys
    import unimem
    api = unimem.cpu
    kept = [api.caching_allocator_alloc(size) for size in (10 << 20, 3 << 20, 1000, 700 << 10)]
    api.caching_allocator_delete(kept.pop())
    api._dump_snapshot(sys.argv[1])
""")


def summary_of(page_path):
    """The report's header, the note over its summary table, and the table's
    rows: {label: [Cur Usage, Peak Usage, Tot Alloc, Tot Freed]} and the OOMs line."""
    page = page_path.read_text()
    facts = html.unescape(re.search(r'<div class="facts">(.*?)</div>', page).group(1))
    note = html.unescape(re.search(r"<p>(.*?)</p>", page, re.S).group(1))
    table = html.unescape(re.search(r'<pre id="unimem-summary">(.*?)</pre>', page, re.S).group(1))
    ooms = next(line for line in table.splitlines() if "OOMs" in line)
    return facts, note, table_rows(table), ooms


def in_bytes(cell):
    number, unit = cell.split()
    return int(number) << (10 * ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(unit))


def test_the_summary_of_a_snapshot_without_a_trace_shows_only_current_usage(tmp_path):
    """Without a trace a snapshot tells only what its segments hold now: the
    table made from it printed each current value again as its peak and 0 as
    its totals. Now only "Cur Usage" has numbers, the rest say n/a, and the
    note and the header say why."""
    path, _, snapshot = make_snapshot(tmp_path, "no_trace", NO_TRACE)
    assert snapshot["device_traces"] == [[]]
    report = tmp_path / "memory.html"
    done = unimem_cli("view", str(path), "-o", str(report))
    assert done.returncode == 0, done.stderr
    facts, note, rows, ooms = summary_of(report)
    assert "no trace" in facts and "out-of-memory" not in facts
    assert "no trace" in note and 'only "Cur Usage"' in note
    assert "n/a" in ooms
    assert in_bytes(rows["Allocated memory"][0]) == (13 << 20) + 1024      # the three blocks still live
    for label, cells in rows.items():
        if not label.startswith("Oversize"):          # never oversize: max_split_size is unlimited
            assert cells[0] != "n/a" and cells[1:] == ["n/a"] * 3, (label, cells)


def table_rows(table):
    """A summary table's rows: {label: [Cur Usage, Peak Usage, Tot Alloc, Tot Freed]}."""
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] != "Metric":
            rows[cells[0]] = cells[1:]
    return rows


def test_the_summary_of_a_snapshot_with_a_trace_does_not_contradict_itself(training):
    """From a trace, "Requested memory" showed 0 B allocated beside 114,688
    KiB of "Allocated memory", and a requested peak under the allocated one:
    the trace's sizes (what was asked for) were counted as allocated memory,
    and requested memory only as its current value. Now the trace's sizes are
    requested memory, row for row the pool's own; allocated, active and
    non-releasable memory over time, which the trace cannot tell, say n/a."""
    from unimem._observe.summary import memory_summary_table
    path, _, snapshot, report = training
    with open(f"{path}.stats.json") as f:
        real = table_rows(memory_summary_table(json.load(f), "CPU", 0, abbreviated=True))
    facts, note, rows, ooms = summary_of(report)
    for label in ("Requested memory", "CPU reserved memory", "Allocations", "Active allocs", "CPU reserved segments"):
        assert rows[label] == real[label], label
    for label in ("Allocated memory", "Active memory", "Non-releasable memory", "Non-releasable allocs"):
        assert rows[label][0] == real[label][0] and rows[label][1:] == ["n/a"] * 3, (label, rows[label])
    assert "malloc retries: n/a" in ooms and "OOMs: 1 " in ooms
    assert re.search(rf"{len(snapshot['device_traces'][0]):,} trace entries over [0-9.]+ (µs|ms|s) ", facts), facts


def test_the_header_gives_a_short_trace_its_span_in_microseconds(tmp_path):
    """Entries 31 µs apart were "over 0.000 s"; entries without times, "over
    2.000 s" (their numbers in the trace taken for seconds)."""
    from unimem._observe.report import report_html
    frames = [{"filename": "/home/user/train.py", "line": 3, "name": "step"}]
    events = [{"action": "alloc", "addr": 4096 * k, "size": 512, "stream": 0, "time_us": t, "frames": frames}
              for k, t in enumerate((1_000_010, 1_000_020, 1_000_041))]
    snapshot = {"segments": [], "device_traces": [events]}
    facts = lambda page: html.unescape(re.search(r'<div class="facts">(.*?)</div>', page).group(1))  # noqa: E731
    assert "3 trace entries over 31 µs" in facts(report_html(snapshot))
    for e in events:
        del e["time_us"]
    untimed = report_html(snapshot)
    assert "3 trace entries (the trace records no times)" in facts(untimed)
    assert "trace entry (the trace records no times)" in untimed.replace("\\u002f", "/")


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------
def page_text(path):
    """The report's text, with the slashes Plotly's JSON escapes (as \\u002f) back."""
    return path.read_text().replace("\\u002f", "/")


def one_line_error(done, *says):
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for text in says:
        assert text in lines[0], lines[0]


class RunsCode:
    """A "snapshot" that, unpickled, calls ``function(*arguments)``."""

    def __init__(self, function, *arguments):
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


@pytest.mark.parametrize("content, says", [
    (b"", "empty or truncated"),
    (b"hello, this is not a pickle\n", "not a pickled snapshot"),
    (pickle.dumps({"device_traces": []}), "no 'segments'"),
])
def test_view_of_a_bad_file_is_one_line_and_exit_2(tmp_path, content, says):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    one_line_error(unimem_cli("view", str(path), "-o", str(tmp_path / "memory.html")), says, "bad.pickle")
    assert not (tmp_path / "memory.html").exists()


def test_view_runs_no_code_from_the_file(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(RunsCode(os.system, f"touch {marker}")))
    one_line_error(unimem_cli("view", str(path), "-o", str(tmp_path / "memory.html")), "refused", "evil.pickle")
    assert not marker.exists()


def test_view_argument_mistakes(training, tmp_path):
    path = str(training[0])
    one_line_error(unimem_cli("view", "/no/such/snapshot.pickle"), "No such file")
    one_line_error(unimem_cli("view", path, "-d", "3", "-o", str(tmp_path / "m.html")), "no device 3")
    one_line_error(unimem_cli("view", path, "-o", str(tmp_path / "no" / "m.html")), "cannot write")


def test_view_opens_no_file_a_snapshot_names(tmp_path):
    """A snapshot comes from anyone: the paths of its frames (here a FIFO,
    which would block a reader for ever, and a source file) are names to
    show, never files to open."""
    fifo, source = tmp_path / "fifo.py", tmp_path / "train.py"
    os.mkfifo(fifo)
    source.write_text("import unimem\n\nSECRET = 'not for the report'\n")
    frames = [{"filename": str(source), "line": 3, "name": "g"}, {"filename": str(fifo), "line": 3, "name": "f"}]
    snapshot = {"segments": [{"device": 0, "address": 1 << 20, "total_size": 2 << 20, "stream": 0,
                              "segment_type": "small", "frames": frames,
                              "blocks": [{"address": 1 << 20, "size": 512, "state": "active_allocated",
                                          "frames": frames},
                                         {"address": (1 << 20) + 512, "size": (2 << 20) - 512,
                                          "state": "inactive", "frames": []}]}],
                "device_traces": [[{"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0,
                                    "time_us": 1, "frames": frames},
                                   {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 2,
                                    "frames": frames}]]}
    path, report = tmp_path / "snapshot.pickle", tmp_path / "memory.html"
    path.write_bytes(pickle.dumps(snapshot))
    # every file the command opens, seen by an audit hook
    code = textwrap.dedent(f"""
        import sys
        opened = set()
        sys.addaudithook(lambda event, args: opened.add(str(args[0])) if event == "open" else None)
        from unimem.cli.main import main
        status = main(["view", {str(path)!r}, "-o", {str(report)!r}])
        print(status, sorted(name for name in opened if name.startswith({str(tmp_path)!r})))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == f"0 {sorted([str(path), str(report)])}"
    page = page_text(report)
    assert f"f ({fifo}:3)" in page and f"g ({source}:3)" in page
    assert "not for the report" not in page


def test_run_report_writes_the_report_of_the_run(tmp_path):
    script = tmp_path / "work.py"
    script.write_text("import unimem\n"
                      "def make_buffer():\n"
                      "    return unimem.cpu.caching_allocator_alloc(5 << 20)\n"
                      "kept = make_buffer()\n")
    report = tmp_path / "memory.html"
    done = unimem_cli("run", "--report", str(report), str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    assert f"wrote {report}" in done.stderr
    page = page_text(report)
    assert f"make_buffer ({script}:3)" in page and "work.py (cpu device 0)" in page
    one_line_error(unimem_cli("run", "--report", str(tmp_path / "no" / "m.html"), str(script)), "cannot write")


def test_run_report_says_when_the_script_dropped_the_history(tmp_path):
    """PyTorch's recipe (record, work, _dump_snapshot, then
    _record_memory_history(enabled=None)) drops the history, the run's too:
    the report said "no history" and nothing told why."""
    script = tmp_path / "recipe.py"
    dumped = tmp_path / "own.pickle"
    script.write_text("import unimem\n"
                      "unimem.cpu._record_memory_history(max_entries=1000)\n"
                      "kept = unimem.cpu.caching_allocator_alloc(5 << 20)\n"
                      f"unimem.cpu._dump_snapshot({str(dumped)!r})\n"
                      "unimem.cpu._record_memory_history(enabled=None)\n")
    report = tmp_path / "memory.html"
    done = unimem_cli("run", "--report", str(report), str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    assert "the script stopped recording the memory history" in done.stderr
    assert "python -m unimem view" in done.stderr
    kept_recording = tmp_path / "keeps.py"
    kept_recording.write_text("import unimem\nkept = unimem.cpu.caching_allocator_alloc(5 << 20)\n")
    done = unimem_cli("run", "--report", str(report), str(kept_recording), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0 and "stopped recording" not in done.stderr, done.stderr


@pytest.mark.parametrize("child_ends", ["sys.exit(0)", "raise ValueError('child')", "pass"])
def test_a_child_the_script_forks_writes_no_report_and_no_summary(tmp_path, child_ends):
    """The child of a fork ended the script in unimem's runner, printed a
    second summary and wrote the report too: the file left was the child's
    (of the fork-time state), the parent's 64 MiB gone. The child now ends
    as under ``python script.py``: with its own status and nothing more."""
    script = tmp_path / "forks.py"
    marker = tmp_path / "child.done"
    script.write_text("import os, sys, time, unimem\n"
                      "pid = os.fork()\n"
                      "if pid == 0:\n"
                      f"    time.sleep(1.5); open({str(marker)!r}, 'w').close()\n"
                      f"    {child_ends}\n"
                      "else:\n"
                      "    kept = unimem.cpu.caching_allocator_alloc(64 << 20)\n"
                      "    def wait_for_the_child():\n"
                      "        os.waitpid(pid, 0)\n"
                      "    import atexit; atexit.register(wait_for_the_child)\n")
    report = tmp_path / "memory.html"
    done = unimem_cli("run", "--report", str(report), str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    assert done.stderr.count(f"wrote {report}") == 1, done.stderr
    assert done.stderr.count("memory summary") == 1, done.stderr
    assert "64.00 MiB" in page_text(report)


LINK = '<a href="https://evil.example/phish">Click to fix the OOM</a>'


def snapshot_naming(text):
    """A snapshot whose function name and segment type are ``text``."""
    frames = [{"filename": "/home/user/train.py", "line": 3, "name": text}]
    return {"segments": [{"device": 0, "address": 1 << 20, "total_size": 2 << 20, "stream": 0, "segment_type": text,
                          "frames": frames,
                          "blocks": [{"address": 1 << 20, "size": 512, "state": "active_allocated", "frames": frames},
                                     {"address": (1 << 20) + 512, "size": (2 << 20) - 512, "state": "inactive",
                                      "frames": []}]}],
            "device_traces": [[{"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0,
                                "time_us": 1, "frames": frames},
                               {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 2,
                                "frames": frames}]]}


def test_names_from_the_snapshot_reach_plotly_as_text():
    """Legend names and axis labels render Plotly's HTML subset, links
    included: a function name or segment type from the snapshot became a
    clickable link in the legend, the largest-live labels and the segment
    map's rows. Escaped now, as the hover texts were."""
    from unimem._observe.report import report_html
    page = report_html(snapshot_naming(LINK))
    as_plotly_reads_it = page.replace("\\u003c", "<").replace("\\u002f", "/").replace('\\"', '"')
    assert '<a href="https://evil.example' not in as_plotly_reads_it
    assert as_plotly_reads_it.count('&lt;a href="https://evil.example') >= 3     # legend, label, row


def test_no_link_from_the_snapshot_in_the_drawn_page(browser, tmp_path):
    """The same, as Chromium draws it: no link to the snapshot's address."""
    from unimem._observe.report import write_report
    path = tmp_path / "memory.html"
    write_report(snapshot_naming(LINK), path)
    report = OpenedReport(browser, path)
    try:
        links = report.page.evaluate("""() => Array.from(document.querySelectorAll('a')).map(
            a => a.getAttribute('href') || a.getAttribute('xlink:href') || '')""")
        assert not [link for link in links if "evil.example" in link]
        assert "Click to fix the OOM</a>" in report.page.inner_text("body")     # shown as the text it is
        assert report.console_errors == []
    finally:
        report.close()
