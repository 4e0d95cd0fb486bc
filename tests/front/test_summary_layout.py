"""The ``memory_summary`` tables of every pool kind keep PyTorch's layout:
PyTorch's own ``torch.cuda.memory_summary`` formats the same
statistics, and every row's ``|`` sits where it sits in PyTorch's table, no
cell cut; a pool that never held memory prints no table."""
import subprocess
import sys
from typing import Dict, List

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import unimem
import unimem.host
from unimem._observe.summary import clients_section, memory_summary_table
from unimem._runtime.devices import DISPLAY_NAMES
from tests.helpers import REPO_ROOT
from tests.helpers.pytorch_summary import pytorch_memory_summary
from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

#: The names of the tables of every pool kind: the device types' pools (GPU,
#: XPU, CPU), the pinned host pool, and the shared USM and host USM pools
#: whose tables ``unimem.xpu.memory_summary`` adds (tested there too, below).
POOL_NAMES = [*sorted(set(DISPLAY_NAMES.values())), unimem.host.POOL.display_name, "XPU shared USM", "XPU host USM"]

#: PyTorch's labels that name the memory, and what they read where the pool's
#: name does not fit the label column.
ABBREVIATIONS = {"GPU reserved memory": "Reserved memory", "GPU reserved segments": "Reserved segments",
                 "Oversize GPU segments": "Oversize segments"}
LABEL_WIDTH = 21                # PyTorch's " {label:<21} |"
LABEL_END = 1 + 1 + LABEL_WIDTH + 1     # where a row's first "|" after the outer one sits
WIDTH = 77                      # 75 columns between the outer "|"

BYTES_METRICS = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes")
COUNT_METRICS = ("allocation", "active", "segment", "inactive_split")
FIGURES = ("current", "peak", "allocated", "freed")
MOST_BYTES = (1 << 63) - 1      # a 64-bit counter: 8192 PiB, still 6 digits
MOST_COUNT = 10 ** 12 - 1       # 999999 M; 12 digits of OOMs, PyTorch's {:<12d}
MOST_RETRIES = 10 ** 8 - 1      # PyTorch's {:<8d}


def full_stats(value: int = 0) -> Dict[str, int]:
    """Every key PyTorch's table reads, all ``value`` (the retries at most
    MOST_RETRIES)."""
    stats = {"num_ooms": value, "num_alloc_retries": min(value, MOST_RETRIES)}
    for metric in BYTES_METRICS + COUNT_METRICS:
        stats.update({f"{metric}.{pool}.{figure}": value
                      for pool in ("all", "large_pool", "small_pool") for figure in FIGURES})
    for metric in ("oversize_allocations", "oversize_segments"):
        stats.update({f"{metric}.{figure}": value for figure in FIGURES})
    return stats


@st.composite
def memory_stats(draw: st.DrawFn) -> Dict[str, int]:
    """A ``memory_stats`` dict whose large and small pools add up to all."""
    stats = full_stats()
    stats["num_ooms"] = draw(st.integers(0, MOST_COUNT))
    stats["num_alloc_retries"] = draw(st.integers(0, MOST_RETRIES))
    for metric in BYTES_METRICS + COUNT_METRICS:
        most = MOST_BYTES if metric in BYTES_METRICS else MOST_COUNT
        for figure in FIGURES:
            total = draw(st.integers(0, most))
            large = draw(st.integers(0, total))
            stats[f"{metric}.all.{figure}"] = total
            stats[f"{metric}.large_pool.{figure}"] = large
            stats[f"{metric}.small_pool.{figure}"] = total - large
    for metric in ("oversize_allocations", "oversize_segments"):
        for figure in FIGURES:
            stats[f"{metric}.{figure}"] = draw(st.integers(0, MOST_COUNT))
    return stats


def separators(line: str) -> List[int]:
    return [i for i, c in enumerate(line) if c == "|"]


def expected_label(pytorch_label: str, name: str) -> str:
    """PyTorch's label with the pool's name for "GPU" where all such labels
    still fit its column, else the abbreviation."""
    fits = all(len(label.replace("GPU", name)) <= LABEL_WIDTH for label in ABBREVIATIONS)
    if pytorch_label not in ABBREVIATIONS:
        return pytorch_label
    return pytorch_label.replace("GPU", name) if fits else ABBREVIATIONS[pytorch_label]


def assert_pytorch_layout(ours: str, stats: Dict[str, int], name: str, abbreviated: bool) -> None:
    """``ours`` (one table, of ``stats``) against PyTorch's table of ``stats``:
    the same lines, each 77 wide with its ``|`` where PyTorch's are; the same
    cells (none cut); PyTorch's labels or their abbreviations; the pool named
    in the title, the OOMs line within its margins."""
    theirs = pytorch_memory_summary(stats, abbreviated)
    mine_lines, their_lines = ours.splitlines(), theirs.splitlines()
    assert len(mine_lines) == len(their_lines), f"{name}: {len(mine_lines)} lines, PyTorch's {len(their_lines)}"
    for i, (mine, pytorch) in enumerate(zip(mine_lines, their_lines)):
        where = f"{name} table, line {i}:\n{mine}\nPyTorch's:\n{pytorch}"
        assert len(mine) == len(pytorch) == WIDTH, where
        assert separators(mine) == separators(pytorch), where
        if i == 1:                                  # the title names the product and the pool
            assert mine.strip("| ") == f"unimem {name} memory summary, device ID 0", where
        elif i == 3:                                # the OOMs line
            assert mine.startswith("|  ") and mine.endswith("  |"), where
            assert f"OOMs: {stats['num_ooms']} " in mine, where
            assert f"malloc retries: {stats['num_alloc_retries']} " in mine, where
        elif len(separators(mine)) == 2:            # a rule
            assert mine == pytorch, where
        else:                                       # the column titles and the rows
            assert mine[LABEL_END:] == pytorch[LABEL_END:], where
            label, pytorch_label = mine[1:LABEL_END - 1].strip(), pytorch[1:LABEL_END - 1].strip()
            assert label == expected_label(pytorch_label, name), where


def split_tables(summary: str) -> List[str]:
    """The tables of a ``memory_summary`` (one or more, a blank line between)."""
    return [table + "\n" for table in summary.rstrip("\n").split("\n\n")]


@pytest.mark.parametrize("abbreviated", [False, True])
@pytest.mark.parametrize("name", POOL_NAMES)
@settings(max_examples=40, deadline=None)
@given(stats=memory_stats())
@example(stats=full_stats(0))
@example(stats=full_stats(767 * 1024))
@example(stats=full_stats(MOST_COUNT))
def test_every_pool_kinds_table_has_pytorchs_layout(name, abbreviated, stats):
    assert_pytorch_layout(memory_summary_table(stats, name, 0, abbreviated), stats, name, abbreviated)


def test_long_pool_names_are_in_the_title_only():
    """A regression: "XPU shared USM reserved memory" outgrew
    the label column and the row lost its "Tot Freed" cell."""
    table = memory_summary_table(full_stats(5), "XPU shared USM", 0)
    assert "unimem XPU shared USM memory summary, device ID 0" in table
    assert table.count("XPU shared USM") == 1
    for label in ABBREVIATIONS.values():
        assert f"| {label:<{LABEL_WIDTH}} | " in table
    assert all(line.endswith("  |") for line in table.splitlines() if line.startswith("| ")), table


def test_pytorchs_own_formatting_makes_the_reference_table():
    """The reference is PyTorch's code formatting these statistics, not a copy of it."""
    stats = full_stats(3)
    stats["reserved_bytes.all.current"] = 5 << 30
    table = pytorch_memory_summary(stats)
    assert "| GPU reserved memory   |   5120 MiB |" in table
    assert "CUDA OOMs: 3 " in table and "cudaMalloc retries: 3 " in table


def test_cpu_summary_has_pytorchs_layout():
    pointer = unimem.cpu.caching_allocator_alloc(3 << 20)
    try:
        stats = dict(unimem.cpu.memory_stats())
        ours = unimem.cpu.memory_summary()
        assert stats == dict(unimem.cpu.memory_stats())
    finally:
        unimem.cpu.caching_allocator_delete(pointer)
        unimem.cpu.empty_cache()        # the tests after find the pool as they would alone
    assert_pytorch_layout(ours, stats, "CPU", abbreviated=False)


def test_xpu_summary_adds_the_used_usm_pools_with_pytorchs_layout(xpu, dpnp):
    """``unimem.xpu.memory_summary``: the device's table, then the shared USM
    and the host USM pools' once they hold memory, each in PyTorch's layout."""
    with xpu.using_allocator():
        shared = dpnp.arange(100_000, dtype="i4", usm_type="shared")
        pinned = dpnp.arange(100_000, dtype="i4", usm_type="host")
        xpu.synchronize()
        pools = {"XPU": xpu.allocator_for("device", 0), "XPU shared USM": xpu.allocator_for("shared", 0),
                 "XPU host USM": xpu.allocator_for("host", 0)}
        stats = {name: dict(pool.memory_stats()) for name, pool in pools.items()}
        summary = xpu.memory_summary(0)
        assert stats == {name: dict(pool.memory_stats()) for name, pool in pools.items()}, \
            "the pools changed while the summary was made"
        del shared, pinned
        xpu.synchronize()
        for pool in pools.values():
            pool.empty_cache()
    tables = split_tables(summary)
    assert len(tables) == 3, summary
    for table, name in zip(tables, pools):
        assert_pytorch_layout(table, stats[name], name, abbreviated=False)


NEVER_HELD_MEMORY = """
import unimem.xpu as xpu
xpu.allocator_for("shared", 0)          # set up, as the dpnp hook sets them up, never allocated from
xpu.allocator_for("host", 0)
print(xpu.memory_summary(0).count("memory summary"))
pointer = xpu.allocator_for("shared", 0).malloc(1024)
print(xpu.memory_summary(0).count("memory summary"))
xpu.allocator_for("shared", 0).free(pointer)
xpu.allocator_for("shared", 0).empty_cache()
print(xpu.memory_summary(0).count("memory summary"))
"""


def test_pools_that_never_held_memory_print_no_table(xpu):
    """A regression: the demo printed the shared USM and host
    USM pools' tables, all zeros, though nothing came from them. In a fresh
    process: set up, no table; once it held memory, its table, also after its
    memory is back."""
    done = subprocess.run([sys.executable, "-c", NEVER_HELD_MEMORY], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "2"], done.stdout


def test_demo_prints_pytorchs_layout_and_no_empty_table(tmp_path):
    """``python -m unimem demo`` ends with the summary of the device it trained
    on: one table (nothing came from the other pools), in PyTorch's layout."""
    done = subprocess.run([sys.executable, "-m", "unimem", "demo", "--steps", "3", "--no-oom",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert sum("memory summary, device ID" in line for line in table) == 1, done.stdout
    reference = pytorch_memory_summary(full_stats()).splitlines()
    assert len(table) == len(reference), done.stdout
    for mine, pytorch in zip(table, reference):
        assert len(mine) == WIDTH and separators(mine) == separators(pytorch), f"{mine}\n{pytorch}"


# ---------------------------------------------------------------------------
# who holds the memory: unimem's section after PyTorch's table
# ---------------------------------------------------------------------------
def test_the_clients_section_is_framed_as_the_table():
    section = clients_section({"unimem": 1024, "torch": 3 << 20, "cupy": 5 << 30}, 1)
    lines = section.splitlines()
    assert section.endswith("|\n") and all(len(line) == WIDTH for line in lines), section
    assert lines[0].strip("| ") == "Allocated memory by client, device ID 1"
    assert lines[-1] == "|" + "=" * (WIDTH - 2) + "|"
    rows = {line[1:LABEL_END].strip(): line for line in lines[4:-1]}
    assert list(rows) == ["unimem", "torch", "cupy"]          # the order given (CLIENTS')
    assert all(separators(row)[:3] == [0, LABEL_END, LABEL_END + 13] for row in rows.values()), section
    assert "   3072 KiB |   0.1%" in rows["torch"] and "   5120 MiB |  99.9%" in rows["cupy"], section


def test_no_section_while_only_unimems_own_functions_hold_memory():
    assert clients_section({}, 0) == ""
    assert clients_section({"unimem": 4096}, 0) == ""
    assert clients_section({"unimem": 4096, "cupy": 0}, 0) == ""
    assert "| dpnp " in clients_section({"dpnp": 512}, 0)


def test_memory_summary_is_pytorchs_table_then_the_clients(fake):
    """PyTorch's table stays PyTorch's, byte for byte; the section follows it
    while a client other than unimem's own functions holds memory."""
    import unimem.cuda as ucuda
    own = ucuda.caching_allocator_alloc(1000)
    alone = ucuda.memory_summary(0)
    assert alone == memory_summary_table(ucuda.memory_stats(0), "GPU", 0)
    pointer = ucuda.allocator(4096)                  # CuPy's
    summary = ucuda.memory_summary(0)
    table = memory_summary_table(ucuda.memory_stats(0), "GPU", 0)
    assert summary.startswith(table) and summary[len(table):] == clients_section({"unimem": 1024, "cupy": 4096}, 0)
    assert_pytorch_layout(table, dict(ucuda.memory_stats(0)), "GPU", abbreviated=False)
    assert "| cupy " in summary and "| unimem " in summary
    del pointer
    assert ucuda.memory_summary(0, abbreviated=True) == memory_summary_table(ucuda.memory_stats(0), "GPU", 0, True)
    ucuda.caching_allocator_delete(own)
