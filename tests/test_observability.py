"""Seeing memory: the summary table, snapshots, history, OOM observers,
PyTorch's viewer on unimem snapshots, and Prometheus metrics."""
import os
import pickle
import subprocess
import sys

import pytest

import unimem
from unimem import _core
from unimem._summary import format_count, format_size, memory_summary_table
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def known_state():
    """An allocator in a state that touches every row of the table."""
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 << 30), 0, max_split_size=100 * MiB)
    a.set_capacity(64 << 30)
    keep = [a.malloc(n) for n in (1, 700, 3 * 1024, 200 * 1024, 3 * MiB, 12 * MiB, 150 * MiB)]
    for _ in range(3):
        a.free(a.malloc(5 * MiB))
    a.free(keep.pop(2))
    with pytest.raises(unimem.OutOfMemoryError):
        a.malloc(1 << 50)
    return a


def torch_summary(stats):
    """PyTorch's own memory_summary, fed our statistics."""
    import torch.cuda.memory as tcm
    original = tcm.memory_stats
    tcm.memory_stats = lambda device=None: stats
    try:
        return tcm.memory_summary(0)
    finally:
        tcm.memory_stats = original


@pytest.mark.parametrize("abbreviated", [False, True])
def test_summary_matches_pytorchs_table(abbreviated):
    stats = known_state().memory_stats()
    ours = memory_summary_table(stats, "GPU", 0, abbreviated).splitlines()
    if abbreviated:
        import torch.cuda.memory as tcm
        original = tcm.memory_stats
        tcm.memory_stats = lambda device=None: stats
        try:
            theirs = tcm.memory_summary(0, abbreviated=True).splitlines()
        finally:
            tcm.memory_stats = original
    else:
        theirs = torch_summary(stats).splitlines()
    assert len(ours) == len(theirs)
    for i, (mine, torch_line) in enumerate(zip(ours, theirs)):
        assert len(mine) == 77, f"line {i} is {len(mine)} wide"
        if i in (1, 3):     # the title and the OOM line name the product
            continue
        assert mine == torch_line, f"line {i} differs:\n{mine}\n{torch_line}"


def test_summary_names_the_device_and_counts():
    a = known_state()
    text = memory_summary_table(a.memory_stats(), "XPU", 3)
    assert "unimem XPU memory summary, device ID 3" in text
    assert "XPU OOMs: 1" in text and "XPU reserved memory" in text and "Oversize XPU segments" in text
    assert "Non-releasable memory" in text and "from small pool" in text
    assert "from small pool" not in memory_summary_table(a.memory_stats(), "XPU", 3, abbreviated=True)
    empty = memory_summary_table({}, "CPU", 0)
    assert "Allocated memory" in empty and empty.count("\n") == 6 + 9 * 4 + 2 * 2 + 1


def test_size_and_count_units_switch_as_pytorchs():
    assert format_size(767 * 1024, 767 * 1024) == "785408 B  "
    assert format_size(768 * 1024, 768 * 1024) == "   768 KiB"
    assert format_size(768 * MiB, 768 * MiB) == "   768 MiB"
    assert format_size(5 * MiB, 768 * MiB) == "     5 MiB"      # the reference picks the unit
    assert format_count(749_999, 749_999) == " 749999   "
    assert format_count(750_000, 750_000) == "    750 K "
    assert format_count(750_000_000, 750_000_000) == "    750 M "


def test_namespaces_print_the_table():
    p = unimem.cpu.caching_allocator_alloc(10)
    text = unimem.cpu.memory_summary()
    assert "unimem CPU memory summary, device ID 0" in text and "CPU reserved memory" in text
    unimem.cpu.caching_allocator_delete(p)
    assert "unimem" in unimem.accelerator.memory_summary(abbreviated=True)


# ---------------------------------------------------------------------------
# snapshots and history
# ---------------------------------------------------------------------------
def allocate_here(size):
    return unimem.cpu.caching_allocator_alloc(size)


@pytest.fixture
def recording():
    """History on the cpu pool, cleared before and switched off after."""
    unimem.cpu._record_memory_history(clear_history=True)
    yield unimem.cpu
    unimem.cpu._record_memory_history(None, clear_history=True)


def test_snapshot_schema(recording):
    keep = allocate_here(1000)
    big = allocate_here(3 * MiB)
    unimem.cpu.caching_allocator_delete(big)
    s = recording._snapshot()
    assert set(s) >= {"segments", "device_traces"}
    assert isinstance(s["device_traces"], list) and len(s["device_traces"]) == unimem.cpu.device_count()
    states = set()
    for seg in s["segments"]:
        for key, kind in (("device", int), ("address", int), ("total_size", int), ("allocated_size", int),
                          ("active_size", int), ("requested_size", int), ("stream", int),
                          ("segment_type", str), ("blocks", list), ("frames", list)):
            assert isinstance(seg[key], kind), key
        assert seg["segment_type"] in ("small", "large")
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        for b in seg["blocks"]:
            assert set(b) >= {"address", "size", "requested_size", "state", "frames"}
            states.add(b["state"])
    assert states <= {"active_allocated", "active_pending_free", "inactive"}
    block = next(b for seg in s["segments"] for b in seg["blocks"] if b["address"] == keep)
    assert block["state"] == "active_allocated" and block["requested_size"] == 1000
    assert block["frames"][0]["name"] == "allocate_here"
    assert block["frames"][1]["name"] == "test_snapshot_schema"
    actions = [e["action"] for e in s["device_traces"][0]]
    assert "segment_alloc" in actions and actions.count("alloc") == 2
    assert actions[-2:] == ["free_requested", "free_completed"]
    for e in s["device_traces"][0]:
        assert set(e) >= {"action", "addr", "size", "stream", "time_us", "frames"}
    unimem.cpu.caching_allocator_delete(keep)


def test_history_is_a_ring_of_max_entries():
    unimem.cpu._record_memory_history(max_entries=10, clear_history=True)
    try:
        ptrs = [allocate_here(512) for _ in range(20)]
        trace = unimem.cpu._snapshot()["device_traces"][0]
        assert len(trace) == 10 and all(e["action"] == "alloc" for e in trace)
        assert trace[-1]["addr"] == ptrs[-1]
        for p in ptrs:
            unimem.cpu.caching_allocator_delete(p)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_state_mode_keeps_frames_but_no_trace():
    unimem.cpu._record_memory_history("state", clear_history=True)
    try:
        p = allocate_here(2048)
        s = unimem.cpu._snapshot()
        assert s["device_traces"][0] == []
        block = next(b for seg in s["segments"] for b in seg["blocks"] if b["address"] == p)
        assert block["frames"] and block["frames"][0]["name"] == "allocate_here"
        unimem.cpu.caching_allocator_delete(p)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_context_none_and_skip_actions():
    unimem.cpu._record_memory_history(context=None, skip_actions=["free_requested"], clear_history=True)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(4096))
        trace = unimem.cpu._snapshot()["device_traces"][0]
        assert [e["action"] for e in trace] == ["alloc", "free_completed"]
        assert all(e["frames"] == [] for e in trace)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_recording_stops_and_bad_arguments_are_errors():
    unimem.cpu._record_memory_history(clear_history=True)
    unimem.cpu._record_memory_history(None)
    unimem.cpu.caching_allocator_delete(allocate_here(100))
    assert unimem.cpu._snapshot()["device_traces"][0] == []
    for bad in (dict(enabled="yes"), dict(context="some"), dict(stacks="cpp"), dict(max_entries=0),
                dict(skip_actions=["teleport"])):
        with pytest.raises(ValueError):
            unimem.cpu._record_memory_history(**bad)


def test_dump_snapshot_round_trips(tmp_path, recording):
    p = allocate_here(777)
    path = tmp_path / "snap.pickle"
    recording._dump_snapshot(str(path))
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert any(b["address"] == p for s in loaded["segments"] for b in s["blocks"])
    unimem.cpu.caching_allocator_delete(p)


def test_pytorchs_viewer_renders_a_unimem_snapshot(tmp_path, recording):
    from torch.cuda import _memory_viz as viz      # torch==2.13.0 is in the test extra
    keep = [allocate_here(n) for n in (100, 5000, 3 * MiB, 25 * MiB)]
    unimem.cpu.caching_allocator_delete(keep.pop(1))
    with pytest.raises(unimem.OutOfMemoryError):
        allocate_here(1 << 52)
    s = recording._snapshot()
    plain = lambda lines: lines  # noqa: E731 - no flamegraph.pl download
    text = viz.segsum(s)
    assert f"segments: {len(s['segments'])}" in text
    trace = viz.trace(s)
    assert trace.count("cudaMalloc(") == sum(e["action"] == "segment_alloc" for e in s["device_traces"][0])
    assert "raise OutOfMemoryError" in trace
    assert "stream_0" in viz.segments(s, format_flamegraph=plain)
    assert "allocate_here" in viz.memory(s, format_flamegraph=plain)
    assert viz.compare(s["segments"], s["segments"], format_flamegraph=plain) == ""
    for html in (viz.trace_plot(s), viz.trace_plot(s, plot_segments=True), viz.segment_plot(s),
                 viz.trace_plot(s, filter_freed=True)):
        assert "MemoryViz.js" in html and len(html) > 1000
    path = tmp_path / "snap.pickle"
    recording._dump_snapshot(str(path))
    for command in (["stats", str(path)], ["trace", str(path)]):
        done = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz"] + command,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    for p in keep:
        unimem.cpu.caching_allocator_delete(p)


# ---------------------------------------------------------------------------
# out-of-memory observers
# ---------------------------------------------------------------------------
def test_oom_observers_run_once_per_oom():
    seen = []

    def observer(device, requested, stats):
        seen.append((device, requested, stats["num_ooms"]))

    unimem.attach_out_of_memory_observer(observer)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(1))
        before = unimem.cpu.memory_stats(0)["num_ooms"]
        for _ in range(2):
            with pytest.raises(unimem.OutOfMemoryError):
                allocate_here(1 << 52)
        unimem.cpu.caching_allocator_delete(allocate_here(1))     # no OOM, no call
    finally:
        unimem.detach_out_of_memory_observer(observer)
    assert seen == [(unimem.device("cpu", 0), 1 << 52, before + 1),
                    (unimem.device("cpu", 0), 1 << 52, before + 2)]
    with pytest.raises(TypeError):
        unimem.attach_out_of_memory_observer("not callable")


def test_oom_snapshot_is_written(tmp_path):
    path = tmp_path / "oom.pickle"
    code = (
        "import unimem\n"
        "unimem.cpu._record_memory_history()\n"
        "p = unimem.cpu.caching_allocator_alloc(4096)\n"
        "try:\n"
        "    unimem.cpu.caching_allocator_alloc(1 << 52)\n"
        "except unimem.OutOfMemoryError:\n"
        "    print('raised')\n"
    )
    env = dict(os.environ, UNIMEM_OOM_SNAPSHOT=str(path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "raised" in done.stdout, done.stderr
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    trace = snapshot["device_traces"][0]
    assert trace[-1]["action"] == "oom" and trace[-1]["size"] == 1 << 52 and "device_free" in trace[-1]
    assert any(b["state"] == "active_allocated" for s in snapshot["segments"] for b in s["blocks"])


# ---------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------
def test_prometheus_collector_exposes_every_statistic():
    import prometheus_client

    import unimem.prometheus
    p = unimem.cpu.caching_allocator_alloc(3000)
    registry = prometheus_client.CollectorRegistry()
    unimem.prometheus.register(registry)
    text = prometheus_client.generate_latest(registry).decode()
    allocated = unimem.cpu.memory_stats(0)["allocated_bytes.all.current"]
    assert f'unimem_allocated_bytes{{device="cpu:0",metric="current",pool="all"}} {float(allocated)}' in text
    assert 'unimem_num_ooms{device="cpu:0",metric="value",pool=""}' in text
    assert 'unimem_reserved_bytes{device="cpu:0",metric="peak",pool="small_pool"}' in text
    names = {line.split("{")[0] for line in text.splitlines() if line.startswith("unimem_")}
    for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes", "num_alloc_retries",
                 "num_device_alloc", "oversize_segments", "max_split_size"):
        assert f"unimem_{name}" in names
    unimem.cpu.caching_allocator_delete(p)
