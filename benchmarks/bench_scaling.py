"""Scaling: the cost of one alloc+free with 10, 1,000 and 100,000 free blocks
of distinct sizes cached.

On a simulated device, free blocks of distinct sizes are kept apart by live
separators (so they cannot merge). Then, through the typed core (no Python in
between):

* an exact hit: a request for a size the cache holds;
* a best fit: a request for a size it does not hold, served by the next larger.

Target: O(1) or O(log n): with 100,000 free blocks, at most 2x the
cost with 10.
"""
from __future__ import annotations

from typing import Any, Dict, List

from ._common import best_of, command_line, format_time, print_table, report
from ._timing import time_hot_path

MiB = 1 << 20
COUNTS = [10, 1_000, 100_000]
HOLE = 2 * MiB            # large-pool sizes: 2 MiB + 1 KiB steps
STEP = 1024
SEPARATOR = MiB + 512     # a live large-pool block between two holes


def cached_allocator(count: int):
    """An allocator with at least ``count`` free blocks of distinct sizes (a
    hole next to a segment's free tail merges with it, hence a few extra)."""
    from unimem import _core
    from unimem.backends.simulated import SimulatedBackend
    allocator = _core.CachingAllocator(SimulatedBackend(capacity=1 << 50), 0)
    holes: List[int] = []
    separators: List[int] = []
    for i in range(count + count // 25 + 1):
        holes.append(allocator.malloc(HOLE + STEP * i))
        separators.append(allocator.malloc(SEPARATOR))
    for hole in holes:
        allocator.free(hole)
    return allocator, separators            # the separators stay live


def run(quick: bool = False) -> Dict[str, Any]:
    pairs = 20_000 if quick else 100_000
    repeats = 3 if quick else 7
    rows = []
    for count in COUNTS:
        allocator, _separators = cached_allocator(count)
        exact = HOLE + STEP * (count // 2)               # held by the cache
        between = exact + 512                            # not held: the next larger serves it
        free_blocks = allocator.free_block_count()
        rows.append({
            "free_blocks": free_blocks,
            "exact_hit_s": best_of(lambda: time_hot_path(allocator, exact, pairs), repeats) * 1e-9,
            "best_fit_s": best_of(lambda: time_hot_path(allocator, between, pairs), repeats) * 1e-9,
        })
    base = rows[0]
    for row in rows:
        row["exact_vs_fewest"] = row["exact_hit_s"] / base["exact_hit_s"]
        row["best_fit_vs_fewest"] = row["best_fit_s"] / base["best_fit_s"]
    print_table("alloc+free with many free blocks cached (typed core, simulated device)",
                ["free blocks cached", "exact hit", "vs fewest", "best fit", "vs fewest"],
                [[f"{r['free_blocks']:,}", format_time(r["exact_hit_s"]), f"{r['exact_vs_fewest']:.2f}x",
                  format_time(r["best_fit_s"]), f"{r['best_fit_vs_fewest']:.2f}x"] for r in rows])
    last = rows[-1]
    targets = [{"target": f"exact hit with {last['free_blocks']:,} free blocks <= 2x with {base['free_blocks']}",
                "measured": f"{last['exact_vs_fewest']:.2f}x", "met": last["exact_vs_fewest"] <= 2.0},
               {"target": f"best fit with {last['free_blocks']:,} free blocks <= 2x with {base['free_blocks']}",
                "measured": f"{last['best_fit_vs_fewest']:.2f}x", "met": last["best_fit_vs_fewest"] <= 2.0}]
    return report("scaling", targets, rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
