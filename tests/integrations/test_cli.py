"""python -m unimem: every subcommand, its exit code and the files it writes."""
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
from tests.helpers.cli import ROOT, WORKLOAD, one_line_error, unimem_cli


def check_png(path, width=1200, height=900):
    import matplotlib.image
    import numpy as np
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (height, width), image.shape
    pixels = image[..., :3].reshape(-1, 3)
    colours = np.unique((pixels * 255).astype(np.uint8), axis=0)
    assert len(colours) > 20, "the picture is (nearly) blank"
    non_white = (pixels < 0.95).any(axis=1).mean()
    assert non_white > 0.05, f"only {non_white:.1%} of the picture is drawn"


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = unimem_cli("demo", "--steps", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_demo_trains_reports_and_writes_files(demo_output):
    out, text = demo_output
    for needed in ("unimem demo: a 512-1024-256-10 MLP, 12 training steps", "the same training code twice",
                   "memory summary", "served from the pool:", "cache hit rate:", "training, 6 rounds",
                   "allocation alone", "out of memory", "where the training times differ", "page faults",
                   "snapshot.pickle", "timeline.png", "memory.html", "round 6/6, steps 11-12"):
        assert needed in text, needed
    losses = re.search(r"\(losses (\S+) / (\S+)\)", text)
    assert losses and losses[1] == losses[2], "the same code and seed with either allocator: the same loss"
    with open(out / "snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert any(e["action"] == "oom" for trace in snapshot["device_traces"] for e in trace)
    check_png(out / "timeline.png")
    page = (out / "memory.html").read_text(encoding="utf-8")
    assert "Plotly" in page and "<script src=" not in page, "the report's JavaScript is inline"


def test_demo_pooled_run_takes_every_array_from_the_pool(demo_output):
    """With dpnp, the hook's counters: every array of the pooled run (results
    of operations included) came from the pool, and those are the requests
    the pool's statistics and its recorded history saw."""
    out, text = demo_output
    if "dpnp on XPU" not in text:
        pytest.skip("the demo ran on no SYCL device: no allocator hook to count")
    served = re.search(r"served from the pool: 100\.0% of dpnp's array allocations \((\d+) of (\d+), "
                       r"results of operations included\) and 100\.0% of their bytes", text)
    assert served, text
    pooled = int(served[1])
    assert pooled == int(served[2]) > 12 * 10          # some ten arrays a step, not just the inputs
    assert re.search(rf"of {pooled} requests served from the cache", text), "the pool's statistics differ"
    with open(out / "snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    assert len(allocs) == pooled
    step_lines = {frame["line"] for e in allocs for frame in e["frames"] if frame["name"] == "training_step"}
    assert len(step_lines) > 5, "the operations' results are recorded at the training step's lines"


# "<pooled> is faster than X: 1.08x as fast (median of 6 rounds; range 1.02x to 1.15x)", or slower, or
# no clear difference (the range straddles 1), or too few rounds: the verdict of paired rounds.
VERDICT = (r"(?:(?P<faster>{pooled} is faster than {baseline}: )|(?P<slower>{pooled} is slower than {baseline}: )"
           r"|(?P<unclear>no clear difference between {pooled} and {baseline}: {pooled} ))"
           r"(?P<median>\d+\.\d\d)x as fast \(median of (?P<rounds>\d+) rounds; "
           r"range (?P<low>\d+\.\d\d)x to (?P<high>\d+\.\d\d)x(?P<straddles>, which straddles 1)?\)")


def check_verdict(match):
    """The verdict's words agree with its range, and the median lies in it."""
    low, median, high = float(match["low"]), float(match["median"]), float(match["high"])
    assert low <= median <= high, match[0]
    if match["faster"]:
        assert low > 1.0 and not match["straddles"], match[0]
    elif match["slower"]:
        assert high < 1.0 and not match["straddles"], match[0]
    else:
        assert low <= 1.0 <= high and match["straddles"], match[0]
    return int(match["rounds"])


def test_demo_speed_lines_are_the_medians_of_paired_rounds(demo_output):
    """The training and the replayed allocations are each compared in six
    interleaved rounds: a line per training round (together covering every
    step), and each speed line is the median of the rounds with their range,
    'no clear difference' where the range straddles 1. One timing of each
    read 1.8x faster, 1.0x, 1.52x slower and 1.0x in four runs."""
    _, text = demo_output
    rounds = re.findall(r"^  round (\d+)/(\d+), steps (\d+)-(\d+): \w+'s own \d+\.\d\d s, "
                        r"unimem \d+\.\d\d s \(\d+\.\d\dx as fast\)$", text, re.MULTILINE)
    assert [(int(i), int(n)) for i, n, _, _ in rounds] == [(i, 6) for i in range(1, 7)], text
    covered = [step for _, _, first, last in rounds for step in range(int(first), int(last) + 1)]
    assert covered == list(range(1, 13)), covered
    training = re.search(r"^training, 6 rounds, interleaved: " +
                         VERDICT.format(pooled="unimem", baseline=r"\w+'s own allocation") +
                         r"; \d+\.\d\d s with unimem \(recording its memory history\) vs \d+\.\d\d s in all",
                         text, re.MULTILINE)
    assert training, text
    assert check_verdict(training) == 6
    replayed = re.search(r"^allocation alone \(\d+ requests of this run, replayed in 6 rounds, interleaved\): " +
                         VERDICT.format(pooled="the pool", baseline=r"raw \w+ malloc/free"), text, re.MULTILINE)
    assert replayed, text
    assert check_verdict(replayed) == 6


def test_demo_training_step_is_ordinary_array_code():
    """No out= anywhere in the demo: its training is the code users write."""
    import ast
    import unimem.cli.demo as demo
    tree = ast.parse(open(demo.__file__).read())
    functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert {"training_step", "train"} <= functions
    with_out = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.keyword) and node.arg == "out"]
    assert not with_out, f"out= on lines {with_out} of {demo.__file__}"


def test_demo_on_numpy_says_what_the_pool_serves(tmp_path):
    """The fallback without a SYCL device or a GPU (UNIMEM_DEVICE=cpu): NumPy,
    whose own arrays cannot go through the pool; the demo says so, and pools
    the arrays it copies data into (3 parameters, 2 per step)."""
    done = unimem_cli("demo", "--steps", "3", "--no-oom", "--out", str(tmp_path),
                      env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    if "NumPy on host memory" not in done.stdout:
        pytest.skip("UNIMEM_DEVICE=cpu still ran on a device here")
    assert "NumPy has no allocator hook" in done.stdout
    assert re.search(r"served from the pool: the 9 arrays the demo copied its data into", done.stdout)
    assert (tmp_path / "snapshot.pickle").exists() and (tmp_path / "timeline.png").exists()


def test_plot_draws_a_snapshot(demo_output, tmp_path):
    out, _ = demo_output
    png = tmp_path / "again.png"
    done = unimem_cli("plot", str(out / "snapshot.pickle"), "-o", str(png))
    assert done.returncode == 0, done.stderr
    check_png(png)


def test_plot_of_a_snapshot_without_history(tmp_path):
    code = ("import pickle, unimem\n"
            "p = unimem.cpu.caching_allocator_alloc(5 << 20)\n"
            f"pickle.dump(unimem.cpu.memory_snapshot(), open({str(tmp_path / 'segments.pickle')!r}, 'wb'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    png = tmp_path / "segments.png"
    done = unimem_cli("plot", str(tmp_path / "segments.pickle"), "-o", str(png))
    assert done.returncode == 0, done.stderr
    check_png(png)


def test_plot_of_a_missing_file_fails():
    one_line_error(unimem_cli("plot", "/no/such/snapshot.pickle"), "No such file", "/no/such/snapshot.pickle")


class RunsCode:
    """A "snapshot" that, unpickled, calls ``function(*arguments)``."""

    def __init__(self, function, *arguments):
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


@pytest.mark.parametrize("how", ["os.system", "builtins.open", "nested in a real snapshot"])
def test_plot_refuses_a_pickle_that_would_run_code(tmp_path, how):
    """A crafted snapshot must not run code; it is refused in one line."""
    marker = tmp_path / "pwned"
    if how == "os.system":
        payload = RunsCode(os.system, f"touch {marker}")
    elif how == "builtins.open":
        payload = RunsCode(open, str(marker), "w")
    else:
        payload = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                       "frames": [RunsCode(os.system, f"touch {marker}")]}]]}
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(payload))
    done = unimem_cli("plot", str(path), "-o", str(tmp_path / "out.png"))
    one_line_error(done, "refused", "evil.pickle")
    assert not marker.exists(), "the pickle ran code"
    assert not (tmp_path / "out.png").exists()


def test_load_snapshot_refuses_code_and_reads_the_snapshot_format(tmp_path):
    from unimem._observe.plot import SnapshotError, load_snapshot
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(RunsCode(os.system, f"touch {marker}")))
    with pytest.raises(SnapshotError, match="refused to load"):
        load_snapshot(path)
    assert not marker.exists()
    # PyTorch's format: dicts, lists, strings, ints, floats, bools, None (every pickle protocol).
    snapshot = {"segments": [{"device": 0, "address": 1 << 20, "total_size": 2 << 20, "allocated_size": 512,
                              "active_size": 512, "requested_size": 500, "stream": 0,
                              "segment_type": "small", "segment_pool_id": (0, 0), "is_expandable": False,
                              "frames": [], "blocks": [{"address": 1 << 20, "size": 512, "requested_size": 500,
                                                        "state": "active_allocated", "frames": []}]}],
                "device_traces": [[{"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0,
                                    "time_us": 12, "compile_context": None,
                                    "frames": [{"filename": "a.py", "line": 3, "name": "f"}]}]],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "ratio": 0.5}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path.write_bytes(pickle.dumps(snapshot, protocol=protocol))
        assert load_snapshot(path) == snapshot
    path.write_bytes(pickle.dumps(snapshot["segments"]))          # a memory_snapshot() list
    assert load_snapshot(path) == {"segments": snapshot["segments"], "device_traces": []}


def test_plot_names_a_band_by_the_users_line_not_the_librarys():
    """A dpnp array is allocated inside dpnp: its innermost frames are dpnp's
    (in site-packages) and the standard library's. The timeline names the
    band by the innermost frame of the user's code instead."""
    import sysconfig
    import unimem
    from unimem._observe.plot import _site

    def frame(filename, line, name):
        return {"filename": filename, "line": line, "name": name}

    paths = sysconfig.get_paths()
    in_dpnp = frame(os.path.join(paths["purelib"], "dpnp", "dpnp_array.py"), 10, "_create")
    in_stdlib = frame(os.path.join(paths["stdlib"], "functools.py"), 20, "wrapper")
    in_unimem = frame(os.path.join(os.path.dirname(unimem.__file__), "xpu.py"), 30, "empty")
    # recorded by another interpreter, plotted by this one
    in_other_env = frame("/opt/conda/lib/python3.12/site-packages/dpctl/tensor/_ctors.py", 40, "empty")
    users = frame("/home/someone/train.py", 42, "step")
    callers = frame("/home/someone/main.py", 7, "<module>")

    assert _site([in_dpnp, in_stdlib, in_unimem, in_other_env, users, callers]) == "train.py:42 step"
    assert _site([users, in_dpnp]) == "train.py:42 step"
    # only library frames: the innermost, as before
    assert _site([in_dpnp, in_stdlib]).startswith("dpnp_array.py:10 ")
    assert _site([]) == "(no Python frame recorded)"


MALFORMED = {
    "empty": (b"", "empty or truncated"),
    "truncated": (pickle.dumps({"segments": [{"address": 1}] * 50})[:40], "truncated"),
    "text": (b"hello, this is not a pickle\n", "not a pickled snapshot"),
    "a number": (pickle.dumps(42), "int, not a dict"),
    "a dict without segments": (pickle.dumps({"device_traces": []}), "no 'segments'"),
    "segments of the wrong shape": (pickle.dumps({"segments": [1, 2]}), "segment 0 is an int, not a dict"),
    "a block without a size": (pickle.dumps({"segments": [{"address": 0, "total_size": 4, "segment_type": "small",
                                                           "blocks": [{"state": "inactive"}]}]}), "block 0"),
    "an event without an address": (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc",
                                                                                        "size": 4}]]}), "'addr'"),
    "traces not a list": (pickle.dumps({"segments": [], "device_traces": 7}), "'device_traces'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_plot_of_a_malformed_file_is_one_line(tmp_path, case):
    """Truncated, empty, malformed files give one line and a non-zero exit."""
    content, says = MALFORMED[case]
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    one_line_error(unimem_cli("plot", str(path), "-o", str(tmp_path / "out.png")), says, "bad.pickle")


def test_plot_argument_mistakes(tmp_path, demo_output):
    out, _ = demo_output
    one_line_error(unimem_cli("plot", str(tmp_path)), "cannot read")                    # a folder
    one_line_error(unimem_cli("plot", str(out / "snapshot.pickle"), "-d", "5",
                              "-o", str(tmp_path / "x.png")), "no device 5")
    one_line_error(unimem_cli("plot", str(out / "snapshot.pickle"), "-d", "-1"), "device index")
    one_line_error(unimem_cli("plot", str(out / "snapshot.pickle"), "-o", str(tmp_path / "no" / "x.png")),
                   "cannot write")
    one_line_error(unimem_cli("plot"), "snapshot")


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "workload.py"
    path.write_text(WORKLOAD)
    return str(path)


def test_run_runs_the_script_and_prints_the_summary(workload):
    done = unimem_cli("run", workload, "alpha", "--beta")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "workload ran with ['alpha', '--beta']\n"
    assert "memory summary" in done.stderr and "Allocated memory" in done.stderr
    assert "unimem: serving" in done.stderr


def test_run_passes_the_scripts_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.exit(3)\n")
    done = unimem_cli("run", str(script))
    assert done.returncode == 3 and "memory summary" in done.stderr
    assert unimem_cli("run", str(tmp_path / "absent.py")).returncode == 2


def test_summary_and_stats(workload):
    done = unimem_cli("summary", "--abbreviated", workload)
    assert done.returncode == 0, done.stderr
    assert "Allocated memory" in done.stdout and "from small pool" not in done.stdout
    assert "workload ran with" in done.stderr and "workload ran with" not in done.stdout
    done = unimem_cli("stats", "--json", workload)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout[done.stdout.index("{"):])
    assert view["memory_stats"]["allocated_bytes.all.current"] == 3 << 20
    assert view["memory_stats"]["allocation.all.allocated"] == 2
    done = unimem_cli("stats")                       # this process, no workload
    assert done.returncode == 0 and done.stdout.startswith("device ")


# ---------------------------------------------------------------------------
# every subcommand's mistakes: exit status and one line
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("steps", ["0", "-5", "many"])
def test_demo_refuses_steps_that_are_not_positive(steps, tmp_path):
    done = unimem_cli("demo", "--steps", steps, "--out", str(tmp_path))
    one_line_error(done, "--steps", "positive integer")
    assert not os.listdir(tmp_path)


def test_demo_help_shows_the_defaults():
    text = " ".join(unimem_cli("demo", "--help", env={"COLUMNS": "200"}).stdout.split())
    assert "(default: 300)" in text and "(default: unimem-demo)" in text


def test_demo_on_a_missing_device_is_one_line():
    one_line_error(unimem_cli("demo", env={"UNIMEM_DEVICE": "bogus"}), "UNIMEM_DEVICE", status=2)


def test_demo_interrupted_exits_130_with_one_line(tmp_path):
    import signal
    import time
    process = subprocess.Popen([sys.executable, "-m", "unimem", "demo", "--steps", "100000", "--out",
                                str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        process.stdout.readline()                  # the demo's first line: it is running
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, (process.returncode, stderr)
    assert stderr.strip().splitlines()[-1] == "python -m unimem demo: interrupted", stderr
    assert "Traceback" not in stderr


def test_run_of_a_missing_script_is_one_line(tmp_path):
    done = unimem_cli("run", str(tmp_path / "absent.py"))
    one_line_error(done, "no such script", "absent.py")
    assert done.stdout == ""                       # no summary of a run that did not happen


def test_run_shows_the_scripts_own_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def inner():\n    raise ValueError('the script failed')\n\ninner()\n")
    done = unimem_cli("run", str(script))
    assert done.returncode == 1, done.stderr
    trace = done.stderr[done.stderr.index("Traceback"):]
    assert "ValueError: the script failed" in trace and "in inner" in trace
    files = [line.split('"')[1] for line in trace.splitlines() if line.strip().startswith('File "')]
    assert files and all(f == str(script) for f in files), files          # no runpy or unimem frames
    assert "memory summary" in done.stderr


def test_run_reports_a_scripts_exit_message_and_syntax_error(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit('stopped: no data')\n")
    done = unimem_cli("run", str(script))
    assert done.returncode == 1 and "stopped: no data" in done.stderr
    script.write_text("def broken(:\n")
    done = unimem_cli("run", str(script))
    assert done.returncode == 1 and "SyntaxError" in done.stderr and "runpy" not in done.stderr


def test_run_reports_the_pool_the_arrays_went_to(tmp_path):
    """UNIMEM_DEVICE=cpu: dpnp's arrays go to the XPU pool, and that is the pool reported."""
    pytest.importorskip("dpnp")
    import unimem._runtime.devices
    if not unimem._runtime.devices.is_available("xpu"):
        pytest.skip("no SYCL device")
    script = tmp_path / "where.py"
    script.write_text("import dpnp\nx = dpnp.ones((1024, 1024), dtype='f4')\n")
    done = unimem_cli("stats", "--json", str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["device"] == "xpu:0"
    assert view["memory_stats"]["allocated_bytes.all.current"] >= 4 << 20
    done = unimem_cli("run", str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert "XPU memory summary" in done.stderr and "dpnp from the xpu pool" in done.stderr


def test_summary_and_stats_mistakes(tmp_path):
    one_line_error(unimem_cli("summary", "--device", "7"), "out of range")
    one_line_error(unimem_cli("stats", "--device", "7"), "out of range")
    one_line_error(unimem_cli("stats", "--device", "-1"), "device index")
    one_line_error(unimem_cli("summary", str(tmp_path / "absent.py")), "no such script")
    one_line_error(unimem_cli("stats", str(tmp_path / "absent.py")), "no such script")


def test_cluster_mistakes():
    one_line_error(unimem_cli("cluster", "tcp://127.0.0.1:1", "--timeout", "-1"), "--timeout")
    done = unimem_cli("cluster", "tcp://127.0.0.1:1", "--timeout", "2")
    one_line_error(done, "cannot read the Dask cluster", status=1)
    # A malformed address: the half-made Client printed a traceback as it was collected.
    done = unimem_cli("cluster", "notanaddress", "--timeout", "0.5")
    one_line_error(done, "cannot read the Dask cluster", "missing port number", status=1)


# ---------------------------------------------------------------------------
# the package's optional parts
# ---------------------------------------------------------------------------
def test_import_unimem_imports_no_optional_library():
    code = ("import sys, unimem\n"
            "print(sorted(m for m in ('cupy', 'dpctl', 'dpnp', 'prometheus_client', 'dask', 'distributed') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_prometheus_and_dask_are_attributes_of_unimem():
    pytest.importorskip("prometheus_client")
    code = ("import unimem\n"
            "from prometheus_client import CollectorRegistry\n"
            "registry = CollectorRegistry()\n"
            "unimem.prometheus.register(registry)\n"
            "p = unimem.cpu.caching_allocator_alloc(1000)\n"
            "assert registry.get_sample_value('unimem_allocated_bytes', "
            "{'device': 'cpu:0', 'pool': 'all'}) == 1024\n"
            "print(unimem.dask.UnimemPlugin.__name__, 'dask' in dir(unimem))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "UnimemPlugin True", (done.stdout, done.stderr)


def test_prometheus_refuses_a_second_collector_in_one_registry():
    """describe() named no metric, so prometheus_client's duplicate check let
    a second register() through, and every series was exported twice."""
    pytest.importorskip("prometheus_client")
    import collections

    import unimem.prometheus
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
    collector = unimem.prometheus.register(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        unimem.prometheus.register(registry)
    p = unimem.cpu.caching_allocator_alloc(1000)
    try:
        lines = [line for line in generate_latest(registry).decode().splitlines() if line.startswith("unimem_")]
        assert lines and max(collections.Counter(lines).values()) == 1
        assert registry.get_sample_value("unimem_allocated_bytes",
                                         {"device": "cpu:0", "pool": "all"}) >= 1024
    finally:
        unimem.cpu.caching_allocator_delete(p)
    registry.unregister(collector)
    unimem.prometheus.register(registry)           # once gone, it may come again


@pytest.mark.parametrize("module, missing, extra", [("prometheus", "prometheus_client", "prometheus"),
                                                     ("dask", "distributed", "dask")])
def test_an_extra_not_installed_is_named(module, missing, extra):
    code = (f"import sys\nsys.modules[{missing!r}] = None\nimport unimem\n"
            f"try:\n    unimem.{module}\nexcept ImportError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f'pip install -e ".[{extra}]"' in done.stdout, done.stdout


def test_soak_reports_progress(monkeypatch, capsys):
    from benchmarks import soak
    monkeypatch.setattr(soak, "PROGRESS_EVERY", 0.0)
    soak.soak(200_000, samples=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  soak: ")]
    assert len(lines) >= 3 and "of 200,000 operations" in lines[0]


@pytest.mark.parametrize("args", [("plot", "SNAPSHOT", "-o", ""), ("plot", "SNAPSHOT", "-o", "FOLDER"),
                                  ("view", "SNAPSHOT", "-o", ""), ("view", "SNAPSHOT", "-o", "FOLDER"),
                                  ("run", "--report", "", "SCRIPT"), ("run", "--report", "FOLDER", "SCRIPT"),
                                  ("stats", "-o", "FOLDER")])
def test_an_output_that_is_no_file_is_refused_before_anything_runs(tmp_path, args):
    """plot -o '' wrote a hidden '.png' and said nothing; run --report ''
    wrote nothing, silently; run --report FOLDER ran the whole script and
    only then failed. Each is now a usage error (exit 2) before anything."""
    script = tmp_path / "script.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    snapshot = tmp_path / "s.pickle"
    snapshot.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    argv = [{"SNAPSHOT": str(snapshot), "FOLDER": str(tmp_path), "SCRIPT": str(script)}.get(a, a) for a in args]
    done = unimem_cli(*argv, cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "expected a file name" in done.stderr or "is a folder, not a file" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["s.pickle", "script.py"]


def test_plot_writes_a_png_whatever_the_name_ends_with(tmp_path):
    """plot -o x.foo blamed the snapshot for matplotlib's unknown format."""
    snapshot = tmp_path / "s.pickle"
    snapshot.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    done = unimem_cli("plot", str(snapshot), "-o", str(tmp_path / "x.foo"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.foo").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_out_naming_a_file_is_refused_before_the_demo_trains(tmp_path):
    """demo --out FILE trained for the whole run and then ended in a
    FileExistsError traceback."""
    existing = tmp_path / "a-file"
    existing.write_text("")
    done = unimem_cli("demo", "--steps", "1", "--out", str(existing))
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "is a file, not a folder" in done.stderr, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr


def test_a_script_that_allocates_nothing_is_reported_on_the_current_accelerator(tmp_path):
    """With no pool used, the summary and statistics are the current
    accelerator's (cpu here): the XPU pool that installing dpnp's allocator
    makes, all zeros, was taken for a used one and reported instead."""
    script = tmp_path / "nothing.py"
    script.write_text("x = 1\n")
    done = unimem_cli("stats", "--json", str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["device"] == "cpu:0" and list(view["devices"]) == ["cpu:0"]
    done = unimem_cli("run", str(script), env={"UNIMEM_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr
    assert "CPU memory summary" in done.stderr and "XPU memory summary" not in done.stderr


