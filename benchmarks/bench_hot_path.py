"""The hot path: alloc+free pairs of sizes already cached (512 B, 64 KiB,
4 MiB, and a mix), through each way in, with the peers beside them.

* the typed core, no Python in between (the default device's allocator and
  the host pool);
* the Python API: ``unimem.accelerator.caching_allocator_alloc/delete`` and
  the same functions of the device's namespace (``unimem.xpu``, ...);
* the dpnp array path: ``unimem.xpu.empty`` against ``dpnp.empty``;
* the CuPy allocator path: ``unimem.cuda.allocator`` (on a GPU, with
  ``cupy.empty`` against CuPy's pool; without one, the glue alone over a
  simulated device);
* peers: the raw backends' malloc+free (SYCL USM, host ``mmap``) and glibc's
  ``malloc``+``free`` (a general-purpose allocator that caches itself).

The pool's own pairs are the fastest of several runs (noise only adds time
at this scale); the raw backends' pairs are medians.

Targets: Python API pair <= 250 ns, typed core pair <= 60 ns, and
the pool at least 10x faster than its raw backend at every size.
"""
from __future__ import annotations

import gc
import importlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ._common import best_of, command_line, format_time, median_of, print_table, report, seconds_per_call
from ._timing import time_hot_path, time_libc_pairs, time_raw_pairs

MiB = 1 << 20
MIXED = [512, 65536, 4 * MiB, 1000, 3 * MiB]
CASES: List[Any] = [("512 B", 512), ("64 KiB", 65536), ("4 MiB", 4 * MiB), ("mixed", MIXED)]


def _cycle(sizes: Union[int, Sequence[int]]) -> List[int]:
    return [sizes] if isinstance(sizes, int) else list(sizes)


def python_pairs(alloc: Callable[[int], int], free: Callable[[int], None], sizes: List[int],
                 pairs: int, repeats: int) -> float:
    def measure() -> float:
        n = len(sizes)
        start = time.perf_counter()
        for i in range(pairs):
            free(alloc(sizes[i % n]))
        return (time.perf_counter() - start) / pairs
    for size in sizes:
        free(alloc(size))
    return best_of(measure, repeats)


def simulated_cuda_allocator_pair(sizes: List[int], repeats: int) -> Optional[float]:
    """unimem.cuda.allocator's glue (MemoryPointer and all) over a simulated device."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return None
    from unimem._runtime import devices as _devices
    from unimem.backends.cuda import stream_pointer
    from unimem.backends.simulated import SimulatedBackend
    import unimem.cuda
    saved = _devices._types.get("cuda")
    _devices._types["cuda"] = _devices.DeviceType(
        "cuda", SimulatedBackend(name="GPU"), current_device_fn=lambda: 0,
        current_stream_fn=lambda device: 0, stream_handle_fn=stream_pointer)
    try:
        allocator = unimem.cuda.allocator
        n = len(sizes)
        return seconds_per_call(lambda: allocator(sizes[time.perf_counter_ns() % n]), repeats=repeats,
                                min_time=0.02)
    finally:
        gc.collect()
        if saved is None:
            _devices._types.pop("cuda", None)
        else:
            _devices._types["cuda"] = saved


def run(quick: bool = False) -> Dict[str, Any]:
    import unimem
    from unimem import accelerator
    from unimem._runtime import devices as _devices
    from unimem.backends._host import PageAlignedBackend

    repeats = 3 if quick else 7
    pairs = 30_000 if quick else 200_000
    dtype = _devices.current_type()
    device = dtype.allocator(dtype.current_index())
    host = unimem.cpu.caching_allocator(0)
    host_raw = PageAlignedBackend()
    device_raw = getattr(dtype.backend, "raw", None)
    has_xpu = dtype.name == "xpu"
    namespace = importlib.import_module(f"unimem.{dtype.name}")
    if has_xpu:
        import dpnp

        import unimem.xpu as uxpu
    # Warm up first (caches, the CPU's clock, first-touch page faults):
    # the first case measured would otherwise pay for it.
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:
        time_hot_path(device, MIXED, 10_000)
        python_pairs(accelerator.caching_allocator_alloc, accelerator.caching_allocator_delete, MIXED, 10_000, 1)
    rows: List[Dict[str, Any]] = []
    for name, spec in CASES:
        sizes = _cycle(spec)
        row: Dict[str, Any] = {"case": name}
        row["core_device_s"] = best_of(lambda: time_hot_path(device, sizes, pairs), 3 * repeats) * 1e-9
        row["core_host_s"] = best_of(lambda: time_hot_path(host, sizes, pairs), 3 * repeats) * 1e-9
        row["python_api_s"] = python_pairs(accelerator.caching_allocator_alloc,
                                           accelerator.caching_allocator_delete, sizes, pairs // 2, repeats)
        row["namespace_api_s"] = python_pairs(namespace.caching_allocator_alloc,
                                              namespace.caching_allocator_delete, sizes, pairs // 2, repeats)
        row["raw_host_s"] = sum(median_of(lambda: time_raw_pairs(host_raw, n, 500), repeats)
                                for n in sizes) / len(sizes) * 1e-9
        row["glibc_s"] = sum(median_of(lambda: time_libc_pairs(n, 20_000), repeats)
                             for n in sizes) / len(sizes) * 1e-9
        if device_raw is not None:
            row["raw_device_s"] = sum(median_of(lambda: time_raw_pairs(device_raw, n, 500), repeats)
                                      for n in sizes) / len(sizes) * 1e-9
        if has_xpu:
            counts = [max(n // 4, 1) for n in sizes]
            k = iter(range(1 << 62))
            row["unimem_xpu_empty_s"] = seconds_per_call(
                lambda: uxpu.empty(counts[next(k) % len(counts)], dtype="f4"), repeats=repeats, min_time=0.02)
            row["dpnp_empty_s"] = seconds_per_call(
                lambda: dpnp.empty(counts[next(k) % len(counts)], dtype="f4"), repeats=repeats, min_time=0.02)
        row["cupy_glue_s"] = simulated_cuda_allocator_pair(sizes, repeats)
        rows.append(row)

    def cell(row: Dict[str, Any], key: str) -> str:
        value = row.get(key)
        return "-" if value is None else format_time(value)

    print_table(f"alloc+free of a cached size, one run (default device: {dtype.name}; no GPU: CuPy glue "
                f"over a simulated device)",
                ["size", "core (device)", "core (host)", "Python API", f"unimem.{dtype.name} API", "CuPy allocator", "unimem.xpu.empty",
                 "dpnp.empty", "raw device", "raw host (mmap)", "glibc malloc"],
                [[r["case"], cell(r, "core_device_s"), cell(r, "core_host_s"), cell(r, "python_api_s"),
                  cell(r, "namespace_api_s"),
                  cell(r, "cupy_glue_s"), cell(r, "unimem_xpu_empty_s"), cell(r, "dpnp_empty_s"),
                  cell(r, "raw_device_s"), cell(r, "raw_host_s"), cell(r, "glibc_s")] for r in rows])
    api_pairs = [(r[key], r["case"], way) for r in rows
                 for key, way in (("python_api_s", "accelerator"), ("namespace_api_s", dtype.name))]
    worst_api = max(api_pairs)
    worst_core = max(rows, key=lambda r: max(r["core_device_s"], r["core_host_s"]))
    speedups = [(r["raw_host_s"] / r["core_host_s"], r["case"], "host") for r in rows]
    if device_raw is not None:
        speedups += [(r["raw_device_s"] / r["core_device_s"], r["case"], dtype.name) for r in rows]
    least = min(speedups)
    targets = [
        {"target": "Python API alloc+free <= 250 ns, every size (unimem.accelerator and the device's namespace)",
         "measured": f"worst {format_time(worst_api[0])} (unimem.{worst_api[2]}, {worst_api[1]})",
         "met": worst_api[0] <= 250e-9},
        {"target": "typed core alloc+free <= 60 ns, every size",
         "measured": f"worst {format_time(max(worst_core['core_device_s'], worst_core['core_host_s']))} "
                     f"({worst_core['case']})",
         "met": max(worst_core["core_device_s"], worst_core["core_host_s"]) <= 60e-9},
        {"target": "pool >= 10x faster than raw malloc+free, every size and backend",
         "measured": f"least {least[0]:.0f}x ({least[2]}, {least[1]})", "met": least[0] >= 10},
    ]
    if has_xpu:
        slowest = min(rows, key=lambda r: r["dpnp_empty_s"] / r["unimem_xpu_empty_s"])
        targets.append({"target": "unimem.xpu.empty faster than dpnp.empty, every size",
                        "measured": f"least {slowest['dpnp_empty_s'] / slowest['unimem_xpu_empty_s']:.2f}x "
                                    f"({slowest['case']})",
                        "met": all(r["unimem_xpu_empty_s"] < r["dpnp_empty_s"] for r in rows)})
    return report("hot_path", targets, device=dtype.name, rows=rows)


if __name__ == "__main__":
    command_line(run, __doc__)
