"""A long run: millions of allocator operations with process memory flat.

Random allocations and frees of many sizes (with statistics reads and cache
releases among them) on real host memory through the caching core, measuring
the process's resident memory after a warm-up and at the end. A leak of
bookkeeping (blocks, size classes, table entries) shows as growth.

    python -m benchmarks.soak                  # 10 million operations
    python -m benchmarks.soak --ops 300000     # the short form CI runs

Target: RSS growth under 5% after warm-up.
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any, Dict, List

from ._common import print_table, report

SIZES = [1, 100, 512, 4096, 70_000, 1 << 20, 3 << 20, 12 << 20]


def rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


# Seconds between progress lines: a long run says it is alive.
PROGRESS_EVERY = 3.0


def soak(ops: int, seed: int = 0, samples: int = 10, progress: bool = True) -> Dict[str, Any]:
    from unimem import _core
    from unimem.backends._host import PageAlignedBackend
    allocator = _core.CachingAllocator(PageAlignedBackend(), 0)
    rng = random.Random(seed)
    live: List[int] = []
    malloc, free = allocator.malloc, allocator.free
    warm_up = ops // 10
    rss: List[int] = []
    start = time.perf_counter()
    next_report = start + PROGRESS_EVERY
    for i in range(ops):
        r = rng.random()
        if r < 0.48 or not live:
            live.append(malloc(SIZES[int(r * 100) % len(SIZES)] + (i & 511)))
        elif r < 0.96:
            free(live.pop(int(r * 1000) % len(live)))
        elif r < 0.999:
            allocator.memory_stats()
        else:
            allocator.empty_cache()
        if len(live) > 256:
            free(live.pop(0))
        if i >= warm_up and (i - warm_up) % max((ops - warm_up) // samples, 1) == 0:
            rss.append(rss_bytes())
        if progress and i & 0xFFFF == 0 and time.perf_counter() >= next_report:
            # Checked every 65,536 operations: a clock read per operation would be measured too.
            print(f"  soak: {i:,} of {ops:,} operations, {time.perf_counter() - start:.0f} s, "
                  f"RSS {rss_bytes() / (1 << 20):.1f} MiB", flush=True)
            next_report = time.perf_counter() + PROGRESS_EVERY
    seconds = time.perf_counter() - start
    for p in live:
        free(p)
    allocator.empty_cache()
    allocator._check_invariants()
    rss.append(rss_bytes())
    growth = (max(rss) - rss[0]) / rss[0]
    return {"ops": ops, "seconds": seconds, "ns_per_op": seconds / ops * 1e9, "rss_after_warm_up": rss[0],
            "rss_max": max(rss), "rss_end": rss[-1], "rss_growth": growth,
            "reserved_after_empty_cache": allocator.memory_reserved()}


def run(quick: bool = False, ops: int = 10_000_000) -> Dict[str, Any]:
    result = soak(300_000 if quick else ops)
    mib = 1 << 20
    print_table(f"soak: {result['ops']:,} operations on host memory",
                ["operations", "time", "per op", "RSS after warm-up", "RSS peak", "RSS growth"],
                [[f"{result['ops']:,}", f"{result['seconds']:.1f} s", f"{result['ns_per_op']:.0f} ns",
                  f"{result['rss_after_warm_up'] / mib:.1f} MiB", f"{result['rss_max'] / mib:.1f} MiB",
                  f"{result['rss_growth']:.2%}"]])
    targets = [{"target": "RSS growth after warm-up < 5%", "measured": f"{result['rss_growth']:.2%}",
                "met": result["rss_growth"] < 0.05}]
    return report("soak", targets, **result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300,000 operations")
    parser.add_argument("--ops", type=int, default=10_000_000)
    arguments = parser.parse_args()
    run(arguments.quick, arguments.ops)
