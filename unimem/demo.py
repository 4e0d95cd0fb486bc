"""``python -m unimem demo``: the main job.

Runs an allocation workload on the default device of this machine through the
caching pool, then shows what the pool did: the statistics table, the cache
hit rate, and the time saved against the raw backend, both measured in the
same run on the same sequence of requests.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, TextIO

from . import _core
from ._devices import DISPLAY_NAMES, current_type

KiB, MiB = 1 << 10, 1 << 20


def training_like_requests(steps: int, seed: int = 0) -> List[int]:
    """Request sizes of a small training loop: per step, activations of a few
    layer widths (kept until the backward pass), gradients of the same sizes,
    and small temporaries; sizes vary a little between steps as batch sizes do."""
    rng = random.Random(seed)
    widths = [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 512]
    requests: List[int] = []
    for _ in range(steps):
        batch = rng.choice([1.0, 1.0, 1.0, 0.75, 0.5])
        activations = [int(w * batch) or 512 for w in widths]
        requests.extend(activations)                  # forward
        requests.extend(rng.choice([64, 512, 4 * KiB]) for _ in range(8))  # temporaries
        requests.extend(reversed(activations))        # backward: gradients
    return requests


@dataclass
class ReplayResult:
    seconds: float
    requests: int


def replay(requests: Sequence[int], malloc: Callable[[int], int], free: Callable[[int], None],
           live_window: int = 12) -> ReplayResult:
    """Allocate every request, keeping the last ``live_window`` alive (a
    sliding window of activations), and free everything at the end."""
    live: List[int] = []
    start = time.perf_counter()
    for size in requests:
        live.append(malloc(size))
        if len(live) > live_window:
            free(live.pop(0))
    for ptr in live:
        free(ptr)
    return ReplayResult(time.perf_counter() - start, len(requests))


def run(steps: int = 300, out: Optional[TextIO] = None) -> dict:
    """Run the demo; print to ``out`` (stdout by default) and return the figures."""
    import sys
    out = out or sys.stdout
    dtype = current_type()
    index = dtype.current_index()
    name = DISPLAY_NAMES[dtype.name]
    backend = dtype.backend
    requests = training_like_requests(steps)
    print(f"unimem demo on {dtype.name}:{index} ({name}, backend {type(backend).__name__}): "
          f"{len(requests)} requests in {steps} steps", file=out)

    allocator = dtype.allocator(index)
    allocator.reset_accumulated_stats()
    allocator.reset_peak_stats()
    pooled = replay(requests, lambda n: allocator.malloc(n), allocator.free)
    stats = allocator.memory_stats()

    raw = replay(requests, lambda n: backend.malloc(n, index, 0),
                 lambda p: backend.free(p, 0, index, 0))

    from ._memory_api import MemoryAPI
    print(MemoryAPI(dtype.name).memory_summary(index), file=out)
    handed_out = stats["allocation.all.allocated"]
    misses = stats["num_device_alloc"]
    hit_rate = 1.0 - misses / handed_out if handed_out else 0.0
    speedup = raw.seconds / pooled.seconds if pooled.seconds else float("inf")
    print(f"cache hit rate: {hit_rate:.1%} ({handed_out - misses} of {handed_out} requests "
          f"served without the backend)", file=out)
    print(f"time: {pooled.seconds * 1e3:.1f} ms through the pool vs {raw.seconds * 1e3:.1f} ms "
          f"of raw backend malloc/free ({speedup:.1f}x faster, "
          f"{(raw.seconds - pooled.seconds) * 1e3:.1f} ms saved)", file=out)
    print(f"peak reserved {_core.format_size(stats['reserved_bytes.all.peak'])} for a peak of "
          f"{_core.format_size(stats['requested_bytes.all.peak'])} requested", file=out)
    return {"device": f"{dtype.name}:{index}", "requests": len(requests), "hit_rate": hit_rate,
            "pool_seconds": pooled.seconds, "raw_seconds": raw.seconds, "speedup": speedup}
