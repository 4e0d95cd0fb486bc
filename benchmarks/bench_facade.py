"""Facade cost: reading statistics through ``unimem.accelerator`` against the
same calls in PyTorch.

unimem: ``memory_allocated(0)``, ``max_memory_reserved(0)`` and
``memory_stats(0)`` on the default device, with a few blocks live.

PyTorch (when installed): ``torch.cuda.memory_allocated(0)`` builds the
whole statistics dict and picks one key out of it; ``memory_stats(0)``
flattens the nested dict that the C++ allocator returns. Without a GPU the
C++ call (``torch._C._cuda_memoryStats``) is replaced by one that returns a
prebuilt nested dict of the same keys, so the PyTorch figures here are its
Python side only: a lower bound on what PyTorch costs.

Targets: ``memory_allocated(0)`` <= 1 us, ``memory_stats(0)`` <= 30 us.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

from unimem._memory_api import nest_stats

from ._common import command_line, format_time, print_table, report, seconds_per_call


@contextlib.contextmanager
def torch_cuda_stats(stats: Dict[str, Any]) -> Iterator[Optional[Any]]:
    """``torch.cuda.memory`` with its C++ statistics call answering ``stats``
    (when there is no GPU), or None when PyTorch is not installed."""
    try:
        import torch
        import torch.cuda.memory as torch_memory
    except ImportError:
        yield None
        return
    if torch.cuda.is_available():
        yield torch_memory
        return
    saved = torch_memory.is_initialized, torch._C.__dict__.get("_cuda_memoryStats")
    torch_memory.is_initialized = lambda: True
    torch._C._cuda_memoryStats = lambda device: stats
    try:
        yield torch_memory
    finally:
        torch_memory.is_initialized = saved[0]
        if saved[1] is None:
            del torch._C._cuda_memoryStats
        else:
            torch._C._cuda_memoryStats = saved[1]


def run(quick: bool = False) -> Dict[str, Any]:
    import unimem
    from unimem import accelerator
    repeats = 3 if quick else 7
    live = [accelerator.caching_allocator_alloc(n) for n in (512, 100_000, 3 << 20, 30 << 20)]
    try:
        rows: List[Dict[str, Any]] = []
        device = accelerator.current_device_index()
        calls = {"memory_allocated": lambda: accelerator.memory_allocated(device),
                 "max_memory_reserved": lambda: accelerator.max_memory_reserved(device),
                 "memory_stats": lambda: accelerator.memory_stats(device)}
        stats = accelerator.memory_stats(device)
        with torch_cuda_stats(nest_stats(stats)) as torch_memory:
            for name, call in calls.items():
                row: Dict[str, Any] = {"call": f"{name}({device})",
                                       "unimem_s": seconds_per_call(call, repeats=repeats)}
                if torch_memory is not None:
                    torch_call = getattr(torch_memory, name)
                    row["torch_s"] = seconds_per_call(lambda: torch_call(0), repeats=repeats)
                    row["torch_over_unimem"] = row["torch_s"] / row["unimem_s"]
                rows.append(row)
            if torch_memory is not None and torch_memory.memory_stats(0) != stats:
                raise AssertionError("PyTorch's flattening of the same statistics differs from unimem's")
    finally:
        for p in live:
            accelerator.caching_allocator_delete(p)
    device_name = unimem._runtime.devices.current_type().name
    print_table(f"statistics calls (unimem on {device_name}; PyTorch: Python side only without a GPU)",
                ["call", "unimem", "PyTorch", "PyTorch / unimem"],
                [[r["call"], format_time(r["unimem_s"]), format_time(r["torch_s"]) if "torch_s" in r else "-",
                  f"{r['torch_over_unimem']:.1f}x" if "torch_s" in r else "-"] for r in rows])
    by_name = {r["call"].split("(")[0]: r for r in rows}
    targets = [{"target": "memory_allocated(0) <= 1 us",
                "measured": format_time(by_name["memory_allocated"]["unimem_s"]),
                "met": by_name["memory_allocated"]["unimem_s"] <= 1e-6},
               {"target": "memory_stats(0) <= 30 us", "measured": format_time(by_name["memory_stats"]["unimem_s"]),
                "met": by_name["memory_stats"]["unimem_s"] <= 30e-6}]
    return report("facade", targets, device=device_name, stat_keys=len(stats), rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
