"""Each test's outcome, with its failure's text, written as it happens.

As a pytest plugin (``-p tests.helpers.outcome_log`` with
``UNIMEM_OUTCOME_LOG=<path>``) it makes a run that a time limit stops still
say what failed and why: pytest prints failures only at the end. Under
pytest-xdist only the controller writes test reports (it sees every one).
:mod:`tests.helpers.cupy_allocator_plugin` writes its log with it too.
"""
import json
import os
from typing import IO, Any, Dict, Optional

LOG_ENV = "UNIMEM_OUTCOME_LOG"


class OutcomeLog:
    """A JSON-lines file that several processes append to, one whole line per write."""

    def __init__(self, path: str, config: Any) -> None:
        self.worker = hasattr(config, "workerinput")
        self.controller = not self.worker and bool(getattr(config.option, "numprocesses", None))
        if not self.worker:
            open(path, "w").close()                # started afresh by the process that starts first
        self._file: Optional[IO[str]] = open(path, "a")

    @property
    def runs_tests(self) -> bool:
        """Whether this process runs tests (not xdist's controller)."""
        return not self.controller

    def write(self, record: Dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def report(self, report: Any) -> None:
        """One test phase's outcome (xfail and xpass told apart), with the
        end of the failure's text."""
        if self.worker:
            return
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        record = {"id": report.nodeid, "when": report.when, "outcome": outcome}
        if report.failed:
            record["text"] = report.longreprtext[-3000:]
        self.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_log: Optional[OutcomeLog] = None


def pytest_configure(config: Any) -> None:
    global _log
    path = os.environ.get(LOG_ENV)
    if path and _log is None:
        _log = OutcomeLog(path, config)


def pytest_runtest_logreport(report: Any) -> None:
    if _log is not None:
        _log.report(report)


def pytest_unconfigure(config: Any) -> None:
    global _log
    if _log is not None:
        _log.close()
        _log = None
