"""dpnp's C++ scratch buffers from the pools: ``set_allocator()`` with the SYCL interposer and without.

The workloads of ``bench_dpnp`` (``WORKLOADS``: an MLP training step,
k-means, linalg/FFT/sort), each run with ``unimem.xpu.set_allocator()``
alone and with the SYCL interposer installed too (``python -m unimem run
--sycl-interpose``: the USM requests of dpnp's compiled extensions served by
the pools as well). The interposer binds dpnp's extensions for the life of a
process, so each configuration runs in a fresh interpreter: per repeat one
child of each, in alternating order, from the same seed, each workload warmed
up first.

Per workload: the median time per iteration of either configuration; from
the interposed runs, in the steady state, the C++ USM calls per iteration
and the share of those calls and of their bytes the pools served, the
requests forwarded to libsycl by reason, and the pool blocks given back by
path (at once on SYCL host-task threads, after a wait from Python code).
Results must be identical between the two configurations.

Targets: results identical; no workload slower with the interposer than
without; every block served back in its pool after the run (nothing held).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy

from ._common import format_time, print_table, report

# Iterations of each workload relative to the others (each about as long).
ITERATIONS_OF = {"mlp": 5, "mlp_small": 5, "kmeans": 1, "linalg_fft_sort": 1}
MODES = ("alone", "interposed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# one configuration, in its own interpreter
# ---------------------------------------------------------------------------
def child(mode: str, seed: int, warmup: int, iterations: int, out_dir: str) -> Dict[str, Any]:
    """Run every workload with ``set_allocator()`` (and the interposer when
    ``mode`` is ``"interposed"``); results go to ``out_dir``."""
    import unimem  # noqa: F401  (finds the OpenCL CPU runtime before dpctl looks for devices)
    import unimem.xpu as xpu
    from unimem._integrations import sycl_interposer as interposer
    if mode == "interposed":
        interposer.install(xpu._pool_for)     # before dpnp is imported
    import dpnp as dp

    from .bench_dpnp import WORKLOADS
    xpu.set_allocator()
    queue = dp.empty(1).sycl_queue
    rows = {}
    for name, make in WORKLOADS.items():
        steps = iterations * ITERATIONS_OF.get(name, 1)
        step, result = make(dp, seed)
        for _ in range(warmup):
            step()
        queue.wait()
        before = interposer.counters()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        queue.wait()
        elapsed = time.perf_counter() - start
        xpu.synchronize()
        after = interposer.counters()
        numpy.savez(os.path.join(out_dir, f"{mode}-{name}.npz"), *result())
        del step, result
        rows[name] = {"seconds_per_iteration": elapsed / steps, "iterations": steps,
                      "counters": {key: after[key] - before[key] for key in after}}
    xpu.synchronize()
    return {"mode": mode, "workloads": rows, "live_blocks": interposer.counters()["live.blocks"]}


def _run_child(mode: str, seed: int, warmup: int, iterations: int, out_dir: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_sycl_interposer", "--child", mode,
                           "--seed", str(seed), "--warmup", str(warmup), "--iterations", str(iterations),
                           "--out", out_dir], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} run failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _identical(a_path: str, b_path: str) -> bool:
    with numpy.load(a_path) as a, numpy.load(b_path) as b:
        return a.files == b.files and all(a[k].dtype == b[k].dtype and numpy.array_equal(a[k], b[k], equal_nan=True)
                                          for k in a.files)


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------
def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def run(quick: bool = False) -> Dict[str, Any]:
    from unimem._runtime import devices as _devices
    try:
        import dpnp  # noqa: F401
    except ImportError:
        return {"benchmark": "sycl_interposer", "skipped": "dpnp is not installed"}
    if not _devices.is_available("xpu"):
        return {"benchmark": "sycl_interposer", "skipped": f"no SYCL device: {_devices.unavailable_reason('xpu')}"}
    repeats, warmup, iterations = (2, 2, 3) if quick else (5, 3, 10)
    times: Dict[str, Dict[str, List[float]]] = {}
    totals: Dict[str, Dict[str, int]] = {}
    steps: Dict[str, int] = {}
    identical: Dict[str, bool] = {}
    live = 0
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            seed = 4321 + repeat
            out_dir = os.path.join(scratch, str(repeat))
            os.makedirs(out_dir)
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            runs = {mode: _run_child(mode, seed, warmup, iterations, out_dir) for mode in order}
            live = max(live, runs["interposed"]["live_blocks"])
            for name, row in runs["interposed"]["workloads"].items():
                for mode in MODES:
                    times.setdefault(name, {m: [] for m in MODES})[mode].append(
                        runs[mode]["workloads"][name]["seconds_per_iteration"])
                total = totals.setdefault(name, {})
                for key, value in row["counters"].items():
                    total[key] = total.get(key, 0) + value
                steps[name] = steps.get(name, 0) + row["iterations"]
                same = _identical(os.path.join(out_dir, f"alone-{name}.npz"),
                                  os.path.join(out_dir, f"interposed-{name}.npz"))
                identical[name] = identical.get(name, True) and same
    from unimem._integrations.sycl_interposer import REASONS
    rows = []
    for name, total in totals.items():
        calls = total["pooled.calls"] + total["bypassed.calls"] + total["refused.calls"]
        nbytes = total["pooled.bytes"] + total["bypassed.bytes"] + total["refused.bytes"]
        alone, interposed = (statistics.median(times[name][mode]) for mode in MODES)
        rows.append({
            "workload": name, "alone_s": alone, "interposed_s": interposed, "speedup": alone / interposed,
            "alone_runs_s": times[name]["alone"], "interposed_runs_s": times[name]["interposed"],
            "cxx_calls_per_iteration": calls / steps[name], "cxx_bytes_per_iteration": nbytes / steps[name],
            "pooled_calls_share": _share(total["pooled.calls"], calls),
            "pooled_bytes_share": _share(total["pooled.bytes"], nbytes),
            "bypassed_by_reason": {reason: total[f"bypassed.{reason}.calls"] for reason in REASONS
                                   if total[f"bypassed.{reason}.calls"]},
            "frees": {path: total[f"frees.{path}"] for path in ("at_once", "at_once_holding_gil", "after_wait",
                                                                "bypassed")},
            "counters": total, "identical": identical[name],
        })
    print_table(f"set_allocator() alone vs with the SYCL interposer (dpnp's C++ scratch from the pools too); "
                f"median of {repeats} interleaved runs, each in its own interpreter",
                ["workload", "alone / iter", "interposed / iter", "speedup", "C++ calls / iter", "pooled (calls)",
                 "pooled (bytes)", "forwarded (why)", "frees: at once / after wait", "identical"],
                [[r["workload"], format_time(r["alone_s"]), format_time(r["interposed_s"]), f"{r['speedup']:.2f}x",
                  f"{r['cxx_calls_per_iteration']:.1f}", f"{100 * r['pooled_calls_share']:.1f}%",
                  f"{100 * r['pooled_bytes_share']:.1f}%",
                  ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r["bypassed_by_reason"].items()) or "-",
                  f"{r['frees']['at_once'] + r['frees']['at_once_holding_gil']} / {r['frees']['after_wait']}",
                  "yes" if r["identical"] else "NO"] for r in rows])
    slowest = min(rows, key=lambda r: r["speedup"])
    different = [r["workload"] for r in rows if not r["identical"]]
    targets = [
        {"target": "results identical with and without the interposer",
         "measured": "identical" if not different else f"differ: {', '.join(different)}", "met": not different},
        {"target": "no workload slower with the interposer",
         "measured": f"slowest {slowest['speedup']:.2f}x ({slowest['workload']})", "met": slowest["speedup"] >= 1.0},
        {"target": "every served block back in its pool after the run",
         "measured": f"{live} held", "met": live == 0},
    ]
    return report("sycl_interposer", targets, quick=quick, repeats=repeats, warmup=warmup, workloads=rows)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for a quick look)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=".", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.seed, args.warmup, args.iterations, args.out)))
    else:
        run(args.quick)


if __name__ == "__main__":
    main(sys.argv[1:])
