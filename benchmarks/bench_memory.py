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
  in use.

Targets: on every trace, peak reserved <= 1.15 x peak requested,
and never above PyTorch's reserved peak for the same trace.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ._common import command_line, print_table, report
from .torch_traces import saved_traces
from .traces import TRACES, Event, replay

GiB = 1 << 30
MiB = 1 << 20
RATIO = 1.1
TARGET = 1.15


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
    return {"reserved_peak": stats["reserved_bytes.all.peak"], "segments": stats["segment.all.allocated"],
            "replay_s": elapsed, "events_per_s": len(events) / elapsed}


def measure(name: str, events: List[Event], torch_reserved_peak: Optional[int] = None) -> Dict[str, Any]:
    requested = peak_requested(events)
    default = replay_peak(events)
    bounded = replay_peak(events, max_reserved_ratio=RATIO)
    reference = torch_reserved_peak if torch_reserved_peak is not None else default["reserved_peak"]
    return {"trace": name, "events": len(events), "requested_peak": requested,
            "torch_reserved_peak": reference, "torch_recorded": torch_reserved_peak is not None,
            "default": dict(default, ratio=default["reserved_peak"] / requested),
            "bounded": dict(bounded, ratio=bounded["reserved_peak"] / requested)}


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
                 f"unimem ratio {RATIO}", "ratio", "segments (default / bounded)"],
                [[r["trace"], f"{r['events']:,}", mib(r["requested_peak"]),
                  mib(r["torch_reserved_peak"]) + ("" if r["torch_recorded"] else " (policy)"),
                  mib(r["default"]["reserved_peak"]), f"{r['default']['ratio']:.3f}",
                  mib(r["bounded"]["reserved_peak"]), f"{r['bounded']['ratio']:.3f}",
                  f"{r['default']['segments']:,} / {r['bounded']['segments']:,}"] for r in rows])
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
    ]
    if not recorded:
        print("no recorded PyTorch traces in benchmarks/data (recording needs a GPU: "
              "python -m benchmarks.torch_traces record); PyTorch's figure is its policy replayed")
    return report("memory", targets, ratio_option=RATIO, rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
