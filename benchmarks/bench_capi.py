"""unimem's C ABI: ``unimem_cpu_malloc`` + ``unimem_cpu_free`` pairs of sizes
already cached, called through the library's exported functions as C code
(or PyTorch's pluggable allocator) calls them, from threads that hold no GIL.

Peers in the same run, each at the same sizes:

* glibc ``malloc`` + ``free``: a general-purpose allocator with per-thread caches;
* the typed core pair: ``CachingAllocator.c_malloc`` + ``c_free`` with no
  Python between them (what every Python-facing entry ends in);
* the cache-hit path alone without the GIL (``_malloc_cached`` under the lock),
  the floor that the ABI's own steps (finding the allocator, the GIL check,
  the calls through the library) add to.

One thread, then two threads at once on one pool (this machine has 2 cores):
the total throughput, and how it holds up against one thread.

Targets: the ABI pair within 2x the typed core pair at every size (a hit costs
the ABI only a table lookup and a GIL check more; the ratio is the median of
rounds that time the two back to back), and two C threads together at least
half of one thread's throughput (no collapse on the shared lock).
"""
from __future__ import annotations

import ctypes
import os
import statistics
from typing import Any, Callable, Dict, List

from ._common import best_of, command_line, median_and_range, print_table, report, size_name
from ._timing import time_capi_pairs, time_hot_path, time_libc_pairs
from .bench_threads import throughput

SIZES = [512, 65536, 4 << 20]
ABI_VS_CORE = 2.0
FLOOR = 0.5


def interleaved_ratio(measure: Callable[[], float], base: Callable[[], float], rounds: int) -> List[float]:
    """``measure() / base()`` per round, the two back to back and which goes
    first alternating: drift of a shared machine falls on both alike."""
    ratios = []
    for round_index in range(rounds):
        if round_index % 2:
            b = base()
            m = measure()
        else:
            m = measure()
            b = base()
        ratios.append(m / b)
    return ratios


def thread_scaling(work: Callable[[int], Any], pairs: int, rounds: int) -> Dict[str, Any]:
    """One thread's and two threads' throughput (pairs per second, all
    threads together; the best round of each), and two against one: the
    median of rounds that run both back to back (see interleaved_ratio)."""
    best = {1: 0.0, 2: 0.0}

    def rate(threads: int) -> float:
        value = throughput(work, threads, pairs)
        best[threads] = max(best[threads], value)
        return value
    work(min(pairs, 1000))
    ratios = interleaved_ratio(lambda: rate(2), lambda: rate(1), rounds)
    return {"t1_per_s": best[1], "t2_per_s": best[2], "t2_vs_t1": statistics.median(ratios),
            "t2_vs_t1_rounds": ratios}


def _exported(name: str) -> int:
    import unimem.capi
    return ctypes.cast(getattr(ctypes.CDLL(unimem.capi.library_path()), name), ctypes.c_void_p).value


def run(quick: bool = False) -> Dict[str, Any]:
    import unimem

    repeats = 3 if quick else 5
    pairs = 50_000 if quick else 400_000
    allocator = unimem.cpu.caching_allocator(0)
    malloc_address, free_address = _exported("unimem_cpu_malloc"), _exported("unimem_cpu_free")
    for size in SIZES:                  # two of each cached, and the C tables set up
        live = [allocator.malloc(size) for _ in range(2)]
        for ptr in live:
            allocator.free(ptr)
        time_capi_pairs(malloc_address, free_address, size, 10)
    before = allocator.memory_stats()

    ways: Dict[str, Callable[[int, int], Any]] = {
        "glibc malloc+free (peer)": lambda size, n: time_libc_pairs(size, n),
        "typed core pair (c_malloc+c_free)": lambda size, n: time_hot_path(allocator, size, n),
        "hit path alone, no GIL": lambda size, n: time_hot_path(allocator, size, n, release_gil=True),
        "C ABI (unimem_cpu_malloc+free)": lambda size, n: time_capi_pairs(malloc_address, free_address, size, n),
    }
    rows: List[Dict[str, Any]] = []
    for name, way in ways.items():
        for size in SIZES:
            row: Dict[str, Any] = {"way": name, "size": size}
            row["ns_per_pair"] = best_of(lambda: way(size, pairs), repeats)
            if name != "typed core pair (c_malloc+c_free)":       # it holds the GIL: one thread at a time
                row.update(thread_scaling(lambda n: way(size, n), pairs, repeats))
            rows.append(row)

    def rate(row: Dict[str, Any], key: str) -> str:
        return f"{row[key] / 1e6:.2f} M/s" if key in row else "-"

    print_table(f"alloc+free pairs, cached sizes ({os.cpu_count()} cores; threads share one cpu pool)",
                ["way in", "size", "ns per pair", "1 thread", "2 threads", "2 vs 1 (median of rounds)"],
                [[r["way"], size_name(r["size"]), f"{r['ns_per_pair']:.1f}", rate(r, "t1_per_s"),
                  rate(r, "t2_per_s"), f"{r['t2_vs_t1']:.2f}x" if "t2_vs_t1" in r else "-"] for r in rows],
                text_columns=2)
    by = {(r["way"], r["size"]): r for r in rows}
    abi = "C ABI (unimem_cpu_malloc+free)"
    core, through_abi = ways["typed core pair (c_malloc+c_free)"], ways[abi]
    per_round = {size: interleaved_ratio(lambda: through_abi(size, pairs), lambda: core(size, pairs), repeats)
                 for size in SIZES}
    print_table("C ABI pair / typed core pair, per round back to back (median, lowest-highest)",
                ["size", "ratio"], [[size_name(size), median_and_range(per_round[size])] for size in SIZES])
    ratios = {size: statistics.median(values) for size, values in per_round.items()}
    if allocator.memory_stats()["num_device_alloc"] != before["num_device_alloc"]:
        raise RuntimeError("a timed pair missed the cache: the figures would not be the hit path's")
    worst_size = max(ratios, key=lambda size: ratios[size])
    scaling = {size: by[(abi, size)]["t2_vs_t1"] for size in SIZES}
    worst_scaling = min(scaling, key=lambda size: scaling[size])
    targets = [
        {"target": f"C ABI pair <= {ABI_VS_CORE}x the typed core pair, every size",
         "measured": f"worst {ratios[worst_size]:.2f}x at {size_name(worst_size)}",
         "met": ratios[worst_size] <= ABI_VS_CORE},
        {"target": f"no collapse: two C threads >= {FLOOR} x one thread's throughput, every size",
         "measured": f"worst {scaling[worst_scaling]:.2f}x at {size_name(worst_scaling)}",
         "met": scaling[worst_scaling] >= FLOOR},
    ]
    return report("capi", targets, rows=rows, sizes=SIZES, pairs=pairs, abi_vs_core=ratios)


if __name__ == "__main__":
    command_line(run, __doc__)
