"""Hostile and malformed snapshot files: ``load_snapshot`` refuses them in one
line (a :class:`SnapshotError`) and ``python -m unimem plot`` never opens a
path a snapshot names unless asked for source lines.

The commands that a regression could make read without end or block run in a
subprocess with a memory limit and a timeout, so a failure cannot eat the machine.
"""
import copy
import io
import math
import os
import pickle
import stat
import struct
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tests.helpers import REPO_ROOT

from unimem._observe import plot, timeline
from unimem._observe.snapshot_file import MAX_SOURCE_BYTES, SnapshotError, load_snapshot, read_source_line
from unimem.cli.main import main as cli_main

MEMORY_LIMIT = 2 << 30        # the plot of a small snapshot needs well under 1 GiB of address space
TIMEOUT_S = 120


LIBRARY_FILE = "/opt/env/lib/python3.11/site-packages/dpnp/dpnp_array.py"


def frame(filename, line=3, name="step"):
    return {"filename": filename, "line": line, "name": name}


def valid_snapshot(filename="/home/someone/train.py"):
    """A small snapshot of PyTorch's format with history: two segments, an
    allocation that lives, one that is freed, an out-of-memory error; the
    innermost frames an array library's, as when dpnp allocates."""
    frames = [frame(LIBRARY_FILE, 120, "empty"), frame(filename, 7, "step"),
              frame("/home/someone/main.py", 2, "<module>")]
    return {
        "segments": [
            {"device": 0, "address": 1 << 20, "total_size": 2 << 20, "allocated_size": 512, "active_size": 512,
             "requested_size": 500, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
             "is_expandable": False, "frames": frames,
             "blocks": [{"address": 1 << 20, "size": 512, "requested_size": 500, "state": "active_allocated",
                         "frames": frames},
                        {"address": (1 << 20) + 512, "size": (2 << 20) - 512, "requested_size": 0,
                         "state": "inactive", "frames": []}]},
            {"device": 0, "address": 8 << 20, "total_size": 20 << 20, "allocated_size": 0, "active_size": 0,
             "stream": 0, "segment_type": "large", "frames": [],
             "blocks": [{"address": 8 << 20, "size": 20 << 20, "state": "inactive", "frames": []}]},
        ],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0, "time_us": 10, "frames": frames},
            {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 11, "frames": frames},
            {"action": "alloc", "addr": 8 << 20, "size": 4 << 20, "stream": 0, "time_us": 12,
             "frames": [frame("/home/someone/data.py", 40, "load")]},
            {"action": "free_requested", "addr": 8 << 20, "size": 4 << 20, "stream": 0, "time_us": 13, "frames": []},
            {"action": "free_completed", "addr": 8 << 20, "size": 4 << 20, "stream": 0, "time_us": 14,
             "frames": [frame("/home/someone/data.py", 40, "load")]},
            {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0, "time_us": 15, "frames": frames,
             "compile_context": None},
        ]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "pool": "device"},
    }


def write(tmp_path, snapshot, name="snapshot.pickle", protocol=pickle.HIGHEST_PROTOCOL):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snapshot, protocol=protocol))
    return path


# A small process between the test and the command: Linux carries a process's
# peak resident memory across fork and exec (the forked copy starts with its
# parent's), so the command is forked from this small one, not from pytest
# (hundreds of MiB by then), and its own peak is what wait4 reports.
MEASURE = r"""
import os, resource, signal, sys
limit, args = int(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(sys.executable, [sys.executable] + args)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\nPEAK_KIB={usage.ru_maxrss}\n")
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def plot_cli(*args):
    """``python -m unimem plot ARGS`` with a memory limit and a timeout (a
    regression fails the test instead of eating memory or hanging); the
    result has the command's peak resident memory as ``peak_mib``."""
    child = subprocess.Popen([sys.executable, "-c", MEASURE, str(MEMORY_LIMIT), "-m", "unimem", "plot",
                              *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=str(REPO_ROOT), start_new_session=True, text=True)
    try:
        out, err = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)                 # the measuring process and the command
        out, err = child.communicate()
    err, _, peak = err.rpartition("\nPEAK_KIB=")
    done = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    done.peak_mib = int(peak) / 1024 if peak.strip().isdigit() else float("inf")
    return done


def drew(done, png):
    """The plot succeeded, within a plot's memory (reading /dev/zero took
    all that the limit allowed, then went on without the line)."""
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.peak_mib < 512, f"plot used {done.peak_mib:.0f} MiB"
    assert png.stat().st_size > 0


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("usage:")]


def refused_in_one_line(done, *needed):
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    for text in needed:
        assert text in lines[0], (text, lines[0])


# --- paths named in a snapshot ---------------------------------------------
@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo.py"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("named", ["/dev/zero", "fifo"])
def test_plot_opens_no_path_a_snapshot_names(tmp_path, fifo, named):
    """A frame naming /dev/zero made plot read until memory
    ran out, one naming a FIFO blocked forever; without --source-lines no
    path in the snapshot is opened, and the frame shows file:line function."""
    filename = str(fifo) if named == "fifo" else named
    path = write(tmp_path, valid_snapshot(filename))
    drew(plot_cli(path, "-o", tmp_path / "out.png"), tmp_path / "out.png")


@pytest.mark.parametrize("named", ["/dev/zero", "fifo", "/dev/null", "a folder"])
def test_source_lines_read_only_regular_files(tmp_path, fifo, named):
    """With --source-lines a device, a FIFO or a folder a frame names is not
    read (nor blocks): the frame shows its function instead."""
    filename = {"fifo": str(fifo), "a folder": str(tmp_path)}.get(named, named)
    path = write(tmp_path, valid_snapshot(filename))
    drew(plot_cli(path, "--source-lines", "-o", tmp_path / "out.png"), tmp_path / "out.png")
    assert read_source_line(filename, 1) == ""
    assert plot._site([frame(filename, 1, "step")], source_lines=True) == f"{os.path.basename(filename)}:1 step"


def test_source_lines_show_the_line_of_a_regular_file(tmp_path):
    source = tmp_path / "train.py"
    source.write_text("import unimem\nloss = model(batch)  # the line\n")
    assert read_source_line(str(source), 2) == "loss = model(batch)  # the line"
    assert plot._site([frame(str(source), 2, "step")], source_lines=True) == "train.py:2 loss = model(batch)  # the line"
    assert plot._site([frame(str(source), 2, "step")]) == "train.py:2 step"
    for line in (0, -1, 3, 10**30, None):
        assert read_source_line(str(source), line) == ""
    assert read_source_line(str(tmp_path / "missing.py"), 1) == ""
    assert read_source_line("nul\0in a name", 1) == ""
    drew(plot_cli(write(tmp_path, valid_snapshot(str(source))), "--source-lines", "-o", tmp_path / "out.png"),
         tmp_path / "out.png")


def test_source_lines_read_at_most_the_cap(tmp_path):
    """A regular file larger than MAX_SOURCE_BYTES is read only up to the cap:
    lines past it are not shown."""
    source = tmp_path / "huge.py"
    line = "x = 1\n"
    count = MAX_SOURCE_BYTES // len(line) * 3
    source.write_text(line * count)
    assert read_source_line(str(source), 1) == "x = 1"
    assert read_source_line(str(source), MAX_SOURCE_BYTES // len(line)) == "x = 1"
    assert read_source_line(str(source), count) == ""


def test_plot_help_documents_source_lines():
    done = subprocess.run([sys.executable, "-m", "unimem", "plot", "--help"], capture_output=True, text=True,
                          cwd=str(REPO_ROOT), timeout=TIMEOUT_S)
    assert "--source-lines" in done.stdout and "regular files" in done.stdout


# --- malformed snapshots ---------------------------------------------------
def _nested_list_pickle(depth):
    """A pickle of ``[[[...]]]`` ``depth`` deep, built opcode by opcode
    (pickle.dumps itself would recurse): EMPTY_LIST, then APPENDs."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _with(mutate, protocol=pickle.DEFAULT_PROTOCOL):
    snapshot = valid_snapshot()
    mutate(snapshot)
    return pickle.dumps(snapshot, protocol=protocol)


def _set(path, value):
    def mutate(snapshot):
        node = snapshot
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _drop(path):
    def mutate(snapshot):
        node = snapshot
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def _pool_nested(depth):
    """The valid snapshot with its pool's name swapped for ``[[[...]]]``
    ``depth`` deep (protocol 2, which has no frame lengths to keep right)."""
    placeholder = b"X" + struct.pack("<I", 8) + b"__DEEP__"        # BINUNICODE "__DEEP__"
    content = _with(_set(("allocator_settings", "pool"), "__DEEP__"), protocol=2)
    assert content.count(placeholder) == 1
    return content.replace(placeholder, b"]" * depth + b"a" * (depth - 1))


BLOCK = ("segments", 0, "blocks", 1)
EVENT = ("device_traces", 0, 2)
HOSTILE = {
    "a second frame without filename": (_with(_set(("device_traces", 0, 1, "frames"),
                                                   [frame("/home/someone/train.py"), {"line": 2, "name": "f"}])),
                                        "device 0 event 1 frame 1 has no 'filename'"),
    "a size of 10**400": (_with(_set(("device_traces", 0, 1, "size"), 10**400)), "'size' is above"),
    "a negative size": (_with(_set(BLOCK + ("size",), -1)), "'size' is below 0"),
    "an address of 2**64": (_with(_set(("segments", 1, "address"), 2**64)), "segment 1 'address' is above"),
    "a line that is a string": (_with(_set(EVENT + ("frames", 0, "line"), "40")), "'line' is a str"),
    "a filename that is bytes": (_with(_set(BLOCK[:2] + ("frames", 0, "filename"), b"x")), "'filename' is a bytes"),
    "a frame that is a list": (_with(_set(("segments", 0, "frames", 2), ["a.py", 1, "f"])), "frame 2 is a list"),
    "a state that is None": (_with(_set(BLOCK + ("state",), None)), "'state' is None"),
    "a size that is a bool": (_with(_set(EVENT + ("size",), True)), "'size' is a bool"),
    "a time that is NaN": (_with(_set(EVENT + ("time_us",), math.nan)), "not finite"),
    "a time that is infinite": (_with(_set(EVENT + ("time_us",), math.inf)), "not finite"),
    "a pool that is a dict": (_with(_set(("allocator_settings", "pool"), {})), "'pool' is a dict"),
    "an action that is an int": (_with(_set(EVENT + ("action",), 1)), "'action' is an int"),
    "an alloc without addr": (_with(_drop(("device_traces", 0, 1, "addr"))), "has no 'addr'"),
    # view read these two without the schema's check (TypeError, KeyError)
    "a pool id that is an int": (_with(_set(("segments", 0, "segment_pool_id"), 5)),
                                 "segment 0 'segment_pool_id' is an int"),
    "a pool id that is negative": (_with(_set(("segments", 0, "segment_pool_id"), (0, -1))),
                                   "'segment_pool_id' item 1 is below 0"),
    # unimem's "client" (who a block is for) is a name, or None for a free block
    "a block's client that is an int": (_with(_set(BLOCK + ("client",), 3)), "'client' is an int"),
    "an event's client that is a list": (_with(_set(EVENT + ("client",), ["cupy"])), "'client' is a list"),
    "a free_requested without size": (_with(_drop(("device_traces", 0, 3, "size"))), "event 3 has no 'size'"),
    "a pool nested 100,000 lists deep": (_pool_nested(100_000), "deep"),
    "a file of lists nested 200,000 deep": (_nested_list_pickle(200_000), "deep"),
}


def test_the_deep_case_is_what_it_says():
    pool = pickle.loads(HOSTILE["a pool nested 100,000 lists deep"][0])["allocator_settings"]["pool"]
    with pytest.raises(RecursionError):
        repr(pool)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_snapshot_is_refused_in_one_line(tmp_path, case):
    """A second frame without filename was KeyError, a
    size of 10**400 OverflowError, a nested pool RecursionError; every part
    of the snapshot is checked before plot uses any of it."""
    content, says = HOSTILE[case]
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as refused:
        load_snapshot(path)
    assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    refused_in_one_line(plot_cli(path, "-o", tmp_path / "out.png"), "bad.pickle", says)
    assert not (tmp_path / "out.png").exists()
    err = io.StringIO()
    with redirect_stderr(err):
        status = cli_main(["view", str(path), "-o", str(tmp_path / "out.html")])
    assert status == 2 and len(error_lines(err.getvalue())) == 1, err.getvalue()
    assert says in err.getvalue()


def test_a_snapshot_that_shared_references_blow_up_is_refused(tmp_path):
    """A few KiB of pickle whose lists hold the same list again and again
    (a 'billion laughs') would take plot years to walk: it is refused."""
    frames = [frame("/home/someone/train.py")] * 1000
    events = [{"action": "alloc", "addr": 0, "size": 512, "frames": frames}] * 1000
    path = write(tmp_path, {"segments": [], "device_traces": [events] * 1000})
    assert path.stat().st_size < 16 << 10
    with pytest.raises(SnapshotError, match="shared"):
        load_snapshot(path)


def test_pytorch_and_unimem_snapshots_still_load_and_plot(tmp_path):
    """Optional keys stay optional: PyTorch's full format (every key of
    torch.cuda.memory._snapshot), a minimal one, and a memory_snapshot() list."""
    full = valid_snapshot()
    full["device_traces"][0][1].update(compile_context="", user_metadata="", client="cupy")
    full["segments"][0]["blocks"][0]["client"] = None                      # unimem's key on a free block
    full["segments"][0]["frames"].append({"filename": "/opt/torch/csrc/x.cpp", "line": 0, "name": "c10::alloc"})
    minimal = {"segments": [{"address": 0, "total_size": 512, "segment_type": "small",
                             "blocks": [{"size": 512, "state": "inactive"}]}]}
    for snapshot in (full, minimal, full["segments"]):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            loaded = load_snapshot(write(tmp_path, snapshot, protocol=protocol))
            assert loaded == (snapshot if isinstance(snapshot, dict) else {"segments": snapshot, "device_traces": []})
    drew(plot_cli(write(tmp_path, full), "-o", tmp_path / "out.png"), tmp_path / "out.png")


def test_names_with_dollar_signs_are_drawn_as_they_are(tmp_path):
    """Text between two $ is TeX to matplotlib: a pool, segment type, file or
    function named "$\\frac{$" made plot fail with a parse error."""
    snapshot = valid_snapshot("/home/someone/$\\frac{$.py")
    snapshot["allocator_settings"]["pool"] = snapshot["segments"][0]["segment_type"] = "$\\frac{$"
    snapshot["device_traces"][0][2]["frames"] = [frame("/home/someone/data.py", 40, "$\\frac{$")]
    drew(plot_cli(write(tmp_path, snapshot), "-o", tmp_path / "out.png"), tmp_path / "out.png")


# --- any mutation of a valid snapshot -------------------------------------------
HOSTILE_VALUES = [None, True, 0, -1, 1.5, math.nan, -math.inf, 2**64, 10**400, -(10**400), 10**400, "", "x", b"x",
                  [], {}, (), [[]], {"filename": 1}, ("a.py", 1, "f"), "/dev/zero", r"$\frac{$ \x00"]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _paths(value, prefix + (index,))


@st.composite
def mutated_snapshots(draw):
    """A valid snapshot with one to three things changed anywhere in it: a
    key dropped, a value swapped for a hostile one, an item appended."""
    snapshot = copy.deepcopy(valid_snapshot())
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(sorted(_paths(snapshot), key=repr)))
        parent = snapshot
        for key in path[:-1]:
            parent = parent[key]
        target = parent[path[-1]] if path else snapshot
        how = draw(st.sampled_from(["drop", "swap", "swap", "append"]))
        value = copy.deepcopy(draw(st.sampled_from(HOSTILE_VALUES)))     # never the shared one
        if how == "append" and isinstance(target, list):
            target.append(value)
        elif how == "append" and isinstance(target, dict):
            target[draw(st.sampled_from(["size", "addr", "frames", "line", "filename", "extra"]))] = value
        elif not path:
            snapshot = value
        elif isinstance(parent, tuple):         # segment_pool_id: left as it is
            continue
        elif how == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    return snapshot, draw(st.integers(0, pickle.HIGHEST_PROTOCOL))


def _load_or_refuse(tmp_path, snapshot, protocol):
    path = write(tmp_path, snapshot, "mutated.pickle", protocol)
    try:
        loaded = load_snapshot(path)
    except SnapshotError as exc:
        assert "\n" not in str(exc)
        event("refused")
        return path, None
    assert isinstance(loaded, dict)
    event("loaded")
    return path, loaded


FRAME_VALUES = st.sampled_from(HOSTILE_VALUES + [7, -(2**63), 2**64 - 1, 3.0, "train.py", "step"])


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(st.one_of(st.dictionaries(st.sampled_from(["filename", "line", "name", "x"]), FRAME_VALUES),
                                 st.fixed_dictionaries({"filename": FRAME_VALUES, "line": FRAME_VALUES,
                                                        "name": FRAME_VALUES}),
                                 FRAME_VALUES), max_size=4))
def test_the_bulk_frame_check_accepts_nothing_the_schema_refuses(frames):
    """Frames are checked all at once in C loops, and by the schema only
    when that check fails: it may be stricter than the schema, never laxer."""
    from unimem._observe.snapshot_file import _frames_fit, _validators
    if _frames_fit(frames):
        _validators()[1](frames)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated=mutated_snapshots())
def test_load_snapshot_returns_or_refuses_any_mutation(tmp_path, mutated):
    _load_or_refuse(tmp_path, *mutated)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated=mutated_snapshots(), source_lines=st.booleans())
def test_plot_of_any_mutation_draws_or_refuses_in_one_line(tmp_path, mutated, source_lines):
    path, loaded = _load_or_refuse(tmp_path, *mutated)
    out, err = io.StringIO(), io.StringIO()
    argv = ["plot", str(path), "-o", str(tmp_path / "out.png")] + (["--source-lines"] if source_lines else [])
    with redirect_stdout(out), redirect_stderr(err):
        status = cli_main(argv)
    assert status == (0 if loaded is not None else 2), err.getvalue()
    assert len(error_lines(err.getvalue())) == (0 if status == 0 else 1), err.getvalue()
    if status == 0:
        assert stat.S_ISREG(os.stat(tmp_path / "out.png").st_mode)


def test_names_python_could_not_decode_are_drawn_as_their_escapes(tmp_path):
    """A script named in Latin-1 ("café.py") is recorded as 'caf\\udce9.py'
    (a lone surrogate): plot raised inside matplotlib, and view and
    run --report failed half-way, leaving a 0-byte file where the last
    report was. Both now draw the escape."""
    snapshot = valid_snapshot(filename="/home/someone/caf\udce9.py")
    snapshot["allocator_settings"]["pool"] = "cpu\udce9"
    path = write(tmp_path, snapshot)
    for command, out in (("plot", tmp_path / "out.png"), ("view", tmp_path / "out.html")):
        out.write_text("the last report")
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            assert cli_main([command, str(path), "-o", str(out)]) == 0, err.getvalue()
        assert out.stat().st_size > 1000
    assert "caf\\udce9.py" in (tmp_path / "out.html").read_text(encoding="utf-8")


def test_a_long_name_shared_by_every_frame_does_not_blow_the_report_up(tmp_path):
    """A 10,000-character file name, shared by reference by the 16 frames
    of 2,000 blocks and their trace entries: a 140 KB pickle made a 362 MB
    report (2.2 GB of memory) when every hover repeated the name whole."""
    name = "/x/" + "a" * 10_000 + ".py"
    frames = [frame(name, 1, "f" * 10_000)] * 16
    blocks = [{"address": 4096 + 512 * k, "size": 512, "state": "active_allocated", "frames": frames}
              for k in range(2000)]
    snapshot = {"segments": [{"address": 4096, "total_size": 512 * 2000, "segment_type": "s" * 10_000,
                              "blocks": blocks}],
                "device_traces": [[{"action": "alloc", "addr": 4096 + 512 * k, "size": 512, "time_us": k,
                                    "frames": frames} for k in range(2000)]]}
    path = write(tmp_path, snapshot)
    assert path.stat().st_size < 200_000
    out = tmp_path / "out.html"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert cli_main(["view", str(path), "-o", str(out)]) == 0
    assert out.stat().st_size < 40_000_000          # it was 362 MB
    page = out.read_text(encoding="utf-8")
    assert "a" * (timeline.MAX_NAME + 1) not in page and "s" * (timeline.MAX_NAME + 1) not in page


def test_a_long_name_is_cut_in_the_plot():
    assert len(plot._literal("x" * 200_000)) == timeline.MAX_NAME
    assert plot._literal("a$b\udce9") == "a\\$b\\udce9"
