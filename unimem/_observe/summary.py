"""``memory_summary``: PyTorch's 75-column statistics table, for any device."""
from __future__ import annotations

from typing import Callable, Mapping, Tuple

WIDTH = 75


def format_size(size: int, reference: float) -> str:
    """A size in the unit ``reference`` calls for (a unit up at 768 of the lower)."""
    prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if reference < 768 * 1024:
            break
        prefix = new_prefix
        size //= 1024
        reference /= 1024
    return f"{size:6d} {prefix}"


def format_count(count: int, reference: float) -> str:
    """A count, switching to K and M at 750,000 of the lower unit."""
    prefixes = [" ", "K", "M"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if reference < 750 * 1000:
            break
        prefix = new_prefix
        count //= 1000
        reference /= 1000
    return f"{count:7d} {prefix} "


def _centered(text: str) -> str:
    return text.center(WIDTH)


def memory_summary_table(stats: Mapping[str, int], device_name: str, device_index: int,
                         abbreviated: bool = False) -> str:
    """The summary table of ``stats`` (a ``memory_stats`` dict).

    ``device_name`` names the memory ("GPU", "XPU", "CPU", "host") where
    PyTorch's table says "GPU" / "CUDA".
    """
    rows: Tuple[Tuple[str, str, Callable[[int, float], str]], ...] = (
        ("allocated_bytes", "Allocated memory", format_size),
        ("active_bytes", "Active memory", format_size),
        ("requested_bytes", "Requested memory", format_size),
        ("reserved_bytes", f"{device_name} reserved memory", format_size),
        ("inactive_split_bytes", "Non-releasable memory", format_size),
        ("allocation", "Allocations", format_count),
        ("active", "Active allocs", format_count),
        ("segment", f"{device_name} reserved segments", format_count),
        ("inactive_split", "Non-releasable allocs", format_count),
    )
    get = lambda key: int(stats.get(key, 0))  # noqa: E731 - empty stats print as zeros
    lines = ["=" * WIDTH,
             _centered(f"unimem {device_name} memory summary, device ID {device_index}"),
             "-" * WIDTH,
             _centered(f"{device_name} OOMs: {get('num_ooms'):<12d} | "
                       f"{device_name} malloc retries: {get('num_alloc_retries'):<8d}"),
             "=" * WIDTH,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, title, formatter in rows:
        lines.append("-" * WIDTH)
        pools = [("all", title)]
        if not abbreviated:
            pools += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        reference = None
        for pool, name in pools:
            values = [get(f"{key}.{pool}.{m}") for m in ("current", "peak", "allocated", "freed")]
            if reference is None:
                reference = values
            cells = " | ".join(formatter(v, r) for v, r in zip(values, reference))
            lines.append(f" {name:<21} | {cells} ")
    for key, title in (("oversize_allocations", "Oversize allocations"),
                       ("oversize_segments", f"Oversize {device_name} segments")):
        lines.append("-" * WIDTH)
        values = [get(f"{key}.{m}") for m in ("current", "peak", "allocated", "freed")]
        cells = " | ".join(format_count(v, v) for v in values)
        lines.append(f" {title:<21} | {cells} ")
    lines.append("=" * WIDTH)
    return "|" + "|\n|".join(line[:WIDTH].ljust(WIDTH) for line in lines) + "|\n"
