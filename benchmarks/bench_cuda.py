"""CUDA allocation: unimem against CuPy's pool, PyTorch's allocator, RMM and raw CUDA.

For sizes from 512 B to 1 GiB, in one run: ``cupy.empty`` with CuPy's
default ``MemoryPool``, with ``unimem.cuda.allocator``, and with RMM's pool
allocator when RMM is installed; ``torch.empty(..., device="cuda")`` on
PyTorch's caching allocator when PyTorch has CUDA; and raw ``cudaMalloc`` +
``cudaFree``. CuPy's pool and unimem are measured in interleaved rounds and
judged on the median of the per-round ratios, with their spread.

Two real workloads, each run in interleaved rounds with CuPy's pool and with
unimem's allocator: an MLP trained by hand-written backpropagation (matrix
products, elementwise temporaries) and an FFT + stencil loop.

Targets: unimem no slower than CuPy's own pool (ratio <= 1.0, within the
rounds' spread) and faster than RMM; the workloads no slower than with CuPy's
pool. Without a GPU this benchmark says so and stops.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

from ._common import (command_line, format_time, median_and_range, print_table, report, seconds_per_call,
                      size_name)

SIZES = [512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _torch_cuda() -> Optional[Any]:
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def _rmm_allocator() -> Optional[Callable[[int], Any]]:
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError:
        return None
    rmm.reinitialize(pool_allocator=True)
    return rmm_cupy_allocator


def cuda_targets(rows: List[Dict[str, Any]], workload_rows: List[Dict[str, Any]],
                 with_rmm: bool) -> List[Dict[str, Any]]:
    """The targets, judged as their names say: the allocation target on every
    size's median ratio (its spread shown beside it), the workloads' on each
    one's rounds (no slower: 1.0 within its spread). The figure a verdict
    rests on is printed with three decimals (1.004 is over 1.0)."""
    worst = max(rows, key=lambda r: r["unimem_vs_cupy"])
    low, high = worst["unimem_vs_cupy_spread"]
    targets = [{"target": "unimem / CuPy pool <= 1.0, every size (median of rounds)",
                "measured": f"worst {worst['unimem_vs_cupy']:.3f} ({low:.2f}-{high:.2f}) at {size_name(worst['size'])}",
                "met": all(r["unimem_vs_cupy"] <= 1.0 for r in rows)}]
    if with_rmm:
        slowest = max(rows, key=lambda r: r["unimem_s"] / r["rmm_s"])
        targets.append({"target": "unimem faster than RMM's pool, every size",
                        "measured": f"worst {slowest['unimem_s'] / slowest['rmm_s']:.2f} at "
                                    f"{size_name(slowest['size'])}",
                        "met": all(r["unimem_s"] < r["rmm_s"] for r in rows)})
    slowest_workload = max(workload_rows, key=lambda r: r["unimem_vs_cupy"])
    low, high = slowest_workload["unimem_vs_cupy_spread"]
    targets.append({"target": "workloads no slower than with CuPy's pool (1.0 within each one's rounds)",
                    "measured": f"worst {slowest_workload['unimem_vs_cupy']:.2f} ({low:.3f}-{high:.2f}) "
                                f"({slowest_workload['workload']})",
                    "met": all(r["unimem_vs_cupy_spread"][0] <= 1.0 for r in workload_rows)})
    return targets


# ---------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------
def mlp_training(cupy: Any, steps: int) -> None:
    """A two-layer MLP (4096 x 1024 -> 4096 -> 1024) trained with plain SGD."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((4096, 1024), dtype=cupy.float32)
    w1 = rng.standard_normal((1024, 4096), dtype=cupy.float32) * 0.01
    w2 = rng.standard_normal((4096, 1024), dtype=cupy.float32) * 0.01
    for _ in range(steps):
        h = cupy.maximum(x @ w1, 0)
        y = h @ w2
        grad_y = (y - x) * (2.0 / y.size)
        grad_w2 = h.T @ grad_y
        grad_h = (grad_y @ w2.T) * (h > 0)
        grad_w1 = x.T @ grad_h
        w1 -= 1e-3 * grad_w1
        w2 -= 1e-3 * grad_w2
    cupy.cuda.Device().synchronize()


def fft_stencil(cupy: Any, steps: int) -> None:
    """Spectral damping (rfft2, scale, irfft2) and a 5-point stencil, 2048 x 2048."""
    u = cupy.random.default_rng(1).random((2048, 2048), dtype=cupy.float32)
    decay = cupy.exp(-cupy.arange(2048 // 2 + 1, dtype=cupy.float32) / 512.0)
    for _ in range(steps):
        spectrum = cupy.fft.rfft2(u)
        spectrum *= decay
        u = cupy.fft.irfft2(spectrum, s=u.shape)
        u = 0.25 * (cupy.roll(u, 1, 0) + cupy.roll(u, -1, 0) + cupy.roll(u, 1, 1) + cupy.roll(u, -1, 1))
    cupy.cuda.Device().synchronize()


WORKLOADS = {"MLP training": mlp_training, "FFT + stencil": fft_stencil}


def _interleaved(cupy: Any, allocators: Dict[str, Any], measure: Callable[[], float],
                 rounds: int) -> Dict[str, List[float]]:
    """Per allocator, one time per round; the allocators alternate within a
    round and swap order every round."""
    times: Dict[str, List[float]] = {name: [] for name in allocators}
    names = list(allocators)
    for round_ in range(rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            with cupy.cuda.using_allocator(allocators[name]):
                times[name].append(measure())
    return times


def _against_cupy(times: Dict[str, List[float]]) -> Dict[str, Any]:
    """A row's figures from interleaved times: each allocator's median and
    unimem / CuPy per round (median, lowest and highest, every round)."""
    ratios = [u / c for u, c in zip(times["unimem"], times["cupy"])]
    return {"cupy_pool_s": statistics.median(times["cupy"]), "unimem_s": statistics.median(times["unimem"]),
            "unimem_vs_cupy": statistics.median(ratios), "unimem_vs_cupy_spread": [min(ratios), max(ratios)],
            "unimem_vs_cupy_rounds": ratios}


def run(quick: bool = False) -> Dict[str, Any]:
    if not gpu_available():
        print("CUDA benchmark: no GPU on this machine, nothing measured")
        return {"benchmark": "cuda", "skipped": "no GPU"}
    import cupy

    import unimem.cuda
    runtime = cupy.cuda.runtime
    torch = _torch_cuda()
    rmm_allocator = _rmm_allocator()
    rounds = 3 if quick else 7
    min_time = 0.005 if quick else 0.02

    cupy_pool = cupy.cuda.MemoryPool()
    pools = {"cupy": cupy_pool.malloc, "unimem": unimem.cuda.allocator}
    rows: List[Dict[str, Any]] = []
    for size in SIZES:
        times = _interleaved(cupy, pools, lambda: seconds_per_call(lambda: cupy.empty(size, cupy.uint8),
                                                                  repeats=1, min_time=min_time), rounds)
        row: Dict[str, Any] = dict(_against_cupy(times), size=size)
        if rmm_allocator:
            with cupy.cuda.using_allocator(rmm_allocator):
                row["rmm_s"] = seconds_per_call(lambda: cupy.empty(size, cupy.uint8), repeats=rounds,
                                                min_time=min_time)
        else:
            row["rmm_s"] = None
        row["torch_s"] = (seconds_per_call(lambda: torch.empty(size, dtype=torch.uint8, device="cuda"),
                                           repeats=rounds, min_time=min_time) if torch is not None else None)
        row["raw_s"] = seconds_per_call(lambda: runtime.free(runtime.malloc(size)), repeats=3,
                                        min_time=min_time, max_calls=200)
        rows.append(row)
        print(f"  {size_name(size)}: unimem / CuPy {row['unimem_vs_cupy']:.2f}", flush=True)
    if torch is not None:
        torch.cuda.empty_cache()
    name = runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name

    def cell(value: Optional[float]) -> str:
        return "-" if value is None else format_time(value)

    print_table(f"cupy.empty / torch.empty on {name}; CuPy pool and unimem interleaved, {rounds} rounds",
                ["size", "CuPy pool", "unimem", "unimem / CuPy (spread)", "RMM pool", "torch.empty",
                 "cudaMalloc+Free"],
                [[size_name(r["size"]), cell(r["cupy_pool_s"]), cell(r["unimem_s"]),
                  median_and_range(r["unimem_vs_cupy_rounds"]), cell(r["rmm_s"]),
                  cell(r["torch_s"]), cell(r["raw_s"])] for r in rows])

    workload_rows: List[Dict[str, Any]] = []
    steps = 5 if quick else 20
    for title, workload in WORKLOADS.items():
        def measure(workload: Any = workload) -> float:
            start = time.perf_counter()
            workload(cupy, steps)
            return time.perf_counter() - start
        for allocator in pools.values():                       # warm: kernels compiled, pools filled
            with cupy.cuda.using_allocator(allocator):
                workload(cupy, 2)
        workload_rows.append(dict(_against_cupy(_interleaved(cupy, pools, measure, rounds)),
                                  workload=title, steps=steps))
    print_table(f"workloads on {name}, {rounds} interleaved rounds",
                ["workload", "CuPy pool", "unimem", "unimem / CuPy (spread)"],
                [[r["workload"], format_time(r["cupy_pool_s"]), format_time(r["unimem_s"]),
                  median_and_range(r["unimem_vs_cupy_rounds"])] for r in workload_rows],
                text_columns=1)

    targets = cuda_targets(rows, workload_rows, with_rmm=rmm_allocator is not None)
    return report("cuda", targets, device=name, rounds=rounds, rows=rows, workloads=workload_rows)


if __name__ == "__main__":
    command_line(run, __doc__)
