"""python -m unimem: every subcommand, its exit code and the files it writes."""
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unimem_cli(*args, cwd=None, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "unimem", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=dict(os.environ, **(env or {})))


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


def test_help_lists_every_subcommand():
    done = unimem_cli("--help")
    assert done.returncode == 0
    for command in ("demo", "plot", "run", "summary", "stats", "cluster"):
        assert command in done.stdout
    assert unimem_cli().returncode == 2                    # a subcommand is required
    assert unimem_cli("teleport").returncode == 2


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = unimem_cli("demo", "--steps", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_demo_trains_reports_and_writes_files(demo_output):
    out, text = demo_output
    for needed in ("unimem demo: a 512-1024-256-10 MLP, 12 training steps", "memory summary",
                   "cache hit rate:", "training:", "allocation alone", "out of memory",
                   "snapshot.pickle", "timeline.png", "12/12 steps"):
        assert needed in text, needed
    with open(out / "snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert any(e["action"] == "oom" for trace in snapshot["device_traces"] for e in trace)
    check_png(out / "timeline.png")


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
    done = unimem_cli("plot", "/no/such/snapshot.pickle")
    assert done.returncode != 0 and "No such file" in done.stderr


WORKLOAD = textwrap.dedent("""
    import sys
    import unimem
    ptrs = [unimem.accelerator.caching_allocator_alloc(n) for n in (1000, 3 << 20)]
    unimem.accelerator.caching_allocator_delete(ptrs[0])
    print("workload ran with", sys.argv[1:])
""")


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "workload.py"
    path.write_text(WORKLOAD)
    return str(path)


def test_run_runs_the_script_and_prints_the_summary(workload):
    done = unimem_cli("run", workload, "alpha", "--beta")
    assert done.returncode == 0, done.stderr
    assert "workload ran with ['alpha', '--beta']" in done.stdout
    assert "memory summary" in done.stdout and "Allocated memory" in done.stdout
    assert "unimem: serving" in done.stderr


def test_run_passes_the_scripts_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.exit(3)\n")
    done = unimem_cli("run", str(script))
    assert done.returncode == 3 and "memory summary" in done.stdout
    assert unimem_cli("run", str(tmp_path / "absent.py")).returncode == 2


def test_summary_and_stats(workload):
    done = unimem_cli("summary", "--abbreviated", workload)
    assert done.returncode == 0, done.stderr
    assert "Allocated memory" in done.stdout and "from small pool" not in done.stdout
    done = unimem_cli("stats", "--json", workload)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout[done.stdout.index("{"):])
    assert view["memory_stats"]["allocated_bytes.all.current"] == 3 << 20
    assert view["memory_stats"]["allocation.all.allocated"] == 2
    done = unimem_cli("stats")                       # this process, no workload
    assert done.returncode == 0 and done.stdout.startswith("device ")
