"""``memory_summary``: PyTorch's 75-column statistics table, for any device,
and unimem's section on who holds the memory after it."""
from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Tuple

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


def _unknown_cell(formatter: Callable[[int, float], str], mark: str) -> str:
    """A cell that shows ``mark`` where ``formatter`` would put the number's last digit."""
    sample = formatter(0, 0)
    end = sample.index("0") + 1
    return mark.rjust(end) + " " * (len(sample) - end)


def memory_summary_table(stats: Mapping[str, int], device_name: str, device_index: int,
                         abbreviated: bool = False, unknown: Optional[str] = None) -> str:
    """The summary table of ``stats`` (a ``memory_stats`` dict), laid out as
    PyTorch's ``torch.cuda.memory_summary`` lays out its own.

    ``device_name`` names the memory ("GPU", "XPU", "CPU", "host", "XPU shared
    USM") where PyTorch's table says "GPU" / "CUDA": in the title line always,
    in the OOMs line and the row labels only where it fits PyTorch's columns
    (else those read "OOMs", "Reserved memory", "Reserved segments",
    "Oversize segments").

    A figure missing from ``stats`` prints as 0; with ``unknown`` (the table
    of a snapshot, which tells only some figures) it prints as that mark,
    and a row with none of its figures is left out.
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

    def get(key: str) -> Optional[int]:
        if key in stats:
            return int(stats[key])
        return None if unknown is not None else 0     # empty stats print as zeros

    def counter(key: str, width: int) -> str:
        value = get(key)
        return f"{value:<{width}d}" if value is not None else f"{unknown:<{width}}"

    # The OOMs line's "|" where PyTorch's is: two halves of 35 characters.
    ooms = f"{memory}OOMs: {counter('num_ooms', 12)}".rjust(35)
    retries = f"{memory}malloc retries: {counter('num_alloc_retries', 8)}".rjust(35)
    lines = ["=" * WIDTH,
             f"unimem {device_name} memory summary, device ID {device_index}".center(WIDTH),
             "-" * WIDTH,
             f"{ooms} | {retries}  ",
             "=" * WIDTH,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]

    def cells(values: List[Optional[int]], reference: List[Optional[int]],
              formatter: Callable[[int, float], str]) -> str:
        return " | ".join(formatter(v, r if r is not None else v) if v is not None
                          else _unknown_cell(formatter, str(unknown)) for v, r in zip(values, reference))

    for key, title, formatter in rows:
        pools = [("all", title)]
        if not abbreviated:
            pools += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        shown = []
        reference = None
        for pool, name in pools:
            values = [get(f"{key}.{pool}.{m}") for m in ("current", "peak", "allocated", "freed")]
            if reference is None:
                reference = values
            if any(v is not None for v in values):
                shown.append(f" {name:<{LABEL_WIDTH}} | {cells(values, reference, formatter)} ")
        if shown:
            lines += ["-" * WIDTH] + shown
    for key, title in (("oversize_allocations", "Oversize allocations"),
                       ("oversize_segments", f"Oversize {device_name} segments" if named else "Oversize segments")):
        values = [get(f"{key}.{m}") for m in ("current", "peak", "allocated", "freed")]
        if any(v is not None for v in values):
            lines.append("-" * WIDTH)
            lines.append(f" {title:<{LABEL_WIDTH}} | {cells(values, values, format_count)} ")
    lines.append("=" * WIDTH)
    # Padded, never cut: a line too long for the table shows, it does not lose its last column.
    return "|" + "|\n|".join(line.ljust(WIDTH) for line in lines) + "|\n"


#: The client of unimem's own functions: memory only it holds needs no section.
OWN_CLIENT = "unimem"


def clients_section(by_client: Mapping[str, int], device_index: int) -> str:
    """The lines after the summary table that split its allocated memory by
    the framework each block was handed out to (``by_client``: a
    ``memory_allocated_by_client`` dict), in the table's frame; "" when no
    client but unimem's own functions holds memory. PyTorch's table above it
    stays as PyTorch prints it; a program that uses only unimem's functions
    (or PyTorch through unimem alone, whose table it is) sees nothing new."""
    held = {client: size for client, size in by_client.items() if size > 0}
    if not any(client != OWN_CLIENT for client in held):
        return ""
    total = sum(held.values())
    lines = [f"Allocated memory by client, device ID {device_index}".center(WIDTH),
             "-" * WIDTH,
             f" {'Client':^{LABEL_WIDTH}} | Cur Usage  | Share of allocated",
             "-" * WIDTH]
    lines += [f" {client:<{LABEL_WIDTH}} | {format_size(size, size)} | {100 * size / total:5.1f}%"
              for client, size in held.items()]
    lines.append("=" * WIDTH)
    return "|" + "|\n|".join(line.ljust(WIDTH) for line in lines) + "|\n"
