"""``python -m benchmarks compare REV``: is the working tree slower than REV?

Builds REV in a git worktree of its own (cached, built in place with this
interpreter), starts one measuring interpreter per tree and round
(``compare_worker``, with that tree first on its path; see HEAP_SHIFTS) and
runs every case on both, interleaved:
for each round and case, base then new, or new then base on odd rounds, so
that drift of the machine (another process, the CPU's clock) falls on both
sides alike. Each case's ratio is new / base per round; the table shows the
median ratio and its spread (lowest - highest).

A difference counts as real only when every round agrees on its direction
and the median ratio is past ``--threshold`` (1.10: 10%); anything else is
noise on these shared machines. With ``--strict`` a real slowdown is exit
status 1.

    python -m benchmarks compare 53b0763                 # base: a revision; new: the working tree
    python -m benchmarks compare HEAD --rounds 7
    python -m benchmarks compare HEAD --new-tree /path/to/other/checkout --cases "accelerator pair"
    python -m benchmarks compare HEAD --instructions      # the hot path in instructions (callgrind), not time

``--instructions`` counts instead of timing (compare_instructions.py): noise
free, so that a change of 2% on the hot path is seen on a loaded machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, IO, List, Optional, Sequence, Tuple

from ._common import format_time, print_table, write_json
from .compare_instructions import (INSTRUCTION_THRESHOLD, CountedCase, InstructionCountError, count_cases,
                                   table_rows)
from .compare_worker import CASES, CPU_ENV, HEAP_SHIFT_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_worker.py")
CACHE_ENV = "UNIMEM_COMPARE_CACHE"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "unimem-compare")
THRESHOLD = 1.10
#: Bytes each round's interpreters allocate first (compare_worker.py), both
#: sides alike: the four places a 16-byte-aligned structure can take in a
#: 64-byte cache line. Without address-space randomization an interpreter's
#: heap is laid out the same every time, and the typed core pair's time
#: depends on where its structures fall: 25.2-25.9 ns at three of these
#: shifts and 27.1-27.4 ns at the fourth for 4c04cc1, and the other way
#: round (26.0, then 27.2-28.4 ns) for 9bb33ae, whose instructions are the
#: same; its Python moved the heap. With one layout per side for the whole
#: run, that read 1.07x in every round, a slowdown by the rule below; with
#: a shift per round it is spread (1.00-1.11), and code that is slower in
#: every layout still reads slower in every round.
HEAP_SHIFTS = (0, 16, 32, 48)
MIN_ROUNDS = 5
BUILD_STAMP = ".unimem-compare-built"


class CompareError(RuntimeError):
    """A tree that cannot be checked out, built or measured."""


# ---------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------
def _git(*args: str, cwd: str = REPO) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise CompareError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def build_in_place(tree: str, log: IO[str]) -> None:
    """Build the tree's Cython extensions next to their sources (a no-op for
    what is up to date), with this interpreter: the one that will import them."""
    print(f"building {tree} in place ...", file=log, flush=True)
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1)],
                          cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise CompareError(f"building {tree} failed:\n{tail}")


def checkout(revision: str, cache: str, log: IO[str]) -> str:
    """A built worktree of ``revision`` (a commit, branch or tag), made once and kept in ``cache``."""
    sha = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    tree = os.path.join(cache, sha)
    if os.path.exists(os.path.join(tree, BUILD_STAMP)):
        return tree
    if not os.path.isdir(tree):
        os.makedirs(cache, exist_ok=True)
        _git("worktree", "prune")
        _git("worktree", "add", "--detach", tree, sha)
    build_in_place(tree, log)
    with open(os.path.join(tree, BUILD_STAMP), "w") as f:
        f.write(sha + "\n")
    return tree


# ---------------------------------------------------------------------------
# the measuring interpreters
# ---------------------------------------------------------------------------
def tree_env(tree: str, env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with ``tree`` first on the path: its interpreter imports that tree's unimem."""
    return dict(env, PYTHONPATH=os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p]))


def shared_cpu() -> Optional[int]:
    """The one CPU both measuring interpreters run their host-code samples on.
    Apart, the same code timed 0.84x on one side in every round of a quiet run
    (two cores of a VM are not alike); taking turns on one CPU, the sides see
    the same core. (Cases with kernels in flight keep every CPU: the SYCL CPU
    device runs its kernels on them.)"""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(os.sched_getaffinity(0))


def same_layout_command(command: List[str]) -> List[str]:
    """``command`` run so that two interpreters of the same code lay out
    memory alike: without address-space randomization (``setarch -R``,
    where it works). Two interpreters of one tree, each with its own random
    layout, timed one side 0.87x and another 1.12x against the other in
    every round (tests/integrations/test_compare.py's noise test, on this
    machine); the hash seed is fixed too (the Side's environment)."""
    setarch = shutil.which("setarch")
    if setarch is None or not hasattr(os, "uname"):
        return command
    probe = [setarch, os.uname().machine, "-R", "true"]
    try:
        if subprocess.run(probe, capture_output=True, timeout=10).returncode != 0:
            return command
    except (OSError, subprocess.SubprocessError):
        return command
    return probe[:-1] + command


class Side:
    """One tree's measuring interpreter."""

    def __init__(self, label: str, tree: str, env: Dict[str, str], cpu: Optional[int] = None,
                 heap_shift: int = 0) -> None:
        self.label = label
        self.tree = tree
        child_env = tree_env(tree, env)
        if cpu is not None:
            child_env[CPU_ENV] = str(cpu)          # the worker runs its host-code samples there
        child_env[HEAP_SHIFT_ENV] = str(heap_shift)
        child_env["PYTHONHASHSEED"] = "0"          # both sides hash alike (same_layout_command)
        self.process = subprocess.Popen(same_layout_command([sys.executable, WORKER]), cwd=tree, env=child_env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        expected = os.path.join(os.path.realpath(tree), "unimem", "__init__.py")
        if os.path.realpath(hello.get("unimem", "")) != expected:
            self.close()
            raise CompareError(f"the {label} interpreter imported {hello.get('unimem')}, not {expected}")
        self.device = hello["device"]

    def _read(self) -> Dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise CompareError(f"the {self.label} interpreter ({self.tree}) ended: see its error above")
        return json.loads(line)

    def measure(self, case: str, quick: bool) -> Dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"case": case, "quick": quick}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:       # one interpreter per round: none may stay behind
            self.process.kill()
            self.process.wait()


# ---------------------------------------------------------------------------
# rounds and verdicts
# ---------------------------------------------------------------------------
@dataclass
class CaseResult:
    case: str
    base: List[float] = field(default_factory=list)
    new: List[float] = field(default_factory=list)
    skipped: Optional[str] = None

    @property
    def ratios(self) -> List[float]:
        return [n / b for b, n in zip(self.base, self.new)]

    def verdict(self, threshold: float) -> str:
        """``slower`` / ``faster`` when every round agrees and the median ratio
        is past the threshold; ``same`` otherwise (noise)."""
        if self.skipped or not self.ratios:
            return "-"
        ratios = self.ratios
        median = statistics.median(ratios)
        if all(r > 1 for r in ratios) and median >= threshold:
            return "slower"
        if all(r < 1 for r in ratios) and median <= 1 / threshold:
            return "faster"
        return "same"

    def as_dict(self, threshold: float) -> Dict[str, Any]:
        ratios = self.ratios
        return {"case": self.case, "skipped": self.skipped, "base_s": self.base, "new_s": self.new,
                "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None,
                "verdict": self.verdict(threshold)}


def _summary(samples: List[float], statistic: str) -> float:
    return min(samples) if statistic == "min" else statistics.median(samples)


def run_rounds(start: Callable[[str, int], Side], cases: Sequence[str], rounds: int, quick: bool,
               log: IO[str]) -> Tuple[List[CaseResult], str]:
    """Each round, fresh interpreters of both sides (``start(label,
    heap_shift)``), with the same heap shift, the next of HEAP_SHIFTS; each
    case: the two sides take turns sample by sample (base first on even
    turns), so that a burst of load falls on both; a side's time for the
    round is the fastest of its samples (the median for cases whose samples
    vary by nature, such as an allocation behind a kernel). Also the device
    the sides measured."""
    results = {case: CaseResult(case) for case in cases}
    device = ""
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", file=log, flush=True)
        shift = HEAP_SHIFTS[r % len(HEAP_SHIFTS)]
        base = start("base", shift)
        try:
            new = start("new", shift)
            try:
                device = base.device
                _run_round(base, new, r, results, quick)
            finally:
                new.close()
        finally:
            base.close()
    return list(results.values()), device


def _run_round(base: Side, new: Side, r: int, results: Dict[str, CaseResult], quick: bool) -> None:
    """One round of every case on the two sides' interpreters, each case's
    first sample on each side left out (a cold start: the first array, the
    first kernel, the first miss)."""
    for case in results:
        result = results[case]
        if result.skipped:
            continue
        spec = CASES[case]
        samples: Dict[str, List[float]] = {"base": [], "new": []}
        for side in (base, new):            # fresh interpreters: a first sample pays first-use costs
            answer = side.measure(case, quick)
            if "skipped" in answer:
                result.skipped = f"{side.label}: {answer['skipped']}"
                break
        if result.skipped:
            continue
        for turn in range(max(3, spec.samples // 2) if quick else spec.samples):
            for side in ((base, new) if (r + turn) % 2 == 0 else (new, base)):
                answer = side.measure(case, quick)
                if "skipped" in answer:
                    result.skipped = f"{side.label}: {answer['skipped']}"
                    break
                samples[side.label].append(answer["seconds"])
            if result.skipped:
                break
        if not result.skipped:
            result.base.append(_summary(samples["base"], spec.statistic))
            result.new.append(_summary(samples["new"], spec.statistic))


def _ratio_cell(result: CaseResult) -> List[str]:
    if result.skipped or not result.ratios:
        return ["-", "-"]
    ratios = result.ratios
    return [f"{_ratio(statistics.median(ratios))}x", f"{_ratio(min(ratios))}-{_ratio(max(ratios))}"]


def _ratio(value: float) -> str:
    """Two decimals, or two significant digits for ratios that small."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def print_results(results: List[CaseResult], base_label: str, new_label: str, threshold: float) -> str:
    rows = []
    for r in results:
        base = format_time(statistics.median(r.base)) if r.base else "-"
        new = format_time(statistics.median(r.new)) if r.new else "-"
        rows.append([r.case, base, new, *_ratio_cell(r), r.verdict(threshold) if not r.skipped
                     else f"skipped ({r.skipped})"])
    return print_table(f"new ({new_label}) against base ({base_label}): median time per operation, "
                       f"ratio new/base per round (median, lowest-highest); real only when every round "
                       f"agrees and the median is past {threshold:.2f}x",
                       ["case", "base", "new", "ratio", "spread", "verdict"], rows)


def targets(results: List[CaseResult]) -> List[Dict[str, Any]]:
    """The hot path's targets, judged on the new tree's per-round ratios
    (median with its spread), never on one time."""
    by_case = {r.case: r for r in results if not r.skipped and r.new}

    def ratio(numerator: str, denominator: str) -> Optional[List[float]]:
        if numerator not in by_case or denominator not in by_case:
            return None
        return [n / d for n, d in zip(by_case[numerator].new, by_case[denominator].new)]

    out = []
    for name, numerator, denominator, limit in (
            ("Python-API pair <= 2.5x a pair of dict.get calls", "accelerator pair", "dict.get pair (floor)", 2.5),
            ("namespace pair within 25% of the accelerator pair", "namespace pair", "accelerator pair", 1.25),
            ("behind 100 pending events of one stream, a pair within 25% of one behind 1",
             "core pair, 100 events pending", "core pair, 1 event pending", 1.25),
            ("with a kernel in flight, unimem.xpu.empty <= 3x dpnp.empty",
             "in flight: unimem.xpu.empty", "in flight: dpnp.empty (peer)", 3.0),
            ("with a kernel in flight, dpnp.empty pooled <= 3x dpnp.empty",
             "in flight: dpnp.empty pooled", "in flight: dpnp.empty (peer)", 3.0)):
        ratios = ratio(numerator, denominator)
        if ratios:
            median = statistics.median(ratios)
            out.append({"target": name, "measured": f"{_ratio(median)}x ({_ratio(min(ratios))}-{_ratio(max(ratios))})",
                        "met": median <= limit})
    core = by_case.get("typed core pair")
    if core:
        median = statistics.median(core.new)
        out.append({"target": "typed core pair <= 50 ns", "measured": format_time(median), "met": median <= 50e-9})
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__.splitlines()[0])
    parser.add_argument("base", metavar="REV", nargs="?",
                        help="the base revision (anything git rev-parse takes)")
    parser.add_argument("--base-tree", help="a checkout to use as the base instead of REV, built in place")
    parser.add_argument("--new-tree", default=REPO,
                        help="the tree to judge, built in place (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                        help=f"interleaved rounds (at least {MIN_ROUNDS}; default {MIN_ROUNDS})")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                        help=f"cases to run (default: all: {', '.join(CASES)})")
    parser.add_argument("--quick", action="store_true", help="shorter loops in each round")
    parser.add_argument("--threshold", type=float, default=THRESHOLD,
                        help="the ratio a real difference must pass (default 1.10)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 on a real slowdown")
    parser.add_argument("--cache", default=os.environ.get(CACHE_ENV, DEFAULT_CACHE),
                        help=f"where base worktrees are kept (default {DEFAULT_CACHE}, or ${CACHE_ENV})")
    parser.add_argument("--device", choices=("cpu", "xpu", "cuda"),
                        help="UNIMEM_DEVICE for both sides (default: this machine's default device; "
                             "cpu with --instructions)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per operation under callgrind (needs valgrind) instead of "
                             "timing: the host-code cases only, noise free")
    arguments = parser.parse_args(argv)
    if (arguments.base is None) == (arguments.base_tree is None):
        parser.error("give the base as REV or as --base-tree, not both")
    if arguments.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    if arguments.threshold <= 1:
        parser.error("--threshold must be above 1")
    log = sys.stderr
    cases = arguments.cases or list(CASES)
    if arguments.instructions:
        return _main_instructions(arguments, [case for case in cases if CASES[case].counted], log)
    try:
        trees = _trees(arguments, log)
        base_tree, new_tree = trees["base"], trees["new"]
        env = dict(os.environ)
        if arguments.device:
            env["UNIMEM_DEVICE"] = arguments.device
        cpu = shared_cpu()
        sides = {"base": base_tree, "new": new_tree}
        results, device = run_rounds(lambda label, shift: Side(label, sides[label], env, cpu, shift),
                                     cases, arguments.rounds, arguments.quick, log)
    except CompareError as exc:
        print(f"python -m benchmarks compare: {exc}", file=sys.stderr)
        return 2
    base_label = base_tree if arguments.base_tree else f"{arguments.base} = {os.path.basename(base_tree)[:10]}"
    table = print_results(results, base_label, new_tree, arguments.threshold)
    hot = targets(results)
    if hot:
        print_table("targets (the new tree; ratios per round: median, lowest-highest)",
                    ["target", "measured", "result"],
                    [[t["target"], t["measured"], "met" if t["met"] else "NOT MET"] for t in hot], text_columns=3)
    write_json("compare", {"base": arguments.base or base_tree, "base_tree": base_tree, "new_tree": new_tree,
                           "device": device, "rounds": arguments.rounds, "quick": arguments.quick,
                           "threshold": arguments.threshold, "table": table, "targets": hot,
                           "cases": [r.as_dict(arguments.threshold) for r in results]})
    slower = [r.case for r in results if r.verdict(arguments.threshold) == "slower"]
    if slower:
        print(f"slower than {arguments.base or base_tree}: {', '.join(slower)}", flush=True)
    return 1 if arguments.strict and slower else 0


def _trees(arguments: argparse.Namespace, log: IO[str]) -> Dict[str, str]:
    """The base and new trees, built in place (the base checked out first when named by revision)."""
    if arguments.base_tree:
        base_tree = os.path.abspath(arguments.base_tree)
        build_in_place(base_tree, log)
    else:
        base_tree = checkout(arguments.base, arguments.cache, log)
    new_tree = os.path.abspath(arguments.new_tree)
    build_in_place(new_tree, log)
    return {"base": base_tree, "new": new_tree}


def _main_instructions(arguments: argparse.Namespace, cases: List[str], log: IO[str]) -> int:
    """``--instructions``: each counted case's instructions per operation on both trees."""
    if not cases:
        print("python -m benchmarks compare: --instructions counts only the host-code cases: "
              + ", ".join(name for name, case in CASES.items() if case.counted), file=sys.stderr)
        return 2
    device = arguments.device or "cpu"
    try:
        trees = _trees(arguments, log)
        envs = {side: tree_env(tree, dict(os.environ, UNIMEM_DEVICE=device)) for side, tree in trees.items()}
        results: List[CountedCase] = count_cases(WORKER, trees, envs, cases, log)
    except (CompareError, InstructionCountError) as exc:
        print(f"python -m benchmarks compare: {exc}", file=sys.stderr)
        return 2
    base_label = trees["base"] if arguments.base_tree else f"{arguments.base} = {os.path.basename(trees['base'])[:10]}"
    table = print_table(
        f"new ({trees['new']}) against base ({base_label}) on {device}: instructions per operation (callgrind), "
        f"ratio new/base; real past {INSTRUCTION_THRESHOLD:.2f}x (counts, not time: the timed rounds say how "
        f"much they cost)", ["case", "base", "new", "ratio", "verdict"], table_rows(results))
    write_json("compare", {"base": arguments.base or trees["base"], "base_tree": trees["base"],
                           "new_tree": trees["new"], "device": device, "mode": "instructions",
                           "threshold": INSTRUCTION_THRESHOLD, "table": table,
                           "cases": [r.as_dict() for r in results]})
    slower = [r.case for r in results if r.verdict() == "slower"]
    if slower:
        print(f"more instructions than {arguments.base or trees['base']}: {', '.join(slower)}", flush=True)
    return 1 if arguments.strict and slower else 0
