"""Seeing memory: the summary table, snapshots, history, OOM observers,
PyTorch's viewer on unimem snapshots, and Prometheus metrics."""
import os
import pickle
import subprocess
import sys

import numpy
import pytest

import unimem
from unimem import _core
from unimem._observe import history as _history
from unimem._observe.summary import format_count, format_size, memory_summary_table
from unimem.backends.simulated import SimulatedBackend
from tests.helpers.pytorch_summary import pytorch_memory_summary

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


@pytest.mark.parametrize("abbreviated", [False, True])
def test_summary_matches_pytorchs_table(abbreviated):
    stats = known_state().memory_stats()
    ours = memory_summary_table(stats, "GPU", 0, abbreviated).splitlines()
    theirs = pytorch_memory_summary(stats, abbreviated).splitlines()
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


def test_state_mode_keeps_frames_and_only_the_last_entry():
    """PyTorch's _record_memory_history: max_entries is 1 unless enabled == "all"."""
    unimem.cpu._record_memory_history("state", max_entries=100, clear_history=True)
    try:
        p = allocate_here(2048)
        s = unimem.cpu._snapshot()
        assert [(e["action"], e["addr"]) for e in s["device_traces"][0]] == [("alloc", p)]
        block = next(b for seg in s["segments"] for b in seg["blocks"] if b["address"] == p)
        assert block["frames"] and block["frames"][0]["name"] == "allocate_here"
        unimem.cpu.caching_allocator_delete(p)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def allocate_first(size):
    return unimem.cpu.caching_allocator_alloc(size)


def allocate_later(size):
    return unimem.cpu.caching_allocator_alloc(size)


def frames_of(snapshot, address):
    block = next(b for seg in snapshot["segments"] for b in seg["blocks"] if b["address"] == address)
    return [f["name"] for f in block["frames"]]


def test_disabling_drops_the_trace_and_reenabling_starts_fresh():
    """PyTorch's recordHistory clears the trace when disabled."""
    unimem.cpu._record_memory_history(clear_history=True)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(4096))
        assert unimem.cpu._snapshot()["device_traces"][0]
        unimem.cpu._record_memory_history(None)
        assert unimem.cpu._snapshot()["device_traces"][0] == []
        unimem.cpu._record_memory_history()
        p = allocate_here(4096)
        assert [e["action"] for e in unimem.cpu._snapshot()["device_traces"][0]] == ["alloc"]
        unimem.cpu.caching_allocator_delete(p)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_frames_of_memory_freed_while_history_was_off_are_dropped():
    """A block reallocated while history was paused must not
    show the stack of the freed allocation that had its address."""
    unimem.cpu._record_memory_history(clear_history=True)
    try:
        first = allocate_first(8192)
        unimem.cpu._record_memory_history(None)
        unimem.cpu.caching_allocator_delete(first)
        second = allocate_later(8192)
        assert second == first                    # best fit hands the same block back
        assert "allocate_first" not in frames_of(unimem.cpu._snapshot(), second)
        unimem.cpu._record_memory_history()
        assert "allocate_first" not in frames_of(unimem.cpu._snapshot(), second)
        unimem.cpu.caching_allocator_delete(second)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_frames_of_live_blocks_outlast_a_pause_without_frees():
    """As in PyTorch, a live block keeps the stack that allocated it after recording stops."""
    unimem.cpu._record_memory_history(clear_history=True)
    try:
        kept = allocate_first(8192)
        unimem.cpu._record_memory_history(None)
        assert frames_of(unimem.cpu._snapshot(), kept)[0] == "allocate_first"
        unimem.cpu._record_memory_history()
        assert frames_of(unimem.cpu._snapshot(), kept)[0] == "allocate_first"
        unimem.cpu.caching_allocator_delete(kept)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def release_cached_memory():
    unimem.cpu.empty_cache()


@pytest.mark.parametrize("context", ["state", "alloc", "all"])
def test_which_entries_carry_frames_follows_pytorchs_context(context):
    """PyTorch's RecordContext: "state" frames only on live blocks and
    segments; "alloc" also on entries (a free's entry with the allocating
    stack); "all" a free's entry with the freeing stack."""
    unimem.cpu.empty_cache()
    unimem.cpu._record_memory_history(context=context, clear_history=True)
    try:
        big = allocate_first(30 * MiB)                 # a segment of its own
        live = allocate_first(3000)
        s = unimem.cpu._snapshot()
        assert frames_of(s, live)[0] == "allocate_first"
        segment = next(seg for seg in s["segments"] if seg["address"] == big)
        assert segment["frames"][0]["name"] == "allocate_first"
        unimem.cpu.caching_allocator_delete(big)
        release_cached_memory()
        trace = unimem.cpu._snapshot()["device_traces"][0]
        names = {e["action"]: [f["name"] for f in e["frames"]] for e in trace if e.get("addr") == big}
        expected_alloc = [] if context == "state" else ["allocate_first"]
        assert names["alloc"][:1] == names["segment_alloc"][:1] == expected_alloc
        expected_free = {"state": [], "alloc": ["allocate_first"],
                         "all": ["test_which_entries_carry_frames_follows_pytorchs_context"]}[context]
        assert names["free_requested"][:1] == names["free_completed"][:1] == expected_free
        expected_segment_free = {"state": [], "alloc": ["allocate_first"],
                                 "all": ["release_cached_memory"]}[context]
        assert names["segment_free"][:1] == expected_segment_free
        unimem.cpu.caching_allocator_delete(live)
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


def test_dump_snapshot_takes_only_paths(tmp_path):
    """_dump_snapshot(1) once wrote the pickle to stdout and closed it."""
    code = (
        "import os, unimem\n"
        "for bad in (1, 2.5, None, [b'x']):\n"
        "    try:\n"
        "        unimem.cpu._dump_snapshot(bad)\n"
        "    except TypeError as e:\n"
        "        print('refused', type(bad).__name__)\n"
        "os.fstat(1)\n"
        "unimem.cpu._dump_snapshot(os.fsencode(os.path.join(%r, 'snap.pickle')))\n"
        "print('done')\n" % str(tmp_path)
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["refused", "int", "refused", "float", "refused", "NoneType",
                                            "refused", "list", "done"]
    assert (tmp_path / "snap.pickle").stat().st_size > 0


FORK_UNDER_HISTORY = """
import os, sys, threading, time
import unimem
from unimem._observe import history as _history

unimem.cpu._record_memory_history(max_entries=1000)
stop = False

def churn():
    while not stop:
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(4096))

# The history lock is held by the churning thread for most of its time: hold
# it longer at random moments so that forks land inside it.
original_frames = _history.python_frames
def slow_frames(limit=64):
    time.sleep(0.0005)
    return original_frames(limit)
_history.python_frames = slow_frames

thread = threading.Thread(target=churn, daemon=True)
thread.start()
children = []
for _ in range(40):
    time.sleep(0.002)
    pid = os.fork()
    if pid == 0:
        p = unimem.cpu.caching_allocator_alloc(8192)     # hangs if a lock stayed held
        unimem.cpu.caching_allocator_delete(p)
        unimem.cpu._snapshot()
        os._exit(0)
    children.append(pid)
for pid in children:
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
stop = True
print("all children exited")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_another_thread_is_in_the_history_hook():
    """History.lock was once not reset in a forked child."""
    done = subprocess.run([sys.executable, "-c", FORK_UNDER_HISTORY], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "all children exited" in done.stdout


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
    # Each is also the error PyTorch raises: its option checks a RuntimeError
    # (TORCH_CHECK), its size_t conversion a TypeError (pybind11).
    for bad, torchs in ((dict(enabled="yes"), RuntimeError), (dict(context="some"), RuntimeError),
                        (dict(stacks="cpp"), RuntimeError), (dict(skip_actions=["teleport"]), RuntimeError),
                        (dict(max_entries=-1), TypeError), (dict(max_entries=1 << 64), TypeError),
                        (dict(max_entries="10"), TypeError),
                        # pybind11's std::string conversion (these were only ValueError and RuntimeError)
                        (dict(enabled=123), TypeError), (dict(context=1), TypeError),
                        (dict(stacks=None), TypeError), (dict(enabled=b"all"), TypeError)):
        with pytest.raises(ValueError) as caught:
            unimem.cpu._record_memory_history(**bad)
        assert isinstance(caught.value, torchs), bad
    for bad in (dict(skip_actions="alloc"), dict(skip_actions=[["alloc"]])):
        with pytest.raises(TypeError, match="skip_actions must be a list of action names"):
            unimem.cpu._record_memory_history(**bad)


@pytest.mark.parametrize("max_entries, kept", [(0, 1), (1 << 63, 6), ((1 << 64) - 1, 6)])
def test_max_entries_is_a_size_t_as_in_pytorch(max_entries, kept):
    """PyTorch keeps max(1, max_entries) entries, any size_t; one past
    sys.maxsize used to be taken and then record nothing (the hook's deque
    refused it)."""
    unimem.cpu._record_memory_history(max_entries=max_entries, clear_history=True)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(100))
        unimem.cpu.caching_allocator_delete(allocate_here(100))
        actions = [e["action"] for e in unimem.cpu._snapshot()["device_traces"][0]]
        assert len(actions) == kept and actions[-1] == "free_completed"
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)


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
    numbas = unimem.cpu.caching_allocator(0).allocate(2 * MiB, 0, "numba")   # blocks of two clients
    with pytest.raises(unimem.OutOfMemoryError):
        allocate_here(1 << 52)
    s = recording._snapshot()
    # unimem's "client" key on blocks and on the block events of the trace, which the viewer reads past
    assert {b["client"] for seg in s["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"} \
        >= {"unimem", "numba"}
    assert {e.get("client") for e in s["device_traces"][0] if e["action"] == "alloc"} == {"unimem", "numba"}
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
    numbas.release()


# ---------------------------------------------------------------------------
# out-of-memory observers
# ---------------------------------------------------------------------------
def test_oom_observers_take_pytorchs_arguments():
    """PyTorch's observer signature: (device, alloc, device_allocated, device_free), ints."""
    seen = []

    def observer(device, alloc, device_allocated, device_free):
        seen.append((device, alloc, device_allocated, device_free, unimem.cpu.memory_allocated(0)))

    keep = allocate_here(3000)
    unimem.attach_out_of_memory_observer(observer)
    try:
        for _ in range(2):
            with pytest.raises(unimem.OutOfMemoryError):
                allocate_here(1 << 52)
        unimem.cpu.caching_allocator_delete(allocate_here(1))     # no OOM, no call
    finally:
        unimem.detach_out_of_memory_observer(observer)
        unimem.cpu.caching_allocator_delete(keep)
    assert len(seen) == 2
    for device, alloc, device_allocated, device_free, allocated_then in seen:
        assert all(type(v) is int for v in (device, alloc, device_allocated, device_free))
        assert device == 0 and alloc >= 1 << 52
        assert device_allocated == allocated_then >= 3072
        assert 0 <= device_free <= unimem.cpu.get_memory_info(0)[1]
    with pytest.raises(TypeError):
        unimem.attach_out_of_memory_observer("not callable")
    with pytest.raises(ValueError):
        unimem.detach_out_of_memory_observer(observer)


def test_oom_stats_observers_name_the_pool_and_see_its_statistics():
    seen = []

    def observer(device, requested, stats):
        seen.append((device, requested, stats["num_ooms"]))

    _history.attach_out_of_memory_stats_observer(observer)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(1))
        before = unimem.cpu.memory_stats(0)["num_ooms"]
        for _ in range(2):
            with pytest.raises(unimem.OutOfMemoryError):
                allocate_here(1 << 52)
    finally:
        _history.detach_out_of_memory_stats_observer(observer)
    assert seen == [(unimem.device("cpu", 0), 1 << 52, before + 1),
                    (unimem.device("cpu", 0), 1 << 52, before + 2)]
    with pytest.raises(TypeError):
        _history.attach_out_of_memory_stats_observer(42)


def test_a_failing_oom_observer_does_not_stop_the_others(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reported.append(args.exc_value))
    calls = []

    def failing(*args):
        calls.append("failing")
        raise ZeroDivisionError("observer bug")

    def working(*args):
        calls.append("working")

    unimem.attach_out_of_memory_observer(failing)
    unimem.attach_out_of_memory_observer(working)
    try:
        with pytest.raises(unimem.OutOfMemoryError):
            allocate_here(1 << 52)
    finally:
        unimem.detach_out_of_memory_observer(failing)
        unimem.detach_out_of_memory_observer(working)
    assert calls == ["failing", "working"]
    assert [type(e) for e in reported] == [ZeroDivisionError]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_an_oom_observer_goes_through_the_dispatcher(interrupt):
    """On unimem's side, Ctrl-C in an observer is not held back
    like an ordinary error, and stops the observers after it."""
    calls = []

    def interrupted(*args):
        calls.append("interrupted")
        raise interrupt()

    def after(*args):
        calls.append("after")

    allocator = unimem.cpu.caching_allocator(0)
    dispatcher = _history._OOMDispatcher("cpu", allocator)
    unimem.attach_out_of_memory_observer(interrupted)
    unimem.attach_out_of_memory_observer(after)
    try:
        with pytest.raises(interrupt):
            dispatcher(0, 1 << 52, 0, 0, 0)
    finally:
        unimem.detach_out_of_memory_observer(interrupted)
        unimem.detach_out_of_memory_observer(after)
    assert calls == ["interrupted"]


def test_ctrl_c_in_an_oom_observer_reaches_the_program():
    """Ctrl-C in an OOM observer, end to end (needs the core to let KeyboardInterrupt through)."""
    code = (
        "import unimem\n"
        "def observer(*args):\n"
        "    raise KeyboardInterrupt\n"
        "unimem.attach_out_of_memory_observer(observer)\n"
        "try:\n"
        "    unimem.cpu.caching_allocator_alloc(1 << 52)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "except MemoryError:\n"
        "    print('out of memory')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "interrupted", done.stderr


def test_ctrl_c_in_the_history_hook_reaches_the_program():
    """A KeyboardInterrupt raised while the history hook runs."""
    code = (
        "import unimem\n"
        "from unimem._observe import history as _history\n"
        "unimem.cpu._record_memory_history()\n"
        "def interrupting_frames(limit=64):\n"
        "    raise KeyboardInterrupt\n"
        "_history.python_frames = interrupting_frames\n"
        "try:\n"
        "    unimem.cpu.caching_allocator_alloc(4096)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "else:\n"
        "    print('swallowed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "interrupted", done.stderr


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
def _scrape():
    import prometheus_client

    import unimem.prometheus
    registry = prometheus_client.CollectorRegistry()
    unimem.prometheus.register(registry)
    return registry, {family.name: family for family in registry.collect()}


def test_prometheus_collector_exposes_every_statistic():
    p = unimem.cpu.caching_allocator_alloc(3000)
    try:
        registry, _ = _scrape()
        stats = unimem.cpu.memory_stats(0)
        cpu = {"device": "cpu:0"}
        assert registry.get_sample_value("unimem_allocated_bytes", {**cpu, "pool": "all"}) \
            == stats["allocated_bytes.all.current"] > 0
        assert registry.get_sample_value("unimem_reserved_bytes_peak", {**cpu, "pool": "small_pool"}) \
            == stats["reserved_bytes.small_pool.peak"]
        assert registry.get_sample_value("unimem_segment_allocated_total", {**cpu, "pool": "large_pool"}) \
            == stats["segment.large_pool.allocated"]
        assert registry.get_sample_value("unimem_requested_bytes_freed_total", {**cpu, "pool": "all"}) \
            == stats["requested_bytes.all.freed"]
        assert registry.get_sample_value("unimem_num_ooms_total", {**cpu, "pool": "all"}) == stats["num_ooms"]
        assert registry.get_sample_value("unimem_oversize_segments", {**cpu, "pool": "all"}) \
            == stats["oversize_segments.current"]
        # every statistic of the device is one sample: none dropped, none twice
        samples = [s for family in registry.collect() for s in family.samples if s.labels["device"] == "cpu:0"]
        assert len(samples) == len(stats)
        assert len({(s.name, tuple(sorted(s.labels.items()))) for s in samples}) == len(samples)
    finally:
        unimem.cpu.caching_allocator_delete(p)


def test_prometheus_types_and_names_follow_prometheus_naming():
    """Every family was a gauge with a ``metric`` label, counters included,
    and the pinned pool's timings were microseconds under a unit-less name:
    ``rate()`` and ``increase()`` need counters named ``_total``, and
    Prometheus' base unit of time is the second."""
    # A miss whatever earlier tests left cached (its timing is what is read):
    # the free segments go back first, and the request is one no leftover holds.
    unimem.host.empty_host_cache()
    pinned = unimem.host.caching_host_alloc(24 << 20)
    unimem.host.caching_host_delete(pinned)
    registry, families = _scrape()
    for name, family in families.items():
        assert name.startswith("unimem_") and "metric" not in {l for s in family.samples for l in s.labels}
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), name
        else:
            assert not name.endswith("_total"), name
    counters = {name for name, family in families.items() if family.type == "counter"}
    for name in ("num_ooms", "num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                 "num_host_alloc", "num_host_free", "allocated_bytes_allocated", "allocated_bytes_freed",
                 "reserved_bytes_allocated", "segment_freed", "requested_bytes_allocated"):
        assert f"unimem_{name}" in counters, name
    gauges = {name for name, family in families.items() if family.type == "gauge"}
    assert {"unimem_allocated_bytes", "unimem_allocated_bytes_peak", "unimem_reserved_bytes",
            "unimem_host_alloc_time_max_seconds"} <= gauges
    assert families["unimem_host_alloc_time_seconds"].type == "summary"
    host = unimem.host.host_memory_stats()
    labels = {"device": "host", "pool": "all"}
    assert registry.get_sample_value("unimem_host_alloc_time_seconds_count", labels) \
        == host["host_alloc_time.count"] >= 1
    assert registry.get_sample_value("unimem_host_alloc_time_seconds_sum", labels) \
        == pytest.approx(host["host_alloc_time.total"] / 1e6)
    assert registry.get_sample_value("unimem_host_alloc_time_max_seconds", labels) \
        == pytest.approx(host["host_alloc_time.max"] / 1e6)
    assert registry.get_sample_value("unimem_num_host_alloc_total", labels) == host["num_host_alloc"]
    assert registry.get_sample_value("unimem_allocated_bytes_peak", labels) == host["allocated_bytes.peak"]


def test_prometheus_text_parses_back_with_its_types():
    """What a Prometheus server reads: the exposition text, parsed back,
    gives the same families and types (a counter's ``_total`` samples)."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families
    registry, families = _scrape()
    parsed = {family.name: family.type for family in
              text_string_to_metric_families(prometheus_client.generate_latest(registry).decode())}
    assert parsed == {name: family.type for name, family in families.items()}


def test_the_legacy_bool_form_of_record_memory_history():
    """torch.cuda takes ``_record_memory_history(True, trace_alloc_max_entries=n)``
    (_record_memory_history_legacy), which older tutorials use; unimem
    refused it (ValueError for True, TypeError for the keyword)."""
    cpu = unimem.cpu
    try:
        cpu._record_memory_history(True, trace_alloc_max_entries=100, clear_history=True)
        for _ in range(3):
            cpu.caching_allocator_delete(allocate_here(1000))
        actions = [event["action"] for event in cpu._snapshot()["device_traces"][0]]
        assert actions.count("alloc") == 3 and actions.count("free_requested") == 3
        cpu._record_memory_history(False)
        cpu.caching_allocator_delete(allocate_here(1000))
        assert [e["action"] for e in cpu._snapshot()["device_traces"][0]] == []    # stopped, history dropped
        cpu._record_memory_history(True)        # the legacy default: one entry kept (PyTorch's "state")
        for _ in range(3):
            cpu.caching_allocator_delete(allocate_here(1000))
        assert len(cpu._snapshot()["device_traces"][0]) <= 1
        with pytest.raises(TypeError, match="trace_alloc_max_entries"):
            cpu._record_memory_history(True, trace_alloc_max_entries="many")
        with pytest.raises(TypeError, match="record_context"):
            cpu._record_memory_history(True, None)
    finally:
        cpu._record_memory_history(None, clear_history=True)


def test_augment_with_fx_traces_is_taken_as_torch_takes_it(tmp_path):
    """No torch.compile in unimem, so no FX frames to add: the argument is a
    bool with no effect (it was a TypeError, breaking calls ported as written)."""
    keep = allocate_here(1000)
    try:
        assert unimem.cpu._snapshot(augment_with_fx_traces=True)["segments"] == unimem.cpu._snapshot()["segments"]
        unimem.cpu._dump_snapshot(str(tmp_path / "s.pickle"), augment_with_fx_traces=False)
        assert (tmp_path / "s.pickle").stat().st_size > 0
        with pytest.raises(TypeError, match="augment_with_fx_traces must be a bool"):
            unimem.cpu._snapshot(augment_with_fx_traces="yes")
    finally:
        unimem.cpu.caching_allocator_delete(keep)


def test_code_in_a_folder_named_like_the_package_is_user_code():
    """unimem's own frames are left out of stacks by their folder: a folder
    whose path only starts with the package's (``.../unimem_experiments/``)
    is the user's, and keeps its frames (it lost them)."""
    import os
    from unimem._observe.history import is_unimem_code
    package = os.path.dirname(os.path.abspath(unimem.__file__))
    assert is_unimem_code(os.path.join(package, "_observe", "history.py"))
    assert not is_unimem_code(package + "_experiments" + os.sep + "train.py")
    assert not is_unimem_code(os.path.join(package, "cli", "demo.py"))     # an example program


@pytest.mark.parametrize("value", ["no", "False", [], [0]])
def test_clear_history_takes_what_a_pybind11_bool_takes(value):
    """A string or a list as clear_history was taken as its truth and
    dropped the recorded history ("no" cleared it); PyTorch's pybind11
    bool refuses them with a TypeError, and the history stays."""
    unimem.cpu._record_memory_history(max_entries=100, clear_history=True)
    try:
        unimem.cpu.caching_allocator_delete(allocate_here(100))
        kept = len(unimem.cpu._snapshot()["device_traces"][0])
        with pytest.raises(TypeError, match="clear_history"):
            unimem.cpu._record_memory_history(max_entries=100, clear_history=value)
        with pytest.raises(TypeError, match="clear_history"):
            unimem.cpu._record_memory_history(True, trace_alloc_max_entries=100, clear_history=value)
        assert len(unimem.cpu._snapshot()["device_traces"][0]) == kept > 0
        unimem.cpu._record_memory_history(max_entries=100, clear_history=None)    # None and numbers: as pybind11
        unimem.cpu._record_memory_history(max_entries=100, clear_history=numpy.bool_(False))
        assert len(unimem.cpu._snapshot()["device_traces"][0]) == kept
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)
