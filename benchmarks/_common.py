"""What every benchmark shares: timing, tables, JSON, the machine's description."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

# Where results go: benchmarks/results, or UNIMEM_BENCHMARK_RESULTS (a test's
# scratch folder, so that running the benchmarks there leaves the recorded ones alone).
RESULTS_ENV = "UNIMEM_BENCHMARK_RESULTS"
RESULTS_DIR = os.environ.get(RESULTS_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

SIZE_NAMES = {512: "512 B", 4096: "4 KiB", 65536: "64 KiB", 1 << 20: "1 MiB", 4 << 20: "4 MiB",
              16 << 20: "16 MiB", 64 << 20: "64 MiB", 256 << 20: "256 MiB", 1 << 30: "1 GiB"}


def size_name(size: int) -> str:
    return SIZE_NAMES.get(size, f"{size} B")


def seconds_per_call(fn: Callable[[], Any], *, min_time: float = 0.02, repeats: int = 5,
                     max_calls: int = 1_000_000) -> float:
    """Median over ``repeats`` runs of the mean time of one call; each run
    makes enough calls to last ``min_time`` (calibrated first)."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time / 4 or calls >= max_calls:
            break
        calls *= 4
    calls = max(1, min(max_calls, int(calls * min_time / max(elapsed, 1e-9))))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def median_of(measure: Callable[[], float], repeats: int = 5) -> float:
    """Median of a measurement that times itself (e.g. a C loop returning ns)."""
    measure()
    return statistics.median(measure() for _ in range(repeats))


def best_of(measure: Callable[[], float], repeats: int = 5) -> float:
    """Fastest of ``repeats`` runs of a measurement that times itself.

    For the nanosecond-scale loops the noise only ever adds time (another
    process, an interrupt, a frequency step), so the fastest run is the best
    estimate of the code's own cost, as ``timeit`` advises."""
    measure()
    return min(measure() for _ in range(repeats))


def median_and_range(values: Sequence[float]) -> str:
    """``"1.23 (1.01-1.50)"``: the median of per-round values (ratios, rates)
    with the lowest and the highest."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def format_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.2f} ms"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]],
                text_columns: int = 1) -> str:
    """Print (and return) a table; the first ``text_columns`` columns are
    aligned left, the figures after them right."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [title, line, "| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |", line]
    for row in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) if i >= text_columns else c.ljust(w)
                                     for i, (c, w) in enumerate(zip(row, widths))) + " |")
    out.append(line)
    text = "\n".join(out)
    print(text, flush=True)
    return text


def machine() -> Dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(name: str, payload: Dict[str, Any], out_dir: Optional[str] = None) -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(dict(payload, machine=machine()), f, indent=2)
    print(f"wrote {path}", flush=True)
    return path


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


def targets_table(title: str, targets: List[Dict[str, Any]]) -> None:
    print_table(title, ["target", "measured", "result"],
                [[t["target"], t["measured"], verdict(t["met"])] for t in targets], text_columns=3)


def report(name: str, targets: List[Dict[str, Any]], **payload: Any) -> Dict[str, Any]:
    """The end of every benchmark: its targets as a table, its results as
    ``results/<name>.json``; returns the results."""
    targets_table(f"{name.replace('_', ' ')} targets", targets)
    result = dict(payload, benchmark=name, targets=targets)
    write_json(name, result)
    return result


def command_line(run: Callable[[bool], Any], description: str) -> None:
    """``python -m benchmarks.bench_x [--quick]`` for one benchmark's ``run``."""
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for a quick look)")
    run(parser.parse_args().quick)
