"""The core's rule, checked at every call it makes out: no backend call,
hook, observer or history callback finds the allocator's lock held by the
thread that makes it. Each backend here notes, at each call, whether the
calling thread holds the lock (``_lock_held_here``); each scenario drives
one part of the core (plain segments, stream events, expandable segments,
sleep, private pools, history, debug mode) and asserts that no call was made
with it held. (tests/core/threads/test_backend_calls_outside_the_lock.py
checks the consequence: another thread is served meanwhile.)

A part whose calls still run under the lock is a strict xfail naming them,
so that moving them out flips it."""
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedGPU

from tests.helpers.pool_allocators import PageAllocator

MiB = 1 << 20
GiB = 1 << 30

# Every call the core makes to a backend (the Backend protocol, base.py).
BACKEND_CALLS = frozenset({
    "malloc", "free", "memory_info", "max_allocation_size", "check_stream", "release_stream",
    "abandoned_streams", "sweep_released_streams", "record_event", "event_done", "event_synchronize",
    "release_event", "synchronize", "virtual_memory_granularity", "reserve_address_range",
    "map_pages", "unmap_pages", "unmap_idle_pages", "release_address_range",
    "page_release_unavailable_reason", "release_pages", "restore_pages", "copy_to_host",
    "copy_from_host",
})


class Watch:
    """Which calls found the lock held by their own thread."""

    def __init__(self):
        self.allocator = None
        self.under_lock = set()
        self.seen = set()

    def note(self, name):
        self.seen.add(name)
        if self.allocator is not None and self.allocator._lock_held_here():
            self.under_lock.add(name)

    def wrap(self, name, fn):
        def watched(*args, **kwargs):
            self.note(name)
            return fn(*args, **kwargs)
        return watched


class Watched:
    """Mixed into a backend: each protocol call notes the lock first."""

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in BACKEND_CALLS and callable(attr):
            return object.__getattribute__(self, "watch").wrap(name, attr)
        return attr


class WatchedGPU(Watched, SimulatedGPU):
    def __init__(self, watch, **kwargs):
        self.watch = watch
        super().__init__(**kwargs)


class WatchedPages(Watched, PageAllocator):
    def __init__(self, watch, **kwargs):
        self.watch = watch
        super().__init__(**kwargs)


def make(watch, backend, **options):
    allocator = _core.CachingAllocator(backend, 0, **options)
    watch.allocator = allocator
    return allocator


def plain_segments(watch):
    """Misses, hits, frees, empty_cache, an out-of-memory error with its
    observer, and the cache switched off."""
    a = make(watch, WatchedGPU(watch, capacity=8 * GiB))
    a.set_capacity(8 * GiB)
    a.add_oom_observer(watch.wrap("oom observer", lambda *args: None))
    ptrs = [a.malloc(n) for n in (512, 3 * MiB, 30 * MiB)]
    for p in ptrs:
        a.free(p)
    a.free(a.malloc(512))
    a.set_memory_fraction(40 * MiB / (8 * GiB))
    with pytest.raises(_core.OutOfMemoryError):
        a.malloc(64 * MiB)
    a.empty_cache()
    a._check_invariants()


def stream_events(watch):
    """record_stream, the events of its frees, asked about and waited for,
    a stream released once nothing is kept for it."""
    gpu = WatchedGPU(watch, capacity=8 * GiB)
    a = make(watch, gpu)
    a.set_capacity(8 * GiB)
    p = a.malloc(MiB)
    a.record_stream(p, 7)
    a.free(p)                               # an event on stream 7
    a.free(a.malloc(4096))                  # asks about it
    q = a.malloc(MiB, 9)
    a.record_stream(q, 7)
    a.free(q)
    a.empty_cache()                         # waits for the events, releases streams 7 and 9
    a._check_invariants()


def expandable_segments(watch):
    """Ranges reserved and grown page by page, free pages unmapped, empty
    ranges released."""
    a = make(watch, WatchedGPU(watch, capacity=8 * GiB), expandable_segments=True)
    a.set_capacity(8 * GiB)
    ptrs = [a.malloc(n, s) for n, s in ((512, 0), (64 * MiB, 0), (64 * MiB, 3))]
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    a.empty_virt_addr_cache()
    a._check_invariants()


def expandable_holes(watch):
    """max_reserved_ratio: holes unmapped once their stream's work is done."""
    gpu = WatchedGPU(watch, capacity=8 * GiB)
    a = make(watch, gpu, expandable_segments=True, max_reserved_ratio=1.0)
    a.set_capacity(8 * GiB)
    ptrs = [a.malloc(8 * MiB) for _ in range(8)]
    for p in ptrs[::2]:
        gpu.launch(0, p, 8 * MiB)
        a.free(p)
    ptrs = ptrs[1::2] + [a.malloc(16 * MiB) for _ in range(4)]     # misses: the holes go first
    gpu.complete(0)
    for p in ptrs:
        a.free(p)
    a.malloc(4096)
    a.empty_cache()
    a._check_invariants()


def sleep_and_wake_up(watch):
    """sleep(offload=True) copies live blocks out and gives the memory back;
    wake_up backs it again and copies them back."""
    backend = WatchedPages(watch, host_accessible=False)
    a = make(watch, backend)
    live = [a.malloc(n) for n in (700, 3 * MiB)]
    a.free(a.malloc(30 * MiB))
    a.sleep(offload=True)
    a.wake_up()
    for p in live:
        a.free(p)
    a._check_invariants()


def private_pools(watch):
    """A MemPool with an allocator of its own: its segments asked for, given
    back at empty_cache and when the pool is released."""
    a = make(watch, WatchedGPU(watch, capacity=8 * GiB))
    a.set_capacity(8 * GiB)
    own = WatchedPages(watch)
    pool = (0, 1)
    a.create_pool(pool, own)
    a.begin_pool(pool)
    try:
        ptrs = [a.malloc(n) for n in (700, 3 * MiB)]
    finally:
        a.end_pool(pool)
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    a.release_pool(pool)
    a._check_invariants()


def history(watch):
    """The history hook, with frees and allocations on two threads."""
    a = make(watch, WatchedGPU(watch, capacity=8 * GiB))
    a.set_trace_hook(watch.wrap("history hook", lambda events: watch.wrap("history commit", lambda: None)))
    worker = threading.Thread(target=lambda: [a.free(a.malloc(n)) for n in (512, 30 * MiB)])
    worker.start()
    a.free(a.malloc(4096))
    worker.join()
    a.flush_history()
    a.set_trace_hook(None)


def debug_mode(watch):
    """Debug mode's caller frames (on memory the host can read)."""
    a = make(watch, WatchedPages(watch))
    a.enable_debug(watch.wrap("debug site", lambda: []))
    a.free(a.malloc(4096))
    a._check_invariants()


def still_under_the_lock(*calls):
    return pytest.mark.xfail(strict=True, reason="still called with the core's lock held: " + ", ".join(calls))


SCENARIOS = [
    pytest.param(plain_segments, id="plain segments"),
    pytest.param(stream_events, id="stream events"),
    pytest.param(expandable_segments, id="expandable segments"),
    pytest.param(expandable_holes, id="expandable holes"),
    pytest.param(sleep_and_wake_up, id="sleep"),
    pytest.param(private_pools, id="private pools", marks=still_under_the_lock("malloc (the pool's allocator)")),
    pytest.param(history, id="history"),
    pytest.param(debug_mode, id="debug mode"),
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_backend_call_or_hook_finds_the_lock_held(scenario):
    watch = Watch()
    scenario(watch)
    assert watch.seen, "the scenario made no call out"
    assert watch.under_lock == set(), f"called with the lock held: {sorted(watch.under_lock)}"
