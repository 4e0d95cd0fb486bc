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


#: PyTorch's metric column: a label of up to 21 characters between two spaces.
LABEL_WIDTH = 21


def has_held_memory(stats: Mapping[str, int]) -> bool:
    """Whether the pool of ``stats`` has ever held memory (reserved bytes
    allocated since the accumulated statistics were last reset, or held now):
    the pools beside a device's are summarized only then."""
    return stats.get("reserved_bytes.all.allocated", 0) > 0 or stats.get("reserved_bytes.all.current", 0) > 0


def _fits_the_label_column(device_name: str) -> bool:
    """Whether PyTorch's labels that name the memory ("GPU reserved segments",
    "Oversize GPU segments") fit its label column with ``device_name`` in
    them: "GPU", "XPU", "CPU" do; "host", "XPU shared USM" do not."""
    return len(f"Oversize {device_name} segments") <= LABEL_WIDTH


def memory_summary_table(stats: Mapping[str, int], device_name: str, device_index: int,
                         abbreviated: bool = False) -> str:
    """The summary table of ``stats`` (a ``memory_stats`` dict), laid out as
    PyTorch's ``torch.cuda.memory_summary`` lays out its own.

    ``device_name`` names the memory ("GPU", "XPU", "CPU", "host", "XPU shared
    USM") where PyTorch's table says "GPU" / "CUDA": in the title line always,
    in the OOMs line and the row labels only where it fits PyTorch's columns
    (else those read "OOMs", "Reserved memory", "Reserved segments",
    "Oversize segments").
    """
    named = _fits_the_label_column(device_name)
    memory = f"{device_name} " if named else ""
    rows: Tuple[Tuple[str, str, Callable[[int, float], str]], ...] = (
        ("allocated_bytes", "Allocated memory", format_size),
        ("active_bytes", "Active memory", format_size),
        ("requested_bytes", "Requested memory", format_size),
        ("reserved_bytes", f"{device_name} reserved memory" if named else "Reserved memory", format_size),
        ("inactive_split_bytes", "Non-releasable memory", format_size),
        ("allocation", "Allocations", format_count),
        ("active", "Active allocs", format_count),
        ("segment", f"{device_name} reserved segments" if named else "Reserved segments", format_count),
        ("inactive_split", "Non-releasable allocs", format_count),
    )
    get = lambda key: int(stats.get(key, 0))  # noqa: E731 - empty stats print as zeros
    # The OOMs line's "|" where PyTorch's is: two halves of 35 characters.
    ooms = f"{memory}OOMs: {get('num_ooms'):<12d}".rjust(35)
    retries = f"{memory}malloc retries: {get('num_alloc_retries'):<8d}".rjust(35)
    lines = ["=" * WIDTH,
             f"unimem {device_name} memory summary, device ID {device_index}".center(WIDTH),
             "-" * WIDTH,
             f"{ooms} | {retries}  ",
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
            lines.append(f" {name:<{LABEL_WIDTH}} | {cells} ")
    for key, title in (("oversize_allocations", "Oversize allocations"),
                       ("oversize_segments", f"Oversize {device_name} segments" if named else "Oversize segments")):
        lines.append("-" * WIDTH)
        values = [get(f"{key}.{m}") for m in ("current", "peak", "allocated", "freed")]
        cells = " | ".join(format_count(v, v) for v in values)
        lines.append(f" {title:<{LABEL_WIDTH}} | {cells} ")
    lines.append("=" * WIDTH)
    # Padded, never cut: a line too long for the table shows, it does not lose its last column.
    return "|" + "|\n|".join(line.ljust(WIDTH) for line in lines) + "|\n"
