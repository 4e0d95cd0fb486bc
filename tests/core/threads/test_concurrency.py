"""Many threads allocating and freeing on one allocator at once."""
import random
import threading
import time

import pytest

from benchmarks._timing import time_hot_path
from unimem import _core
from unimem._runtime import devices as _devices
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

THREADS = 8
SIZES = [512, 1000, 4096, 65536, 1 << 20, 3 << 20, 12 << 20]


def worker(allocator, seed, keep_going, maintenance, handoff, live_out, errors, counts):
    """Random work until ``keep_going(done)`` says stop: allocate, free,
    hand a block to another thread, free one another thread allocated, and,
    with ``maintenance``, read statistics, release the cache, reset peaks."""
    rng = random.Random(seed)
    mine = []
    done = 0
    try:
        while keep_going(done):
            r = rng.random()
            if r < 0.40 or not mine:
                mine.append(allocator.malloc(rng.choice(SIZES)))
            elif r < 0.75:
                allocator.free(mine.pop(rng.randrange(len(mine))))
            elif r < 0.82:
                handoff.append(mine.pop())           # someone else frees it
            elif r < 0.88 or not maintenance:
                try:
                    allocator.free(handoff.pop())    # a block another thread allocated
                except IndexError:
                    pass
            elif r < 0.94:
                stats = allocator.memory_stats()
                assert stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"]
            elif r < 0.97:
                allocator.empty_cache()
            else:
                allocator.reset_peak_stats()
            if len(mine) > 48:
                allocator.free(mine.pop(0))
            done += 1
    except BaseException as exc:                     # reported by the main thread
        errors.append(exc)
    live_out.extend(mine)
    counts.append(done)


def run_threads(allocator, keep_going, maintenance):
    handoff, live, errors, counts = [], [], [], []
    threads = [threading.Thread(target=worker, args=(allocator, seed, keep_going, maintenance,
                                                     handoff, live, errors, counts))
               for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)                # bounded: a hang fails here
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert not errors, errors
    live += handoff
    allocations = allocator.live_allocations()
    assert sorted(allocations) == sorted(live)
    spans = sorted((p, allocations[p][0]) for p in live)
    for (a, size), (b, _) in zip(spans, spans[1:]):
        assert a + size <= b, "live blocks overlap"
    allocator._check_invariants()
    stats = allocator.memory_stats()
    assert stats["allocation.all.current"] == len(live)
    if not maintenance:                    # (reset_peak does not touch allocated/freed)
        for key, value in stats.items():
            if key.endswith(".current"):
                base = key[: -len("current")]
                assert stats[base + "allocated"] - stats[base + "freed"] == value
                assert stats[base + "peak"] >= value
    for p in live:
        allocator.free(p)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0
    return sum(counts)


@pytest.mark.parametrize("backend", [SimulatedBackend(capacity=64 << 30), PageAlignedBackend()],
                         ids=["simulated", "host"])
def test_eight_threads_twenty_thousand_operations_each(backend):
    allocator = _core.CachingAllocator(backend, 0)
    assert run_threads(allocator, lambda done: done < 20_000, maintenance=False) == THREADS * 20_000


def backends_for_the_mixed_run():
    found = [("simulated", lambda: _core.CachingAllocator(SimulatedBackend(capacity=64 << 30), 0)),
             ("host", lambda: _core.CachingAllocator(PageAlignedBackend(), 0))]
    if _devices.is_available("xpu"):
        from unimem.backends.xpu import XPUBackend
        found.append(("sycl", lambda: _core.CachingAllocator(XPUBackend("device"), 0)))
    return found


@pytest.mark.parametrize("name, make", backends_for_the_mixed_run(), ids=lambda v: v if isinstance(v, str) else "")
def test_eight_threads_with_statistics_and_cache_releases(name, make):
    deadline = time.monotonic() + 4.0
    assert run_threads(make(), lambda done: time.monotonic() < deadline, maintenance=True) > 1000


def test_threads_contending_for_the_lock_without_the_gil():
    """Four threads on the cache-hit path with the GIL released (the lock's
    spinning, yielding and futex sleeping all happen on two cores), beside
    threads on the Python API: every pair is accounted for exactly."""
    allocator = _core.CachingAllocator(SimulatedBackend(capacity=64 << 30), 0)
    sizes = [512, 65536, 4 << 20, 1000, 3 << 20]
    live = [allocator.malloc(size) for size in sizes for _ in range(8)]
    for p in live:
        allocator.free(p)
    before = allocator.memory_stats()
    pairs = 200_000
    errors = []

    def gil_free():
        try:
            time_hot_path(allocator, sizes, pairs, release_gil=True)
        except BaseException as exc:
            errors.append(exc)

    def python_api():
        try:
            for i in range(20_000):
                allocator.free(allocator.malloc(sizes[i % len(sizes)]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=gil_free) for _ in range(4)]
    threads += [threading.Thread(target=python_api) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert not errors, errors
    allocator._check_invariants()
    stats = allocator.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0
    # each time_hot_path call also warms every size once
    expected = 4 * (pairs + len(sizes)) + 2 * 20_000
    assert stats["allocation.all.allocated"] - before["allocation.all.allocated"] == expected
    assert stats["allocation.all.freed"] - before["allocation.all.freed"] == expected
    assert stats["segment.all.current"] == before["segment.all.current"]   # all hits: nothing new reserved


class YieldingVM(SimulatedGPU):
    """A simulated device whose virtual-memory calls give the GIL up half-way,
    so that other threads run while the core has a call in flight (it makes
    them with its lock let go)."""

    def _after_yielding(self, call, *args):
        time.sleep(0)
        return getattr(super(), call)(*args)

    def map_pages(self, *args):
        return self._after_yielding("map_pages", *args)

    def unmap_pages(self, *args):
        return self._after_yielding("unmap_pages", *args)

    def unmap_idle_pages(self, *args):
        return self._after_yielding("unmap_idle_pages", *args)

    def release_address_range(self, *args):
        return self._after_yielding("release_address_range", *args)


def expandable(backend, **options):
    def make():
        allocator = _core.CachingAllocator(backend(), 0, expandable_segments=True, **options)
        allocator.set_capacity(64 << 30)
        return allocator
    return make


@pytest.mark.parametrize("make", [
    pytest.param(expandable(lambda: YieldingVM(capacity=64 << 30)), id="simulated"),
    pytest.param(expandable(lambda: YieldingVM(capacity=64 << 30), max_reserved_ratio=1.0), id="holes"),
    pytest.param(expandable(lambda: PageAlignedBackend("CPU")), id="host"),
])
def test_eight_threads_on_expandable_segments(make):
    """Maps, unmaps (empty_cache, and with a ratio every miss's holes) and
    range releases of eight threads overlap, with a ninth releasing empty
    ranges all along."""
    allocator = make()
    deadline = time.monotonic() + 4.0
    stop = threading.Event()
    errors = []

    def release_ranges():
        try:
            while not stop.is_set():
                allocator.empty_virt_addr_cache()
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)
    releaser = threading.Thread(target=release_ranges)
    releaser.start()
    try:
        assert run_threads(allocator, lambda done: time.monotonic() < deadline, maintenance=True) > 1000
    finally:
        stop.set()
        releaser.join(timeout=60)
    assert not errors, errors
    allocator.empty_virt_addr_cache()
    assert allocator.reserved_address_space() == {"ranges": 0, "bytes": 0}
