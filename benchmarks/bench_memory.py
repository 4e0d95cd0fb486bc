"""Memory efficiency: replay allocation traces and compare peak reserved
memory with peak requested memory (the live bytes asked for).

Traces: the generated workloads of :mod:`benchmarks.traces` (a transformer
training step, KV-cache inference, a random mix) and every trace recorded
from a real PyTorch run in ``benchmarks/data`` (see
:mod:`benchmarks.torch_traces`; recording needs a GPU).

Each trace is replayed on a simulated 80 GiB device through:

* unimem with its default policy, which is PyTorch's (the model-based tests
  check the two against each other event by event): for a generated trace,
  this row *is* PyTorch's reserved peak; for a recorded trace, PyTorch's own
  ``max_memory_reserved()`` from the run stands beside it;
* unimem with ``max_reserved_ratio:1.1``: before growing, wholly free
  segments are released while reserved memory would exceed 1.1 x the memory
  in use;
* unimem with ``expandable_segments:True`` and no other option (PyTorch's
  expandable segments: one address range per stream and pool, grown by
  mapping 2 MiB pages; the simulated device maps as CUDA's driver does).
  Its device calls are the map calls (``num_device_alloc``), reported beside
  the segments the other policies allocate.

Targets: on every trace, peak reserved <= 1.15 x peak requested with
max_reserved_ratio:1.1, <= 1.10 x with expandable segments, and never above
PyTorch's reserved peak for the same trace.

Then real memory: the ``cpu`` pool's host backend with expandable segments
(mmap'ed ranges, pages mapped and unmapped): the process's resident set
(RSS) is measured before a workload, at its peak and after ``empty_cache``,
which must bring it back within 5% of the baseline.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from ._common import command_line, print_table, report
from .torch_traces import saved_traces
from .traces import TRACES, Event, replay

GiB = 1 << 30
MiB = 1 << 20
RATIO = 1.1
TARGET = 1.15
EXPANDABLE_TARGET = 1.10
RSS_TOLERANCE = 0.05


def peak_requested(events: List[Event]) -> int:
    live: Dict[int, int] = {}
    current = peak = 0
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = event[2]                            # type: ignore[misc]
            current += event[2]                                  # type: ignore[operator]
            peak = max(peak, current)
        else:
            current -= live.pop(event[1])
    return peak


def replay_peak(events: List[Event], **options: Any) -> Dict[str, Any]:
    """Peak reserved bytes, segments allocated and replay time for one policy."""
    from unimem._core import CachingAllocator
    from unimem.backends.simulated import SimulatedBackend
    backend = SimulatedBackend(capacity=80 * GiB)
    allocator = CachingAllocator(backend, 0, **options)
    start = time.perf_counter()
    for _ in replay(events, allocator.malloc, allocator.free):
        pass
    elapsed = time.perf_counter() - start
    stats = allocator.memory_stats()
    if stats["allocated_bytes.all.current"] != 0:
        raise AssertionError("the trace left memory allocated")
    # Device calls: segments allocated, or with expandable segments (which
    # count none, as PyTorch) the map calls.
    return {"reserved_peak": stats["reserved_bytes.all.peak"], "segments": stats["segment.all.allocated"],
            "device_allocs": stats["num_device_alloc"],
            "replay_s": elapsed, "events_per_s": len(events) / elapsed}


def measure(name: str, events: List[Event], torch_reserved_peak: Optional[int] = None) -> Dict[str, Any]:
    requested = peak_requested(events)
    default = replay_peak(events)
    bounded = replay_peak(events, max_reserved_ratio=RATIO)
    expandable = replay_peak(events, expandable_segments=True)
    reference = torch_reserved_peak if torch_reserved_peak is not None else default["reserved_peak"]
    return {"trace": name, "events": len(events), "requested_peak": requested,
            "torch_reserved_peak": reference, "torch_recorded": torch_reserved_peak is not None,
            "default": dict(default, ratio=default["reserved_peak"] / requested),
            "bounded": dict(bounded, ratio=bounded["reserved_peak"] / requested),
            "expandable": dict(expandable, ratio=expandable["reserved_peak"] / requested)}


def resident_bytes() -> int:
    """The process's resident set size now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_host_rss(quick: bool = False) -> Dict[str, Any]:
    """RSS before, at the peak of, and after ``empty_cache`` of a workload
    on the ``cpu`` pool's host backend with expandable segments: sizes from
    4 KiB to 8 MiB, every byte written (so that it is resident), freed in
    an order that leaves holes, then everything freed."""
    import ctypes
    import random
    from unimem._core import CachingAllocator
    from unimem.backends._host import PageAlignedBackend
    backend = PageAlignedBackend("CPU")
    total = 64 * MiB if quick else 512 * MiB
    rng = random.Random(7)
    sizes: List[int] = []
    while sum(sizes) < total:
        sizes.append(rng.choice([4096, 64 << 10, 300 << 10, 1 * MiB, 3 * MiB, 8 * MiB]))
    allocator = CachingAllocator(backend, 0, expandable_segments=True)
    allocator.set_capacity(backend.memory_info(0)[1])
    baseline = resident_bytes()
    pointers = []
    for size in sizes:
        ptr = allocator.malloc(size)
        ctypes.memset(ptr, 1, size)
        pointers.append(ptr)
    peak = resident_bytes()
    for ptr in pointers[::2]:                  # holes first: free pages in the middle
        allocator.free(ptr)
    allocator.empty_cache()
    after_holes = resident_bytes()
    for ptr in pointers[1::2]:
        allocator.free(ptr)
    allocator.empty_cache()
    after = resident_bytes()
    stats = allocator.memory_stats()
    ranges = allocator.reserved_address_space()["ranges"]
    allocator.empty_virt_addr_cache()
    return {"workload_bytes": sum(sizes), "allocations": len(sizes), "baseline_rss": baseline,
            "peak_rss": peak, "rss_after_holes_emptied": after_holes, "rss_after_empty_cache": after,
            "map_calls": stats["num_device_alloc"], "unmap_calls": stats["num_device_free"],
            "reserved_after": stats["reserved_bytes.all.current"], "ranges_before_release": ranges,
            "ranges_after_release": allocator.reserved_address_space()["ranges"],
            "granularity": backend.virtual_memory_granularity(0),
            "change_vs_baseline": (after - baseline) / baseline}


def run(quick: bool = False) -> Dict[str, Any]:
    rows = []
    for name, generate in TRACES.items():
        rows.append(measure(name, generate()))
    for saved in saved_traces():
        rows.append(measure(f"PyTorch run: {saved['name']}", saved["events"], saved["reserved_peak"]))

    def mib(n: int) -> str:
        return f"{n / MiB:,.0f} MiB"

    print_table("peak reserved / peak requested (simulated 80 GiB device)",
                ["trace", "events", "requested peak", "PyTorch reserved", "unimem default", "ratio",
                 f"unimem ratio {RATIO}", "ratio", "expandable", "ratio",
                 "segments (default / bounded)", "map calls (expandable)"],
                [[r["trace"], f"{r['events']:,}", mib(r["requested_peak"]),
                  mib(r["torch_reserved_peak"]) + ("" if r["torch_recorded"] else " (policy)"),
                  mib(r["default"]["reserved_peak"]), f"{r['default']['ratio']:.3f}",
                  mib(r["bounded"]["reserved_peak"]), f"{r['bounded']['ratio']:.3f}",
                  mib(r["expandable"]["reserved_peak"]), f"{r['expandable']['ratio']:.3f}",
                  f"{r['default']['segments']:,} / {r['bounded']['segments']:,}",
                  f"{r['expandable']['device_allocs']:,}"] for r in rows])
    host = measure_host_rss(quick)
    print_table(f"cpu pool, expandable segments: resident memory (host pages of "
                f"{host['granularity']} bytes, {host['allocations']} allocations)",
                ["workload", "baseline RSS", "peak RSS", "after freeing half, empty_cache",
                 "after empty_cache", "change", "map / unmap calls"],
                [[mib(host["workload_bytes"]), mib(host["baseline_rss"]), mib(host["peak_rss"]),
                  mib(host["rss_after_holes_emptied"]), mib(host["rss_after_empty_cache"]),
                  f"{host['change_vs_baseline']:+.1%}", f"{host['map_calls']} / {host['unmap_calls']}"]])
    worst_expandable = max(rows, key=lambda r: r["expandable"]["ratio"])
    expandable_above = [r["trace"] for r in rows if r["expandable"]["reserved_peak"] > r["torch_reserved_peak"]]
    worst = max(rows, key=lambda r: r["bounded"]["ratio"])
    worst_default = max(rows, key=lambda r: r["default"]["ratio"])
    above = [r["trace"] for r in rows if r["bounded"]["reserved_peak"] > r["torch_reserved_peak"]]
    recorded = sum(r["torch_recorded"] for r in rows)
    targets = [
        {"target": f"peak reserved <= {TARGET} x peak requested, every trace (max_reserved_ratio:{RATIO})",
         "measured": f"worst {worst['bounded']['ratio']:.3f} ({worst['trace']})",
         "met": worst["bounded"]["ratio"] <= TARGET},
        {"target": f"peak reserved <= PyTorch's, every trace (max_reserved_ratio:{RATIO}; "
                   f"{recorded} recorded PyTorch runs)",
         "measured": "above on " + ", ".join(above) if above else "never above",
         "met": not above},
        {"target": f"the same with the default policy (PyTorch's own): <= {TARGET} x requested",
         "measured": f"worst {worst_default['default']['ratio']:.3f} ({worst_default['trace']})",
         "met": worst_default["default"]["ratio"] <= TARGET},
        {"target": f"peak reserved <= {EXPANDABLE_TARGET} x peak requested, every trace "
                   f"(expandable_segments:True, no other option)",
         "measured": f"worst {worst_expandable['expandable']['ratio']:.3f} ({worst_expandable['trace']})",
         "met": worst_expandable["expandable"]["ratio"] <= EXPANDABLE_TARGET},
        {"target": "peak reserved <= PyTorch's default policy, every trace (expandable_segments:True)",
         "measured": "above on " + ", ".join(expandable_above) if expandable_above else "never above",
         "met": not expandable_above},
        {"target": f"cpu pool RSS after empty_cache within {RSS_TOLERANCE:.0%} of the baseline "
                   f"(expandable_segments:True, {mib(host['workload_bytes'])} written)",
         "measured": f"{mib(host['baseline_rss'])} -> {mib(host['peak_rss'])} -> "
                     f"{mib(host['rss_after_empty_cache'])} ({host['change_vs_baseline']:+.1%})",
         "met": abs(host["change_vs_baseline"]) <= RSS_TOLERANCE},
    ]
    if not recorded:
        print("no recorded PyTorch traces in benchmarks/data (recording needs a GPU: "
              "python -m benchmarks.torch_traces record); PyTorch's figure is its policy replayed")
    return report("memory", targets, ratio_option=RATIO, rows=rows, host_rss=host)


if __name__ == "__main__":
    command_line(run, __doc__)
