"""Running a slice of CuPy's own test suite with and without unimem's
allocator, on a GPU, and comparing each test's outcome.

CuPy's wheels do not ship its tests: point ``UNIMEM_CUPY_TESTS`` at the
``tests`` folder of a CuPy checkout of the installed version (``git archive
v14.2.0 tests`` of github.com/cupy/cupy, say). Both runs load
:mod:`tests.helpers.cupy_allocator_plugin`; with ``pytest-xdist`` installed
they run on several workers. ::

    UNIMEM_CUPY_TESTS=/path/to/cupy/tests python -m tests.helpers.cupy_suite [--workers 16]

prints both runs' counts and every test whose outcome differs, with both
failure texts, and writes them as JSON (``--json``).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

from tests.helpers import REPO_ROOT
from tests.helpers.dpnp_suite import Run, describe, differences

PLUGIN = "tests.helpers.cupy_allocator_plugin"
TESTS_ENV = "UNIMEM_CUPY_TESTS"

#: The slice (relative to CuPy's ``tests``): creation, the ndarray and its
#: indexing, reductions and products, linalg, FFT, sorting, random and
#: streams: about 6,300 tests. ``math_tests/test_arithmetic.py`` (8,800
#: tests of dtype promotion) is left out for time, as are the tests of
#: CuPy's own pool classes (``cuda_tests/test_memory.py``,
#: ``test_pinned_memory.py``), which test those classes, not the allocator.
SLICE = [
    "cupy_tests/creation_tests",
    "cupy_tests/core_tests/test_ndarray.py",
    "cupy_tests/core_tests/test_ndarray_copy_and_view.py",
    "cupy_tests/core_tests/test_ndarray_elementwise_op.py",
    "cupy_tests/core_tests/test_ndarray_reduction.py",
    "cupy_tests/core_tests/test_ndarray_indexing.py",
    "cupy_tests/core_tests/test_ndarray_adv_indexing.py",
    "cupy_tests/manipulation_tests/test_join.py",
    "cupy_tests/math_tests/test_sumprod.py",
    "cupy_tests/math_tests/test_matmul.py",
    "cupy_tests/linalg_tests/test_product.py",
    "cupy_tests/linalg_tests/test_solve.py",
    "cupy_tests/fft_tests/test_fft.py",
    "cupy_tests/sorting_tests",
    "cupy_tests/random_tests/test_sample.py",
    "cupy_tests/random_tests/test_generator.py",
    "cupy_tests/cuda_tests/test_stream.py",
]


def cupy_tests_dir() -> Optional[str]:
    path = os.environ.get(TESTS_ENV)
    return path if path and os.path.isdir(os.path.join(path, "cupy_tests")) else None


def command(tests: str, files: List[str], workers: int) -> List[str]:
    """pytest on ``files`` with CuPy's own configuration (its pyproject, one
    folder above ``tests``, when there is one) and CuPy's folder as the root."""
    root = os.path.dirname(os.path.abspath(tests))
    config = os.path.join(root, "pyproject.toml")
    args = [sys.executable, "-m", "pytest", "--rootdir", root, "-p", PLUGIN, "-p", "no:cacheprovider",
            "-q", "--tb=short", "--timeout=600", "-o", "faulthandler_timeout=300"]
    if os.path.exists(config):
        args += ["-c", config]
    if workers > 1:
        args += ["-n", str(workers)]
    return args + [os.path.join(tests, f) for f in files]


def run_slice(hooked: bool, workdir: str, files: Optional[List[str]] = None, workers: int = 1,
              timeout: float = 3600) -> Run:
    tests = cupy_tests_dir()
    if tests is None:
        raise RuntimeError(f"set {TESTS_ENV} to the tests folder of a CuPy checkout")
    log_path = os.path.join(workdir, f"cupy-outcomes-{'with' if hooked else 'without'}.jsonl")
    env = dict(os.environ, UNIMEM_CUPY_SUITE_ALLOCATOR="1" if hooked else "0", UNIMEM_CUPY_SUITE_LOG=log_path)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p])
    start = time.perf_counter()
    # A session of its own, so that a run stopped at its time limit takes its
    # xdist workers with it.
    process = subprocess.Popen(command(tests, files or SLICE, workers), cwd=workdir, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n[stopped after {timeout:.0f} s]"
        timed_out = True
    run = Run(hooked, log_path, process.returncode, output, time.perf_counter() - start)
    run.log_path, run.timed_out = log_path, timed_out          # type: ignore[attr-defined]
    if timed_out:                          # the test it was in is not a crash, only cut short
        run.outcomes = {test: outcome for test, outcome in run.outcomes.items() if outcome != "crashed"}
    return run


def compared_ids(without: Run, with_: Run) -> List[str]:
    """The tests both runs reached (all of them, unless a run was cut short)."""
    if getattr(without, "timed_out", False) or getattr(with_, "timed_out", False):
        return sorted(set(without.outcomes) & set(with_.outcomes))
    return sorted(set(without.outcomes) | set(with_.outcomes))


def _records(log_path: str) -> Iterator[Dict[str, Any]]:
    """The log's JSON records, in order (a line cut short by a kill is skipped)."""
    with open(log_path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def sessions(log_path: str) -> List[Dict[str, object]]:
    """Every ``{"session": ...}`` record of a run (one per process that ran tests)."""
    return [record["session"] for record in _records(log_path) if "session" in record]


def served_by_unimem(log_path: str) -> int:
    """The device allocations unimem served in a run: each process's last
    counters (its session record, or, in a run stopped at its time limit,
    the counters it wrote after its last test), summed over processes."""
    last: Dict[object, int] = {}
    for number, record in enumerate(_records(log_path)):
        counters = record.get("session") or record.get("counters")
        if counters:
            last[counters.get("pid", ("record", number))] = int(counters["device_allocations"])
    return sum(last.values())


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description="CuPy's tests with and without unimem's allocator")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--workdir", default=".")
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds each run may take")
    parser.add_argument("files", nargs="*", help=f"instead of the slice (relative to ${TESTS_ENV})")
    arguments = parser.parse_args(argv)
    workdir = os.path.abspath(arguments.workdir)
    runs = {}
    for hooked in (False, True):           # CuPy's pool first: it fills the kernel cache for both
        run = run_slice(hooked, workdir, arguments.files or None, arguments.workers, arguments.run_timeout)
        runs[hooked] = run
        print(f"{'with' if hooked else 'without'} unimem: {run.counts()} in {run.seconds:.0f} s "
              f"(exit {run.returncode}{', cut short' if run.timed_out else ''}); "
              f"allocations served by unimem: {served_by_unimem(run.log_path)}", flush=True)
        if not run.outcomes:
            print(run.output[-5000:])
    compared = compared_ids(runs[False], runs[True])
    print(f"{len(compared)} tests compared")
    reached_by_both = set(compared)
    differing = [test for test in differences(runs[False], runs[True]) if test in reached_by_both]
    print(describe(differing, runs[False], runs[True]) if differing else "same outcome for every test")
    if arguments.json:
        with open(arguments.json, "w") as f:
            json.dump({"slice": arguments.files or SLICE,
                       "without": {"counts": runs[False].counts(), "seconds": runs[False].seconds},
                       "with": {"counts": runs[True].counts(), "seconds": runs[True].seconds,
                                "served_by_unimem": served_by_unimem(runs[True].log_path)},
                       "compared": len(compared),
                       "differences": {test: [runs[False].outcomes.get(test), runs[True].outcomes.get(test)]
                                       for test in differing}}, f, indent=1)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
