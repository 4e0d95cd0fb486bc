"""Sleep mode: how fast ``sleep(offload=True)`` and ``wake_up()`` move the
bytes of the live blocks, against a plain ``memcpy`` of the same bytes.

On the cpu pool (host memory from mmap, as ``unimem.cpu`` has it): 256 MiB
of live blocks (16 blocks of 16 MiB, every page written). Each round, in
turn:

* ``memcpy``: the same bytes copied (``ctypes.memmove``, block by block) into
  a new buffer (``numpy.empty``). That is what any copy of them to host
  memory costs: the buffer's pages are new, and faulting them in is part of
  the copy. (A copy into pages already touched is shown too, for scale.)
* ``sleep(offload=True)``: the live bytes copied to host memory and the
  pool's memory given back (RSS falls);
* ``wake_up()``: memory mapped back at the same addresses and the bytes
  copied back (into new pages again).

Throughput is live bytes / time, the median over the rounds with the spread
(lowest to highest). Targets: offload and restore at least 0.8 x the
throughput of the plain memcpy, measured in the same run.
"""
from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any, Dict, List

import numpy

from ._common import command_line, median_and_range, print_table, report

MiB = 1 << 20
BLOCK = 16 * MiB
BLOCKS = 16
TARGET = 0.8


def gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


def plain_memcpy(blocks: List[int], into: Any) -> float:
    """Seconds to copy every block into ``into`` (a numpy buffer)."""
    start = time.perf_counter()
    base = into.ctypes.data
    for i, ptr in enumerate(blocks):
        ctypes.memmove(base + i * BLOCK, ptr, BLOCK)
    return time.perf_counter() - start


def run(quick: bool = False) -> Dict[str, Any]:
    from unimem import _core
    from unimem.backends._host import PageAlignedBackend
    rounds = 3 if quick else 9
    total = BLOCK * BLOCKS
    allocator = _core.CachingAllocator(PageAlignedBackend("CPU"), 0)
    blocks = [allocator.malloc(BLOCK) for _ in range(BLOCKS)]
    for i, ptr in enumerate(blocks):
        ctypes.memset(ptr, i + 1, BLOCK)
    touched = numpy.ones(total, numpy.uint8)
    fresh: List[float] = []
    hot: List[float] = []
    offload: List[float] = []
    restore: List[float] = []
    discard: List[float] = []
    try:
        for _ in range(rounds):
            buffer = numpy.empty(total, numpy.uint8)          # new pages
            fresh.append(gbps(total, plain_memcpy(blocks, buffer)))
            del buffer
            hot.append(gbps(total, plain_memcpy(blocks, touched)))
            start = time.perf_counter()
            allocator.sleep(offload=True)
            offload.append(gbps(total, time.perf_counter() - start))
            start = time.perf_counter()
            allocator.wake_up()
            restore.append(gbps(total, time.perf_counter() - start))
        for i, ptr in enumerate(blocks):                      # the bytes came back
            assert ctypes.string_at(ptr + BLOCK - 7, 7) == bytes([i + 1]) * 7
        for _ in range(rounds):
            start = time.perf_counter()
            allocator.sleep(offload=False)
            discard.append(time.perf_counter() - start)
            allocator.wake_up()
    finally:
        for ptr in blocks:
            allocator.free(ptr)
        allocator.empty_cache()
    base = statistics.median(fresh)
    rows = [
        ["memcpy into new memory (the reference)", median_and_range(fresh), "1.00"],
        ["memcpy into touched memory (for scale)", median_and_range(hot), f"{statistics.median(hot) / base:.2f}"],
        ["sleep(offload=True): copy out, give back", median_and_range(offload), f"{statistics.median(offload) / base:.2f}"],
        ["wake_up(): map back, copy back", median_and_range(restore), f"{statistics.median(restore) / base:.2f}"],
    ]
    print_table(f"sleep mode on the cpu pool: {total // MiB} MiB in {BLOCKS} live blocks, "
                f"{rounds} rounds (GB/s: median, lowest-highest)",
                ["operation", "GB/s", "x memcpy"], rows)
    print(f"sleep(offload=False) of the same memory: {statistics.median(discard) * 1e3:.2f} ms (median)")
    targets = [
        {"target": f"sleep(offload=True) >= {TARGET} x memcpy", "measured":
         f"{statistics.median(offload) / base:.2f} x ({statistics.median(offload):.2f} vs {base:.2f} GB/s)",
         "met": statistics.median(offload) >= TARGET * base},
        {"target": f"wake_up() restore >= {TARGET} x memcpy", "measured":
         f"{statistics.median(restore) / base:.2f} x ({statistics.median(restore):.2f} vs {base:.2f} GB/s)",
         "met": statistics.median(restore) >= TARGET * base},
    ]
    return report("sleep", targets, live_bytes=total, blocks=BLOCKS, rounds=rounds,
                  gbps={"memcpy_new": fresh, "memcpy_touched": hot, "offload": offload, "restore": restore},
                  discard_seconds=discard)


if __name__ == "__main__":
    command_line(run, __doc__)
