"""Run unimem's benchmarks and summarise their targets.

    python -m benchmarks                 # all of them (a few minutes)
    python -m benchmarks --quick         # fewer repeats: about 1.5 minutes on 2 cores without a GPU
    python -m benchmarks memory threads  # some of them, by name
    python -m benchmarks soak            # the long run (not in the default set)
    python -m benchmarks compare REV     # the working tree against REV, A/B interleaved (compare.py)

Each benchmark prints its own table and writes ``benchmarks/results/<name>.json``;
this runner then prints every target, met or not, and writes
``benchmarks/results/summary.json``. ``--strict`` makes a missed target a
failing exit status.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any, Dict, List

from ._common import print_table, verdict, write_json

BENCHMARKS = {
    "hot_path": "bench_hot_path",
    "scaling": "bench_scaling",
    "memory": "bench_memory",
    "facade": "bench_facade",
    "threads": "bench_threads",
    "xpu": "bench_xpu",
    "dpnp": "bench_dpnp",
    "sycl_interposer": "bench_sycl_interposer",
    "cuda": "bench_cuda",
    "cuda_expandable": "bench_cuda_expandable",
    "sleep": "bench_sleep",
    "capi": "bench_capi",
    "soak": "soak",
}
DEFAULT = [name for name in BENCHMARKS if name != "soak"]


def main(argv: List[str]) -> int:
    if argv[:1] == ["compare"]:
        from .compare import main as compare
        return compare(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="run unimem's benchmarks")
    parser.add_argument("names", nargs="*", metavar="name",
                        help=f"benchmarks to run (default: {' '.join(DEFAULT)}); also: soak")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (about 1.5 minutes on 2 cores without a GPU)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a target is missed")
    arguments = parser.parse_args(argv)
    unknown = [name for name in arguments.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    names = arguments.names or DEFAULT
    summary: Dict[str, Any] = {"quick": arguments.quick, "benchmarks": {}}
    rows = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f".{BENCHMARKS[name]}", __package__)
        result = module.run(arguments.quick)
        elapsed = time.perf_counter() - start
        targets = result.get("targets", [])
        summary["benchmarks"][name] = {"seconds": elapsed, "targets": targets,
                                       "skipped": result.get("skipped")}
        if result.get("skipped"):
            rows.append([name, "-", f"not run: {result['skipped']}", "-"])
        for target in targets:
            rows.append([name, target["target"], target["measured"], verdict(target["met"])])
    print()
    print_table("all targets", ["benchmark", "target", "measured", "result"], rows, text_columns=4)
    missed = sum(row[3] == verdict(False) for row in rows)
    summary["missed"] = missed
    write_json("summary", summary)
    return 1 if arguments.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
