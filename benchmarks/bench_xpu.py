"""XPU (SYCL USM) allocation: the pool against raw USM and against dpnp.

Two comparisons per size, from 512 B to 256 MiB, in one run:

* raw ``sycl::malloc_device`` + ``sycl::free`` (dpctl's C API, called from C)
  vs the pool's alloc + free of a cached block (the core, called from C);
* ``dpnp.empty`` vs ``unimem.xpu.empty`` (both from Python, array included).

Target: the pool pair at least 10x faster than the raw pair at
every size, and ``unimem.xpu.empty`` faster than ``dpnp.empty``.
"""
from __future__ import annotations

from typing import Any, Dict, List

from ._common import command_line, format_time, median_of, print_table, report, seconds_per_call, size_name
from ._timing import time_hot_path, time_raw_pairs

SIZES = [512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def run(quick: bool = False) -> Dict[str, Any]:
    import dpnp
    import unimem
    import unimem.xpu as xpu
    from unimem._runtime import devices as _devices

    if not _devices.is_available("xpu"):
        raise SystemExit(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
    backend = _devices.get_type("xpu").backend
    pool = xpu.allocator_for("device", 0)
    device = xpu.default_queue().sycl_device
    repeats = 3 if quick else 7
    rows: List[Dict[str, Any]] = []
    for size in SIZES:
        pairs = 200 if size >= (64 << 20) else 2000
        raw = median_of(lambda: time_raw_pairs(backend.raw, size, pairs), repeats) * 1e-9
        pooled = median_of(lambda: time_hot_path(pool, size, pairs * 10), repeats) * 1e-9
        count = max(size // 4, 1)
        dp = seconds_per_call(lambda: dpnp.empty(count, dtype="f4"), repeats=repeats,
                              min_time=0.01 if quick else 0.03)
        um = seconds_per_call(lambda: xpu.empty(count, dtype="f4"), repeats=repeats,
                              min_time=0.01 if quick else 0.03)
        rows.append({"size": size, "raw_usm_pair_s": raw, "pool_pair_s": pooled,
                     "pool_speedup": raw / pooled, "dpnp_empty_s": dp, "unimem_empty_s": um,
                     "empty_speedup": dp / um})
    print_table(f"XPU allocation on {device.name} ({device.backend}), one run",
                ["size", "raw USM malloc+free", "pool alloc+free", "pool vs raw",
                 "dpnp.empty", "unimem.xpu.empty", "unimem vs dpnp"],
                [[size_name(r["size"]), format_time(r["raw_usm_pair_s"]), format_time(r["pool_pair_s"]),
                  f"{r['pool_speedup']:.0f}x", format_time(r["dpnp_empty_s"]),
                  format_time(r["unimem_empty_s"]), f"{r['empty_speedup']:.2f}x"] for r in rows])
    worst_pool = min(rows, key=lambda r: r["pool_speedup"])
    worst_empty = min(rows, key=lambda r: r["empty_speedup"])
    targets = [
        {"target": "pool alloc+free >= 10x faster than raw USM, every size",
         "measured": f"worst {worst_pool['pool_speedup']:.0f}x at {size_name(worst_pool['size'])}",
         "met": worst_pool["pool_speedup"] >= 10},
        {"target": "unimem.xpu.empty faster than dpnp.empty, every size",
         "measured": f"worst {worst_empty['empty_speedup']:.2f}x at {size_name(worst_empty['size'])}",
         "met": worst_empty["empty_speedup"] > 1.0},
    ]
    unimem.xpu.empty_cache()
    return report("xpu", targets, device=device.name, backend=str(device.backend), rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
