"""The cache switched off (caching_allocator_enable(False)): every free gives
its segment back, whatever path the block takes back, and a free made on a
runtime's thread (c_free_detached without the GIL, as a SYCL host task makes
it) waits for nothing there.

Giving a segment back calls the backend's free, which may wait for the work
queued where the memory was used (the XPU backend waits on the segment's
queue, as PyTorch's waits before sycl::free). On a SYCL host task's thread
that is a wait for the host task's own queue, and a wait behind any other
thread waiting for it: such a free is kept (_keep_uncached_free) and done by
the next call from Python's side, which may wait. A block used on other
streams goes back once their events complete (_handle_done): with the cache
off, its segment then goes back too. The SYCL case itself:
tests/front/test_xpu_deferred_frees.py."""
import sys
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


class ThreadsFreeing(SimulatedBackend):
    """A simulated device that notes the thread of every free."""

    def __init__(self):
        super().__init__()
        self.freeing_threads = []

    def free(self, ptr, size, device=0, stream=0):
        self.freeing_threads.append(threading.get_ident())
        super().free(ptr, size, device, stream)


def uncached():
    backend = ThreadsFreeing()
    a = _core.CachingAllocator(backend, 0)
    a.set_caching(False)
    return backend, a


def free_on_a_runtime_thread(a, ptr):
    """``a``'s free of ``ptr`` as a SYCL host task makes it: on a thread of
    its own, without the GIL. Returns the thread's ident; fails if it hangs."""
    idents = []

    def run():
        idents.append(threading.get_ident())
        a._free_as_runtime_thread(ptr)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a free on a runtime's thread hung"
    return idents[0]


def segment_bases(a):
    return sorted(s["address"] for s in a.snapshot())


NEXT_CALLS = {
    "malloc": lambda a: a.malloc(100),
    "process_events": lambda a: a.process_events(),
    "empty_cache": lambda a: a.empty_cache(),
    "empty_cache of another stream": lambda a: a.empty_cache(stream=5),
}


@pytest.mark.parametrize("next_call", sorted(NEXT_CALLS))
def test_a_runtime_threads_free_calls_no_backend_there_and_gives_its_segment_back_at_the_next_call(next_call):
    backend, a = uncached()
    keep = a.malloc(3 * MiB)
    p = a.malloc(MiB)
    segment = segment_bases(a)
    ident = free_on_a_runtime_thread(a, p)
    assert backend.freeing_threads == [], "the runtime's thread called the backend's free (it may wait there)"
    assert a.memory_reserved() == 4 * MiB               # kept for Python's side
    result = NEXT_CALLS[next_call](a)
    assert ident not in backend.freeing_threads and len(backend.freeing_threads) == 1
    assert not a.owns(p)
    left = [s for s in a.snapshot() if s["address"] in segment]
    assert [s["address"] for s in left] == [keep], "the freed block's segment stayed reserved"
    assert a.memory_stats()["num_device_free"] == 1
    assert a.memory_allocated() == 3 * MiB + (512 if next_call == "malloc" else 0)
    a._check_invariants()
    if next_call == "malloc":
        a.free(result)
    a.free(keep)
    stats = a.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0 and stats["allocated_bytes.all.current"] == 0
    assert stats["num_device_free"] == stats["num_device_alloc"]


def test_many_runtime_thread_frees_come_back_once_each():
    """Each kept free is done once: no segment given back twice, none left."""
    backend, a = uncached()
    blocks = [a.malloc(n) for n in (512, 4096, MiB, 3 * MiB, 12 * MiB)]
    for p in blocks:
        free_on_a_runtime_thread(a, p)
    free_on_a_runtime_thread(a, blocks[0])              # a free too many: ignored, as c_free_detached ignores it
    assert backend.freeing_threads == []
    a.process_events()
    assert len(backend.freeing_threads) == len(blocks)
    assert a.memory_reserved() == 0 and a.live_allocations() == {}
    a.process_events()
    assert len(backend.freeing_threads) == len(blocks)
    a._check_invariants()


def test_a_runtime_threads_free_of_a_block_used_on_another_stream_goes_back_after_its_event():
    backend, a = uncached()
    p = a.malloc(MiB)
    a.record_stream(p, 3)
    free_on_a_runtime_thread(a, p)
    assert backend.freeing_threads == []
    a.process_events()                                   # the kept free: stream 3's event recorded
    assert not a.owns(p) and a.memory_reserved() == MiB
    backend.complete(3)
    a.process_events()
    assert a.memory_reserved() == 0 and a.memory_stats()["segment.all.current"] == 0
    a._check_invariants()


PATHS = {
    "process_events": lambda a: a.process_events(),
    "the next allocation": lambda a: a.free(a.malloc(100)),
    "empty_cache": lambda a: a.empty_cache(),
    "empty_cache of another stream": lambda a: a.empty_cache(stream=5),
    "empty_cache without waiting": lambda a: a.empty_cache(wait=False),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_blocks_whose_stream_events_completed_give_their_segments_back(path):
    """Five blocks used on another stream and freed: once the stream's work
    is done, each goes back as every free does with the cache off. The
    stream-ordered path (_handle_done) only cached them: 5 segments, 20 MiB
    reserved, 0 allocated, and nothing would ever reuse them."""
    backend, a = uncached()
    for _ in range(5):
        p = a.malloc(4 * MiB)
        a.record_stream(p, 1)
        a.free(p)
        backend.complete(1)
        PATHS[path](a)
    stats = a.memory_stats()
    assert (stats["segment.all.current"], stats["reserved_bytes.all.current"]) == (0, 0)
    assert stats["num_device_free"] == stats["num_device_alloc"]
    a._check_invariants()


def test_two_blocks_of_one_segment_whose_events_complete_together_give_it_back_once():
    """Made with the cache on (one segment), freed on other streams with it
    off: both blocks come back in one pass, and the segment goes back once."""
    backend = ThreadsFreeing()
    a = _core.CachingAllocator(backend, 0)
    p, q = a.malloc(MiB), a.malloc(MiB)
    assert len(a.snapshot()) == 1
    a.record_stream(p, 1)
    a.record_stream(q, 2)
    a.set_caching(False)
    a.free(p)
    a.free(q)
    backend.complete(1)
    backend.complete(2)
    a.process_events()
    assert len(backend.freeing_threads) == 1 and a.memory_reserved() == 0
    a._check_invariants()


def test_blocks_whose_events_complete_after_the_cache_is_on_again_stay_cached():
    backend, a = uncached()
    p = a.malloc(MiB)
    a.record_stream(p, 1)
    a.free(p)
    a.set_caching(True)
    backend.complete(1)
    a.process_events()
    assert a.memory_reserved() == MiB and backend.freeing_threads == []
    assert a.malloc(MiB) == p                            # reused, as a cached block is
    a._check_invariants()


class FreeInterrupted(SimulatedBackend):
    """A simulated device whose next free is interrupted after freeing."""

    interrupt = False

    def free(self, ptr, size, device=0, stream=0):
        super().free(ptr, size, device, stream)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt


def test_an_allocation_released_whose_segment_free_is_interrupted_stays_released():
    """Found by the misbehaving-backend machines with the cache switch: the
    Ctrl-C of the segment's free came out of the Allocation's free, which
    took it for a free not done and kept the address; the block was freed,
    and the handle's finalizer later reported it "freed behind its
    Allocation's back" (or would have freed a new owner's block)."""
    backend = FreeInterrupted()
    a = _core.CachingAllocator(backend, 0)
    a.set_caching(False)
    handle = a.allocate(1000)
    ptr = handle.ptr
    backend.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        handle.release()
    assert handle.ptr == 0 and not a.owns(ptr)
    assert a.lost_segments() == {"count": 1, "bytes": 1024}
    reports = []
    hook, sys.unraisablehook = sys.unraisablehook, reports.append
    try:
        other = a.allocate(1000)                         # may get the same address
        del handle
        assert a.owns(other.ptr)
    finally:
        sys.unraisablehook = hook
    assert reports == []
    other.release()
    a._check_invariants()
    assert a.memory_reserved() == 0
