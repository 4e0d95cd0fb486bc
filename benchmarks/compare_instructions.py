"""``python -m benchmarks compare REV --instructions``: the hot path's cost in
instructions, counted by callgrind (valgrind), for both trees.

Timings on a shared 2-core machine move by 10-30% from one minute to the next,
so that the timed rounds of ``compare`` can only call a difference real past
10%. An instruction count does not depend on the machine's load: the same
tree counted twice differs by well under 1% (measured: see CONTRIBUTING.md), so a
change of a few percent on the hot path is seen at once. It is not time (a
cache miss costs more than an add), so it complements the timed rounds, for
the cases that run host code only (the alloc/free pairs, ``memory_allocated``,
the ``dict.get`` floor).

Each case is run twice per tree under callgrind, as one loop of ``SHORT`` and
one of ``LONG`` operations (``compare_worker.py --loop``); the difference of
the two totals of the main thread, divided by ``LONG - SHORT``, is the cost
of one operation, without the interpreter's start-up and imports. Other
threads are left out (a BLAS thread spinning runs as valgrind schedules it),
and ``PYTHONHASHSEED`` is fixed so that both runs hash alike.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, IO, List, Optional

#: Operations in the short and the long loop of a case.
SHORT = 2_000
LONG = 12_000
#: A difference of instructions per operation counts from this ratio on
#: (the same tree counted twice differs by far less).
INSTRUCTION_THRESHOLD = 1.02
_TOTALS = re.compile(r"^totals:\s*(\d+)", re.MULTILINE)


class InstructionCountError(RuntimeError):
    """valgrind is missing, or a counted run failed."""


def valgrind() -> str:
    path = shutil.which("valgrind")
    if path is None:
        raise InstructionCountError("--instructions needs valgrind (Debian: apt-get install valgrind)")
    return path


@dataclass
class CountedCase:
    case: str
    base: Optional[float] = None       # instructions per operation
    new: Optional[float] = None
    skipped: Optional[str] = None

    @property
    def ratio(self) -> Optional[float]:
        if self.base is None or self.new is None or self.base <= 0:
            return None
        return self.new / self.base

    def verdict(self, threshold: float = INSTRUCTION_THRESHOLD) -> str:
        ratio = self.ratio
        if ratio is None:
            return "-"
        if ratio >= threshold:
            return "slower"
        if ratio <= 1 / threshold:
            return "faster"
        return "same"

    def as_dict(self) -> Dict[str, Any]:
        return {"case": self.case, "skipped": self.skipped, "base_instructions": self.base,
                "new_instructions": self.new, "ratio": self.ratio, "verdict": self.verdict()}


def count_loop(worker: str, tree: str, env: Dict[str, str], case: str, operations: int) -> Optional[int]:
    """The instructions callgrind counts for one run of ``case`` (``operations``
    operations) in ``tree``'s interpreter; None when the tree lacks the case."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "out")
        done = subprocess.run(
            [valgrind(), "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
             sys.executable, worker, "--loop", case, str(operations)],
            cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode == 3:                       # the worker's Skip
            return None
        # The main thread's file only: other threads (a BLAS server spinning,
        # a runtime's workers) run as valgrind schedules them, not alike twice.
        found = []
        if os.path.exists(out + "-01"):
            with open(out + "-01") as f:
                found = _TOTALS.findall(f.read())
    if done.returncode != 0 or not found:
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise InstructionCountError(f"counting {case!r} in {tree} failed (exit {done.returncode}):\n{tail}")
    return int(found[-1])


def per_operation(worker: str, tree: str, env: Dict[str, str], case: str) -> Optional[float]:
    short = count_loop(worker, tree, env, case, SHORT)
    if short is None:
        return None
    long = count_loop(worker, tree, env, case, LONG)
    if long is None:
        return None
    return (long - short) / (LONG - SHORT)


def count_cases(worker: str, trees: Dict[str, str], envs: Dict[str, Dict[str, str]], cases: List[str],
                log: IO[str]) -> List[CountedCase]:
    """Instructions per operation of each case on the ``base`` and ``new`` trees."""
    valgrind()
    results = []
    for case in cases:
        result = CountedCase(case)
        for side in ("base", "new"):
            print(f"counting {case!r} on {side} under callgrind ...", file=log, flush=True)
            env = dict(envs[side], PYTHONHASHSEED="0")
            value = per_operation(worker, trees[side], env, case)
            if value is None:
                result.skipped = f"{side}: this tree has no such case"
                break
            setattr(result, side, value)
        results.append(result)
    return results


def table_rows(results: List[CountedCase]) -> List[List[str]]:
    rows = []
    for r in results:
        if r.skipped or r.ratio is None:
            rows.append([r.case, "-", "-", "-", f"skipped ({r.skipped})" if r.skipped else "-"])
        else:
            rows.append([r.case, f"{r.base:,.0f}", f"{r.new:,.0f}", f"{r.ratio:.3f}x", r.verdict()])
    return rows
