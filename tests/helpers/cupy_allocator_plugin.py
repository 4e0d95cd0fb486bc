"""A pytest plugin for running CuPy's own tests with and without unimem's allocator.

Loaded with ``-p tests.helpers.cupy_allocator_plugin`` into both runs (see
:mod:`tests.helpers.cupy_suite`), so that the two differ only in the allocator:

* ``UNIMEM_CUPY_SUITE_ALLOCATOR=1``: ``cupy.cuda.set_allocator(unimem.cuda.allocator)``
  and ``cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)``
  in every process that runs tests, before any test is collected;
  otherwise CuPy's default pools;
* ``UNIMEM_CUPY_SUITE_LOG=<path>``: each test's outcome as it happens
  (:class:`tests.helpers.outcome_log.OutcomeLog`), and one ``{"session": ...}``
  line per process that ran tests, with unimem's counters, so that the
  caller can check that the "with" run really was served by unimem's pools
  and the "without" run was not; each process also writes its counters
  after every test (``{"counters": ...}``), which is all a run stopped at
  its time limit leaves.
"""
import os

import cupy

import unimem.cuda
import unimem.host
from tests.helpers.outcome_log import OutcomeLog

ALLOCATOR_ENV = "UNIMEM_CUPY_SUITE_ALLOCATOR"
LOG_ENV = "UNIMEM_CUPY_SUITE_LOG"
HOOKED = os.environ.get(ALLOCATOR_ENV) == "1"
_log = None


def _counters():
    try:
        # {} on a GPU where unimem has not allocated yet (as torch.cuda.memory_stats)
        device = unimem.cuda.memory_stats().get("allocation.all.allocated", 0)
    except RuntimeError:            # no GPU: unimem.cuda says so
        device = 0
    return {"device_allocations": int(device),
            "pinned_allocations": int(unimem.host_memory_stats().get("num_host_alloc", 0)),
            "installed": cupy.cuda.get_allocator() is unimem.cuda.allocator}


def pytest_configure(config):
    global _log
    path = os.environ.get(LOG_ENV)
    if path and _log is None:
        _log = OutcomeLog(path, config)
    runs_tests = _log.runs_tests if _log is not None else True
    if HOOKED and runs_tests:
        cupy.cuda.set_allocator(unimem.cuda.allocator)
        cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)


def pytest_runtest_logreport(report):
    if _log is not None:
        _log.report(report)
        if report.when == "teardown" and _log.runs_tests:
            # After every test, so that a run stopped at its time limit
            # (no session record then) still says what unimem served.
            _log.write({"counters": dict(_counters(), pid=os.getpid())})


def pytest_sessionfinish(session, exitstatus):
    if _log is not None and _log.runs_tests:
        _log.write({"session": dict(_counters(), pid=os.getpid(), hooked=HOOKED, exitstatus=int(exitstatus))})


def pytest_unconfigure(config):
    global _log
    if _log is not None:
        _log.close()
        _log = None
