"""Many threads allocating and freeing on one allocator at once."""
import random
import threading

import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend

THREADS = 8
OPS = 20_000
SIZES = [512, 1000, 4096, 65536, 1 << 20, 3 << 20, 12 << 20]


def hammer(allocator, seed, handoff, live_out, errors):
    rng = random.Random(seed)
    mine = []
    try:
        for _ in range(OPS):
            r = rng.random()
            if r < 0.45 or not mine:
                mine.append(allocator.malloc(rng.choice(SIZES)))
            elif r < 0.85:
                allocator.free(mine.pop(rng.randrange(len(mine))))
            elif r < 0.95:
                handoff.append(mine.pop())          # someone else frees it
            else:
                try:
                    allocator.free(handoff.pop())    # free a block another thread allocated
                except IndexError:
                    pass
            if len(mine) > 64:
                allocator.free(mine.pop(0))
    except BaseException as exc:   # reported by the main thread
        errors.append(exc)
    live_out.extend(mine)


@pytest.mark.parametrize("backend", [SimulatedBackend(capacity=64 << 30), PageAlignedBackend()],
                         ids=["simulated", "host"])
def test_threads_keep_the_invariants(backend):
    allocator = _core.CachingAllocator(backend, 0)
    handoff, live, errors = [], [], []
    threads = [threading.Thread(target=hammer, args=(allocator, seed, handoff, live, errors))
               for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung: deadlock?"
    assert not errors, errors
    live += handoff
    allocations = allocator.live_allocations()
    assert sorted(allocations) == sorted(live)
    spans = sorted((p, allocations[p][0]) for p in live)
    for (a, size), (b, _) in zip(spans, spans[1:]):
        assert a + size <= b
    allocator._check_invariants()
    stats = allocator.memory_stats()
    assert stats["allocation.all.current"] == len(live)
    for key, value in stats.items():
        if key.endswith(".current"):
            base = key[: -len("current")]
            assert stats[base + "allocated"] - stats[base + "freed"] == value
            assert stats[base + "peak"] >= value
    for p in live:
        allocator.free(p)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0
