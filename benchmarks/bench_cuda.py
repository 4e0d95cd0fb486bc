"""CUDA allocation: unimem against CuPy's pool, PyTorch's allocator, RMM and raw CUDA.

For sizes from 512 B to 256 MiB, in one run: ``cupy.empty`` with CuPy's
default ``MemoryPool``, with ``unimem.cuda.allocator``, and with RMM's pool
allocator when RMM is installed; ``torch.empty(..., device="cuda")`` on
PyTorch's caching allocator when PyTorch has CUDA; and raw ``cudaMalloc`` +
``cudaFree``.

Targets: unimem no slower than CuPy's own pool (ratio <= 1.0)
and faster than RMM. Without a GPU this benchmark says so and stops.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ._common import command_line, format_time, print_table, report, seconds_per_call, size_name

SIZES = [512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


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


def run(quick: bool = False) -> Dict[str, Any]:
    if not gpu_available():
        print("CUDA benchmark: no GPU on this machine, nothing measured")
        return {"benchmark": "cuda", "skipped": "no GPU"}
    import cupy

    import unimem.cuda
    runtime = cupy.cuda.runtime
    torch = _torch_cuda()
    rmm_allocator = _rmm_allocator()
    repeats = 3 if quick else 7
    min_time = 0.01 if quick else 0.05

    def with_allocator(allocator: Any, size: int) -> float:
        with cupy.cuda.using_allocator(allocator):
            return seconds_per_call(lambda: cupy.empty(size, cupy.uint8), repeats=repeats, min_time=min_time)

    rows: List[Dict[str, Any]] = []
    cupy_pool = cupy.cuda.MemoryPool()
    for size in SIZES:
        row: Dict[str, Any] = {"size": size}
        row["cupy_pool_s"] = with_allocator(cupy_pool.malloc, size)
        row["unimem_s"] = with_allocator(unimem.cuda.allocator, size)
        row["rmm_s"] = with_allocator(rmm_allocator, size) if rmm_allocator else None
        if torch is not None:
            row["torch_s"] = seconds_per_call(lambda: torch.empty(size, dtype=torch.uint8, device="cuda"),
                                              repeats=repeats, min_time=min_time)
        else:
            row["torch_s"] = None
        row["raw_s"] = seconds_per_call(lambda: runtime.free(runtime.malloc(size)), repeats=repeats,
                                        min_time=min_time, max_calls=2000)
        row["unimem_vs_cupy"] = row["unimem_s"] / row["cupy_pool_s"]
        rows.append(row)
    name = runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name

    def cell(value: Optional[float]) -> str:
        return "-" if value is None else format_time(value)

    print_table(f"cupy.empty / torch.empty on {name}, one run",
                ["size", "CuPy pool", "unimem", "unimem / CuPy", "RMM pool", "torch.empty", "cudaMalloc+Free"],
                [[size_name(r["size"]), cell(r["cupy_pool_s"]), cell(r["unimem_s"]),
                  f"{r['unimem_vs_cupy']:.2f}", cell(r["rmm_s"]), cell(r["torch_s"]), cell(r["raw_s"])]
                 for r in rows])
    worst = max(rows, key=lambda r: r["unimem_vs_cupy"])
    targets = [{"target": "unimem / CuPy pool <= 1.0, every size",
                "measured": f"worst {worst['unimem_vs_cupy']:.2f} at {size_name(worst['size'])}",
                "met": worst["unimem_vs_cupy"] <= 1.0}]
    if rmm_allocator:
        slowest = max(rows, key=lambda r: r["unimem_s"] / r["rmm_s"])
        targets.append({"target": "unimem faster than RMM's pool, every size",
                        "measured": f"worst {slowest['unimem_s'] / slowest['rmm_s']:.2f} at "
                                    f"{size_name(slowest['size'])}",
                        "met": slowest["unimem_s"] < slowest["rmm_s"]})
    return report("cuda", targets, device=name, rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
