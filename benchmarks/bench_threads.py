"""Threads: 1, 2 and 4 threads allocating and freeing at once, on one
allocator; total throughput (alloc+free pairs per second, all threads
together) and how it holds up against one thread.

* typed core, GIL released: the cache-hit path exactly as ``c_malloc`` and
  ``c_free`` take it, so threads really contend for the allocator's lock;
* Python API: ``unimem.accelerator.caching_allocator_alloc/delete`` (the GIL
  serialises Python code; the question is only that nothing collapses);
* peer: glibc ``malloc``+``free`` (per-thread caches, no shared lock).

This machine has 2 cores: above 2 threads, more throughput cannot come from
parallelism, so a flat line is the best a shared pool can do.

One shared pool cannot go faster with more threads; what it must not do is
collapse (waiters stealing the lock's cache line from the holder, or spinning
while a preempted holder waits for their core). Target: with 2 and
4 threads, total throughput at least half of one thread's, for every way in.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, List

from ._common import command_line, print_table, report
from ._timing import time_hot_path, time_libc_pairs

THREADS = [1, 2, 4]
SIZES = [512, 65536, 4 << 20, 1000, 3 << 20]
FLOOR = 0.5


def throughput(work: Callable[[int], None], threads: int, pairs: int) -> float:
    """Pairs per second with ``threads`` threads each running ``work(pairs)``."""
    barrier = threading.Barrier(threads + 1)
    errors: List[BaseException] = []

    def body() -> None:
        try:
            barrier.wait()
            work(pairs)
        except BaseException as exc:          # reported below, not lost in a thread
            errors.append(exc)

    workers = [threading.Thread(target=body) for _ in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return threads * pairs / elapsed


def best_throughput(work: Callable[[int], None], threads: int, pairs: int, repeats: int) -> float:
    work(min(pairs, 1000))
    return max(throughput(work, threads, pairs) for _ in range(repeats))


def prefill(allocator: Any, copies: int) -> None:
    """Cache ``copies`` blocks of every size, so that that many threads
    holding one block each all find theirs in the cache."""
    live = [allocator.malloc(size) for size in SIZES for _ in range(copies)]
    for ptr in live:
        allocator.free(ptr)


def run(quick: bool = False) -> Dict[str, Any]:
    from unimem import accelerator
    from unimem._runtime import devices as _devices

    repeats = 3 if quick else 5
    dtype = _devices.current_type()
    allocator = dtype.allocator(dtype.current_index())
    n = len(SIZES)
    prefill(allocator, max(THREADS))

    def python_api(pairs: int) -> None:
        alloc, delete = accelerator.caching_allocator_alloc, accelerator.caching_allocator_delete
        for i in range(pairs):
            delete(alloc(SIZES[i % n]))

    ways = {
        "typed core (GIL released)": (lambda pairs: time_hot_path(allocator, SIZES, pairs, release_gil=True),
                                      200_000 if quick else 1_000_000),
        "Python API": (python_api, 20_000 if quick else 100_000),
        "glibc malloc+free (peer)": (lambda pairs: [time_libc_pairs(s, pairs // n) for s in SIZES],
                                     200_000 if quick else 1_000_000),
    }
    rows = []
    for name, (work, pairs) in ways.items():
        row: Dict[str, Any] = {"way": name}
        for threads in THREADS:
            row[f"t{threads}_per_s"] = best_throughput(work, threads, pairs, repeats)
        for threads in THREADS[1:]:
            row[f"t{threads}_vs_t1"] = row[f"t{threads}_per_s"] / row["t1_per_s"]
        rows.append(row)
    def rate(value: float) -> str:
        return f"{value / 1e6:.2f} M/s"

    print_table(f"alloc+free pairs per second, all threads together ({os.cpu_count()} cores, "
                f"one {dtype.name} allocator shared)",
                ["way in"] + [f"{t} thread{'s' if t > 1 else ''}" for t in THREADS] + ["2 vs 1", "4 vs 1"],
                [[r["way"]] + [rate(r[f"t{t}_per_s"]) for t in THREADS]
                 + [f"{r['t2_vs_t1']:.2f}x", f"{r['t4_vs_t1']:.2f}x"] for r in rows])
    unimem_rows = [r for r in rows if "peer" not in r["way"]]
    worst = min(unimem_rows, key=lambda r: min(r["t2_vs_t1"], r["t4_vs_t1"]))
    worst_ratio = min(worst["t2_vs_t1"], worst["t4_vs_t1"])
    targets = [{"target": f"no collapse: 2 and 4 threads >= {FLOOR} x one thread's throughput, every way in",
                "measured": f"worst {worst_ratio:.2f}x ({worst['way']})", "met": worst_ratio >= FLOOR}]
    return report("threads", targets, device=dtype.name, rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
