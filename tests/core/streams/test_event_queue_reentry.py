"""The event queues (_core_event_queue.pxi, native since the events are
asked about outside the lock) are still around Python: recording, asking and
waiting run Python, and making any Python object may start a garbage
collection whose finalizers re-enter the allocator. Each test here runs one operation over and over, a finalizer
re-entering at the 1st, 2nd, ... collection inside it, until the operation
makes no more: every window is tried. After each run every stream completes
and the cache is emptied, and the allocator must be whole: each block back
once, nothing unmapped twice, no entry lost.

Before the fix: a collection between handling the done entries and taking
them out of their queues let a nested pass handle them again (a block's
event count went to -1, held pages were unmapped twice, a queue was read
past its end: a segfault), one inside _add_pending appended to a queue a
nested pass had dropped (the block never came back), and one inside
empty_cache's _take_pending raised KeyError and lost the entries taken."""
import gc
import os
import threading
import time
import warnings

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

from tests.helpers.stream_events import free_after_use

KiB = 1 << 10
MiB = 1 << 20
MOST_COLLECTIONS = 80       # more than any of these operations makes


def run_with_reentry(operation, reenter, k, backend):
    """Run ``operation()`` with a finalizer that calls ``reenter()`` at the
    ``k``-th garbage collection it makes; whether it made that many. Not
    inside a call of the simulated ``backend``, whose lock is not
    re-entrant (a collection there is counted and the next one re-enters)."""
    state = {"seen": 0, "fired": False}
    hoard = []

    class Finalizer:
        def __init__(self):
            self.me = self                  # cyclic: only a collection ends it

        def __del__(self):
            if state["fired"]:
                return
            state["seen"] += 1
            if state["seen"] >= k and not backend._lock.locked():
                state["fired"] = True
                reenter()
                return
            # Empty the list and dict free lists, so that the next new list
            # or dict comes from the collector's allocator and may start one.
            hoard.append([[] for _ in range(100)])
            hoard.append([{} for _ in range(100)])
            Finalizer()

    thresholds = gc.get_threshold()
    Finalizer()
    gc.set_threshold(1)
    try:
        operation()
    finally:
        gc.set_threshold(*thresholds)
        hoard.clear()
        state["fired"] = True
        gc.collect()
    return state["seen"] >= k


def sweep(scenario):
    """``scenario(k)`` for k = 1, 2, ... until a run makes fewer than k collections."""
    for k in range(1, MOST_COLLECTIONS):
        if not scenario(k):
            return k
    pytest.fail(f"more than {MOST_COLLECTIONS} collections in one operation")


def check_whole(a, backend, live, k):
    """After run ``k``, every stream complete and its events processed: the
    allocator holds ``live`` only, and once they are freed and the cache
    emptied, nothing is reserved."""
    a._check_invariants()
    assert a.memory_stats()["active.all.current"] == len(live), k
    for p in live:
        a.free(p)
    a.empty_cache()
    assert a.memory_reserved() == 0 and backend.held() == 0, k
    a._check_invariants()


def test_process_events_with_a_finalizer_re_entering_at_every_collection():
    def scenario(k):
        backend = SimulatedBackend()
        a = _core.CachingAllocator(backend, 0)
        freed = [a.malloc(4 * KiB) for _ in range(3)]
        other = a.malloc(4 * KiB)
        free_after_use(a, freed, 7)
        backend.complete(7)
        live = []

        def reenter():
            live.append(a.malloc(512))              # through process_events
            a.record_stream(other, 9)               # a free that queues an event
            a.free(other)

        made = run_with_reentry(a.process_events, reenter, k, backend)
        if not live:                                # never re-entered: other is live still
            a.record_stream(other, 9)
            a.free(other)
        backend.complete(9)
        a.process_events()
        check_whole(a, backend, live, k)
        return made

    assert sweep(scenario) > 3


def test_held_pages_processed_with_a_finalizer_re_entering_at_every_collection():
    def scenario(k):
        gpu = SimulatedGPU(capacity=256 * MiB)
        a = _core.CachingAllocator(gpu, 0, expandable_segments=True, max_reserved_ratio=1.0)
        a.set_capacity(256 * MiB)
        first = a.malloc(2 * MiB)
        hole = a.malloc(8 * MiB)
        last = a.malloc(2 * MiB)
        gpu.launch(0, hole, 8 * MiB)
        a.free(hole)
        big = a.malloc(10 * MiB)                    # the hole's pages held, their event pending
        assert a.memory_stats()["num_device_free"] == 0
        gpu.complete(0)
        live = [first, last, big]

        def reenter():
            live.append(a.malloc(512, 1))

        made = run_with_reentry(a.process_events, reenter, k, gpu)
        a._check_invariants()
        assert a.lost_segments()["count"] == 0, k
        for p in live:
            a.free(p)
        a.empty_cache()
        a.empty_virt_addr_cache()
        assert a.memory_reserved() == 0 and not gpu.mapped_pages[0], k
        a._check_invariants()
        return made

    assert sweep(scenario) > 3


def test_empty_cache_with_a_finalizer_re_entering_at_every_collection():
    def scenario(k):
        backend = SimulatedBackend()
        a = _core.CachingAllocator(backend, 0)
        on_7 = [a.malloc(4 * KiB) for _ in range(3)]
        on_9 = a.malloc(4 * KiB)
        free_after_use(a, on_7, 7)
        free_after_use(a, [on_9], 9)
        backend.complete(9)                         # done, not yet processed
        live = []

        made = run_with_reentry(a.empty_cache, lambda: live.append(a.malloc(512)), k, backend)
        backend.complete(7)
        a.process_events()
        check_whole(a, backend, live, k)
        return made

    assert sweep(scenario) > 3


def test_a_free_on_another_stream_with_a_finalizer_re_entering_at_every_collection():
    def scenario(k):
        backend = SimulatedBackend()
        a = _core.CachingAllocator(backend, 0)
        x = a.malloc(4 * KiB)
        y = a.malloc(4 * KiB)
        a.record_stream(x, 7)
        live = []

        def reenter():
            a.record_stream(y, 7)
            a.free(y)
            backend.complete(7)
            live.append(a.malloc(512))              # y's event done: its queue may empty

        made = run_with_reentry(lambda: a.free(x), reenter, k, backend)
        if not live:
            a.record_stream(y, 7)
            a.free(y)
        backend.complete(7)
        a.process_events()
        check_whole(a, backend, live, k)
        return made

    assert sweep(scenario) > 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_empty_cache_ends_its_wait_frees_no_block_twice():
    """After empty_cache's wait, the entries it handled
    stayed in syncing_events until a new list was made; a collection there
    let another thread fork, and the child, which puts syncing_events back
    in its queues, freed those blocks a second time (the free index held a
    block twice). The finalizer wakes a thread that forks, at every
    collection of empty_cache in turn; the child completes every stream,
    processes events and checks the allocator."""
    def child_report(a, backend):
        try:
            backend.complete(7)
            a.process_events()
            a._check_invariants()
            return "ok"
        except BaseException as exc:
            return f"{type(exc).__name__}: {exc}"

    def scenario(k):
        backend = SimulatedBackend()
        a = _core.CachingAllocator(backend, 0)
        free_after_use(a, [a.malloc(4 * KiB) for _ in range(3)], 7)
        go = threading.Event()
        result = {}
        read_end, write_end = os.pipe()

        def fork_when_told():
            go.wait()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)    # fork with threads: on purpose
                pid = os.fork()
            if pid == 0:
                os.write(write_end, child_report(a, backend).encode())
                os._exit(0)
            os.close(write_end)
            result["child"] = os.read(read_end, 4000).decode()
            os.close(read_end)
            os.waitpid(pid, 0)

        forker = threading.Thread(target=fork_when_told)
        forker.start()

        def reenter():
            go.set()
            time.sleep(0.3)                     # the other thread forks meanwhile

        made = run_with_reentry(a.empty_cache, reenter, k, backend)
        go.set()
        forker.join()
        assert result["child"] == "ok", (k, result["child"])
        a._check_invariants()
        return made

    assert sweep(scenario) > 3
