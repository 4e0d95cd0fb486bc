"""Expandable segments on a real GPU: unimem beside PyTorch's own.

Every trace of :mod:`benchmarks.traces` (and the recorded PyTorch traces in
``benchmarks/data``, when there are any) is replayed on the GPU through four
allocators, each in its own interpreter (both read their configuration when
CUDA is first used): ``torch.empty`` with PyTorch's default policy and with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, and
``unimem.cuda.caching_allocator_alloc`` with its default policy and with
``UNIMEM_ALLOC_CONF=expandable_segments:True`` (the driver's virtual memory
on both sides). Reported per trace: peak reserved / peak requested, the
device calls (segments, or map and unmap calls with expandable segments) and
the replay's time.

Target: with expandable segments, unimem's peak reserved is no higher than
PyTorch's on every trace. Without a GPU and PyTorch with CUDA this benchmark
says so and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from ._common import print_table, report
from .bench_memory import peak_requested
from .torch_traces import saved_traces
from .traces import TRACES, Event, replay

MiB = 1 << 20
CONFIGURATIONS = [("torch", ""), ("torch", "expandable_segments:True"),
                  ("unimem", ""), ("unimem", "expandable_segments:True")]


def traces() -> Dict[str, List[Event]]:
    named = {name: make() for name, make in TRACES.items()}
    for saved in saved_traces():
        named[f"PyTorch: {saved['name']}"] = saved["events"]
    return named


def _replay_here(allocator: str) -> Dict[str, Dict[str, Any]]:
    """Run in the worker interpreter: every trace through one allocator."""
    results: Dict[str, Dict[str, Any]] = {}
    if allocator == "torch":
        import torch
        tensors: Dict[int, Any] = {}

        def malloc(size: int) -> int:
            tensor = torch.empty(size, dtype=torch.uint8, device="cuda")
            tensors[tensor.data_ptr()] = tensor
            return tensor.data_ptr()

        def free(pointer: int) -> None:
            del tensors[pointer]
        stats, reset, empty, sync = (torch.cuda.memory_stats, torch.cuda.reset_peak_memory_stats,
                                     torch.cuda.empty_cache, torch.cuda.synchronize)
    else:
        import cupy

        import unimem.cuda as ucuda
        malloc, free = ucuda.caching_allocator_alloc, ucuda.caching_allocator_delete
        stats, reset, sync = ucuda.memory_stats, ucuda.reset_peak_memory_stats, cupy.cuda.Device().synchronize

        def empty() -> None:
            ucuda.empty_cache()
            ucuda.empty_virt_addr_cache()
    for name, events in traces().items():
        sync()
        empty()
        reset()
        before = stats()
        start = time.perf_counter()
        for _ in replay(events, malloc, free):
            pass
        sync()
        elapsed = time.perf_counter() - start
        after = stats()
        # Before the first allocation, neither allocator has statistics yet ({}).
        results[name] = {"peak_reserved": after["reserved_bytes.all.peak"], "seconds": elapsed,
                         "device_allocs": after["num_device_alloc"] - before.get("num_device_alloc", 0),
                         "device_frees": after["num_device_free"] - before.get("num_device_free", 0)}
    return results


def _worker(allocator: str, conf: str) -> Dict[str, Dict[str, Any]]:
    variable = "PYTORCH_CUDA_ALLOC_CONF" if allocator == "torch" else "UNIMEM_ALLOC_CONF"
    env = dict(os.environ, **{variable: conf})
    env.pop("PYTORCH_CUDA_ALLOC_CONF" if allocator != "torch" else "UNIMEM_ALLOC_CONF", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_cuda_expandable", "--worker", allocator],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{allocator} with {conf or 'defaults'} failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run(quick: bool = False) -> Dict[str, Any]:
    if not available():
        print("CUDA expandable segments: no GPU (or no PyTorch with CUDA) here, nothing measured")
        return {"benchmark": "cuda_expandable", "skipped": "no GPU"}
    measured = {(allocator, conf): _worker(allocator, conf) for allocator, conf in CONFIGURATIONS}
    rows = []
    for name, events in traces().items():
        requested = peak_requested(events)
        row: Dict[str, Any] = {"trace": name, "peak_requested": requested}
        for (allocator, conf), results in measured.items():
            key = f"{allocator}{'_expandable' if conf else ''}"
            row[key] = dict(results[name], ratio=results[name]["peak_reserved"] / requested)
        row["torch_peak_reserved"] = row["torch_expandable"]["peak_reserved"]
        row["unimem_peak_reserved"] = row["unimem_expandable"]["peak_reserved"]
        rows.append(row)

    def cell(result: Dict[str, Any]) -> str:
        return f"{result['ratio']:.3f} ({result['device_allocs']}/{result['device_frees']}, {result['seconds'] * 1e3:.0f} ms)"
    print_table("peak reserved / peak requested on the GPU (device allocs/frees or maps/unmaps, replay time)",
                ["trace", "PyTorch", "PyTorch expandable", "unimem", "unimem expandable"],
                [[r["trace"], cell(r["torch"]), cell(r["torch_expandable"]), cell(r["unimem"]),
                  cell(r["unimem_expandable"])] for r in rows], text_columns=5)
    worst = max(rows, key=lambda r: r["unimem_peak_reserved"] / r["torch_peak_reserved"])
    targets = [{"target": "expandable segments: unimem's peak reserved <= PyTorch's, every trace",
                "measured": f"worst {worst['unimem_peak_reserved'] / worst['torch_peak_reserved']:.3f} "
                            f"({worst['trace']})",
                "met": all(r["unimem_peak_reserved"] <= r["torch_peak_reserved"] for r in rows)}]
    return report("cuda_expandable", targets, rows=rows)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry: one replay per trace")
    parser.add_argument("--worker", choices=["torch", "unimem"], help=argparse.SUPPRESS)
    parser.add_argument("--json-only", action="store_true", help="print the rows as one JSON line at the end")
    arguments = parser.parse_args(argv)
    if arguments.worker:
        print(json.dumps(_replay_here(arguments.worker)))
        return
    result = run(arguments.quick)
    if arguments.json_only:
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
