"""The cache of abandoned streams goes back at the next new stream.

A backend may say which of the streams the allocator caches memory for
nobody can allocate on any more (``abandoned_streams``: the XPU backend
names SYCL queues that only unimem's tables hold and whose work is done).
The core asks once per new stream, at that stream's first miss, and gives
back those streams' wholly free segments, as ``empty_cache(stream=...)``
would. Before, a queue per task left a segment a task reserved until
``empty_cache()`` or out-of-memory."""
import gc
import sys

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.minimal_backend import MinimalBackend

MiB = 1 << 20


class Abandoning(SimulatedBackend):
    """A simulated device whose abandoned streams the test names."""

    def __init__(self):
        super().__init__()
        self.abandoned = set()
        self.asked = []             # the candidates of each call
        self.released = []
        self.on_ask = None          # called inside abandoned_streams (re-entry)
        self.ask_raises = None

    def abandoned_streams(self, streams, device):
        self.asked.append(sorted(streams))
        if self.on_ask is not None:
            callback, self.on_ask = self.on_ask, None
            callback()
        if self.ask_raises is not None:
            raise self.ask_raises
        return [s for s in streams if s in self.abandoned]

    def release_stream(self, stream, device):
        self.released.append(stream)


def cached_on(allocator, *streams):
    """A 2 MiB segment cached (free) on each stream."""
    for stream in streams:
        allocator.free(allocator.malloc(MiB, stream))


def segments_by_stream(allocator):
    found = {}
    for seg in allocator.snapshot():
        found[seg["stream"]] = found.get(seg["stream"], 0) + seg["total_size"]
    return found


def test_a_new_streams_first_miss_gives_back_the_cache_of_abandoned_streams():
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    cached_on(a, 0, 1, 2)
    backend.abandoned = {1}
    frees = a.memory_stats()["num_device_free"]
    p = a.malloc(MiB, 3)                        # stream 3 is new: its first miss asks
    assert backend.asked[-1] == [1, 2], "asked about the streams with segments, not 0 nor the new one"
    assert segments_by_stream(a) == {0: 2 * MiB, 2: 2 * MiB, 3: 2 * MiB}
    assert a.memory_stats()["num_device_free"] == frees + 1
    assert backend.released == [1], "the stream given back is released to the backend"
    a.free(p)
    a._check_invariants()


def test_only_the_first_miss_of_a_new_stream_asks():
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    cached_on(a, 1)
    assert backend.asked == [], "stream 1's first miss had no other stream to ask about"
    p = a.malloc(MiB, 2)
    assert backend.asked == [[1]]
    q = a.malloc(4 * MiB, 2)                    # a miss of a known stream
    r = a.malloc(MiB, 1)                        # a hit
    assert backend.asked == [[1]]
    for ptr in (p, q, r):
        a.free(ptr)


def test_a_segment_in_use_on_an_abandoned_stream_stays():
    """What the backend says is only a hint: live memory is never given back."""
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    live = a.malloc(MiB, 1)
    a.malloc(MiB, 1)
    backend.abandoned = {1, 7, 12345}            # names the core does not hold are ignored
    p = a.malloc(MiB, 2)
    assert segments_by_stream(a) == {1: 2 * MiB, 2: 2 * MiB}
    assert backend.released == []
    a.free(live)
    a.free(p)
    a._check_invariants()


def test_a_stream_is_named_only_when_all_its_memory_can_go_back():
    """The backend may stop waiting on the streams it names (the XPU backend's
    frees then skip the queue wait): a stream with a segment in use, a private
    pool's segment or a block record_stream named it on is not even asked
    about, so that a named stream always leaves the allocator whole."""
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    live = a.malloc(MiB, 1)
    a.free(a.malloc(8 * MiB, 1))                # stream 1: a free segment beside one in use
    named_on = a.malloc(MiB, 0)
    a.record_stream(named_on, 2)                # stream 2: named by a live block of stream 0
    cached_on(a, 3)                             # stream 3: wholly free
    backend.abandoned = {1, 2, 3}
    p = a.malloc(MiB, 4)
    assert backend.asked[-1] == [3]
    assert 1 in segments_by_stream(a) and sum(s["stream"] == 1 for s in a.snapshot()) == 2
    for ptr in (live, named_on, p):
        a.free(ptr)
    a._check_invariants()


def test_a_block_waiting_for_another_streams_work_stays_cached():
    """A block used on another stream (record_stream) whose event is not done
    keeps its segment, as empty_cache(wait=False) does."""
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(MiB, 1)
    a.record_stream(p, 5)
    a.free(p)                                   # pending: stream 5's work
    backend.abandoned = {1}
    q = a.malloc(MiB, 2)
    assert 1 in segments_by_stream(a)
    backend.complete(5)
    r = a.malloc(MiB, 3)                        # the next new stream: the event is done now
    assert 1 not in segments_by_stream(a)
    a.free(q)
    a.free(r)
    a._check_invariants()


@pytest.mark.parametrize("error", [RuntimeError("the runtime is gone"), TypeError("unhashable"), None])
def test_a_backend_that_fails_to_answer_changes_nothing(error):
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    cached_on(a, 1)
    stats = a.memory_stats()
    if error is None:
        backend.abandoned_streams = lambda streams, device: [[1]]       # an unhashable answer
    else:
        backend.ask_raises = error
    reports = []
    hook, sys.unraisablehook = sys.unraisablehook, reports.append
    try:
        p = a.malloc(MiB, 2)                    # the allocation itself succeeds
    finally:
        sys.unraisablehook = hook
    assert len(reports) == 1 and "abandoned streams" in str(reports[0].object)
    assert segments_by_stream(a) == {1: 2 * MiB, 2: 2 * MiB}
    assert a.memory_stats()["num_device_free"] == stats["num_device_free"]
    a.free(p)
    a._check_invariants()


def test_a_ctrl_c_while_asking_gives_the_new_block_back():
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    cached_on(a, 1)
    backend.ask_raises = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        a.malloc(MiB, 2)
    assert a.memory_allocated() == 0, "the block the caller never saw is still allocated"
    a._check_invariants()


def test_the_allocator_re_entered_while_asking():
    """abandoned_streams is Python: a garbage collection there may run a
    finalizer that allocates and frees on this allocator, on the abandoned
    stream too."""
    backend = Abandoning()
    a = _core.CachingAllocator(backend, 0)
    cached_on(a, 1)
    backend.abandoned = {1}
    kept = []

    def re_enter():
        kept.append(a.malloc(MiB, 1))           # takes stream 1's cached block
        a.free(a.malloc(3 * MiB, 4))
        gc.collect()
    backend.on_ask = re_enter
    p = a.malloc(MiB, 2)
    assert 1 in segments_by_stream(a), "a segment in use again was given back"
    a.free(kept[0])
    a.free(p)
    a._check_invariants()
    a.empty_cache()
    assert a.memory_reserved() == 0


@pytest.mark.parametrize("backend", [SimulatedBackend, MinimalBackend])
def test_a_backend_that_names_no_stream_keeps_pytorchs_behaviour(backend):
    """CUDA streams (the protocol's default answers none) and a backend
    without the member: the cache of a stream stays until empty_cache."""
    a = _core.CachingAllocator(backend(), 0)
    cached_on(a, 1)
    p = a.malloc(MiB, 2)
    assert segments_by_stream(a) == {1: 2 * MiB, 2: 2 * MiB}
    a.free(p)
