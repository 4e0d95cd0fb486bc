"""CuPy's own tests as the judge: a slice of CuPy's test suite
gives the same outcome for every test with ``unimem.cuda.allocator`` (and
unimem's pinned allocator) installed as with CuPy's own pools.

Needs an NVIDIA GPU and CuPy's tests for the installed version
(``UNIMEM_CUPY_TESTS``, see :mod:`tests.helpers.cupy_suite`); skipped
otherwise. The plugin's own bookkeeping is tested without a GPU below."""
import json
import os

import pytest

from tests.helpers import cupy_suite
from tests.helpers.gpu import cuda_gpu_available

cupy = pytest.importorskip("cupy")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_gpu_available() or cupy_suite.cupy_tests_dir() is None,
                    reason=f"needs an NVIDIA GPU and {cupy_suite.TESTS_ENV}")
def test_cupys_own_tests_give_the_same_outcomes_with_unimems_allocator(tmp_path):
    try:
        import xdist  # noqa: F401
        workers = min(16, os.cpu_count() or 1)
    except ImportError:
        workers = 1
    without = cupy_suite.run_slice(False, str(tmp_path), workers=workers)
    with_ = cupy_suite.run_slice(True, str(tmp_path), workers=workers)
    assert len(without.outcomes) > 1000, without.output[-3000:]
    assert cupy_suite.served_by_unimem(with_.log_path) > 1000
    assert cupy_suite.sessions(without.log_path) and cupy_suite.served_by_unimem(without.log_path) == 0
    differing = cupy_suite.differences(without, with_)
    assert not differing, cupy_suite.describe(differing, without, with_)


@pytest.mark.parametrize("workers", [1, 2], ids=["one process", "two xdist workers"])
def test_the_plugin_logs_every_test_and_says_whether_unimem_served(tmp_path, monkeypatch, workers):
    """Without a GPU: tiny tests run through the plugin in both modes; the
    log has each test's outcome once and one session record per process
    that ran tests (under xdist: each worker, not the controller)."""
    if workers > 1:
        pytest.importorskip("xdist")
    tests = tmp_path / "tests" / "cupy_tests"
    tests.mkdir(parents=True)
    (tests / "test_tiny.py").write_text("import pytest\n\n@pytest.mark.parametrize('n', range(4))\n"
                                        "def test_passes(n):\n    pass\n\ndef test_fails():\n    assert False\n")
    monkeypatch.setenv(cupy_suite.TESTS_ENV, str(tmp_path / "tests"))
    runs = [cupy_suite.run_slice(hooked, str(tmp_path), ["cupy_tests/test_tiny.py"], workers=workers)
            for hooked in (False, True)]
    expected = {f"tests/cupy_tests/test_tiny.py::test_passes[{n}]": "passed" for n in range(4)}
    expected["tests/cupy_tests/test_tiny.py::test_fails"] = "failed"
    for run in runs:
        assert run.outcomes == expected, run.output
        sessions = cupy_suite.sessions(run.log_path)
        assert len(sessions) == workers
        assert all(s["hooked"] is run.hooked and s["installed"] is run.hooked for s in sessions)
    assert cupy_suite.differences(*runs) == []
    with open(runs[1].log_path) as f:
        assert any("assert False" in json.loads(line).get("text", "") for line in f)


def test_the_plugins_counters_hold_before_unimem_allocated(monkeypatch):
    """On a GPU where unimem has not allocated yet, ``memory_stats()`` is
    ``{}`` (as PyTorch's): the count is 0, not a KeyError that loses the
    session record (it failed so on the H200, where the "without" runs
    never allocate through unimem)."""
    from tests.helpers import cupy_allocator_plugin
    monkeypatch.setattr(cupy_allocator_plugin.unimem.cuda, "memory_stats", lambda: {})
    assert cupy_allocator_plugin._counters()["device_allocations"] == 0
    monkeypatch.setattr(cupy_allocator_plugin.unimem.cuda, "memory_stats",
                        lambda: {"allocation.all.allocated": 7})
    assert cupy_allocator_plugin._counters()["device_allocations"] == 7


def test_what_unimem_served_is_each_processs_last_count(tmp_path):
    """Each process's counters grow through its run: the count is the last
    one of each process, summed. A run cut at its time limit has no session
    records, only the counters written after each test (the H200 run of
    2026-11-27 reported 0 allocations for such a run that unimem served)."""
    log = tmp_path / "log.jsonl"
    records = [{"counters": {"pid": 1, "device_allocations": 10}},
               {"id": "t", "when": "call", "outcome": "passed"},
               {"counters": {"pid": 2, "device_allocations": 5}},
               {"counters": {"pid": 1, "device_allocations": 30}},
               {"session": {"pid": 2, "device_allocations": 7, "hooked": True}}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    assert cupy_suite.served_by_unimem(str(log)) == 30 + 7
    log.write_text("".join(json.dumps(r) + "\n" for r in records[:4]))      # cut short: no session record
    assert cupy_suite.served_by_unimem(str(log)) == 30 + 5


def test_a_run_cut_at_its_time_limit_still_leaves_its_counters(tmp_path, monkeypatch):
    tests = tmp_path / "tests" / "cupy_tests"
    tests.mkdir(parents=True)
    (tests / "test_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_slow():\n    time.sleep(120)\n")
    monkeypatch.setenv(cupy_suite.TESTS_ENV, str(tmp_path / "tests"))
    run = cupy_suite.run_slice(True, str(tmp_path), ["cupy_tests/test_slow.py"], timeout=20)
    assert run.timed_out and run.outcomes.get("tests/cupy_tests/test_slow.py::test_quick") == "passed", run.output
    assert cupy_suite.sessions(run.log_path) == []
    with open(run.log_path) as f:
        counters = [json.loads(line)["counters"] for line in f if '"counters"' in line]
    assert len(counters) == 1 and counters[0]["installed"] and counters[0]["pid"] > 0
    assert cupy_suite.served_by_unimem(run.log_path) == counters[0]["device_allocations"]
