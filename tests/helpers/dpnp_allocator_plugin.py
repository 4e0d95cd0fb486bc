"""A pytest plugin for running dpnp's own tests with and without unimem's allocator.

Loaded with ``-p tests.helpers.dpnp_allocator_plugin`` into both runs (see
:mod:`tests.helpers.dpnp_suite`), so that the two differ only in the allocator:

* ``UNIMEM_DPNP_SUITE_ALLOCATOR=1``: ``unimem.xpu.set_allocator()`` before any
  test is collected, for the whole session; otherwise dpnp's own allocator;
* ``UNIMEM_DPNP_SUITE_LOG=<path>``: one JSON line per test phase (node id,
  phase, outcome, the failure's text), written as it happens, so that a run
  that crashes still says which test it was in; and at the end one
  ``{"session": ...}`` line with the allocator's counters, so that the outer
  test can check that the "with" run really was served by the pools and the
  "without" run was not.

At session end the plugin also checks that itself: a "with" run whose pools
served no allocation, or a "without" run that had the allocator installed,
fails with an internal-error exit status.
"""
import json
import os

import pytest

import unimem  # noqa: F401  (the OpenCL CPU runtime is found before dpctl looks for devices)
import unimem.xpu as xpu

ALLOCATOR_ENV = "UNIMEM_DPNP_SUITE_ALLOCATOR"
LOG_ENV = "UNIMEM_DPNP_SUITE_LOG"
HOOKED = os.environ.get(ALLOCATOR_ENV) == "1"
_log = None


def _write(record):
    if _log is not None:
        _log.write(json.dumps(record) + "\n")
        _log.flush()


def pytest_configure(config):
    global _log
    path = os.environ.get(LOG_ENV)
    if path and _log is None:
        _log = open(path, "w")
    if HOOKED:
        xpu.set_allocator()
    _write({"start": {"hooked": HOOKED, "installed": xpu.allocator_installed(),
                      "counters": xpu.allocator_counters()}})


def pytest_runtest_logreport(report):
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    record = {"id": report.nodeid, "when": report.when, "outcome": outcome}
    if report.failed:
        record["text"] = report.longreprtext
    _write(record)


def pytest_sessionfinish(session, exitstatus):
    counters = xpu.allocator_counters()
    installed = xpu.allocator_installed()
    problem = None
    if HOOKED and not installed:
        problem = "the allocator was no longer installed at the end of the session"
    elif HOOKED and counters.get("pooled.allocations", 0) == 0:
        problem = "unimem's pools served no allocation: the 'with' run was a 'without' run"
    elif not HOOKED and (installed or counters.get("pooled.allocations", 0)):
        problem = "the 'without' run had unimem's allocator installed"
    _write({"session": {"hooked": HOOKED, "installed": installed, "counters": counters,
                        "exitstatus": int(exitstatus), "problem": problem}})
    if problem:
        print(f"\nunimem dpnp-suite plugin: {problem}")
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


def pytest_unconfigure(config):
    global _log
    if _log is not None:
        _log.close()
        _log = None
