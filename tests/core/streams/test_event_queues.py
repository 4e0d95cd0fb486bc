"""Stream events wait in one queue per stream, in the order recorded
(_core_event_queue.pxi): work on a stream completes in order, so an
allocation asks the backend about each stream's oldest events only, up to
the first that is not done (PyTorch's process_events does the same). Before,
every malloc asked about every pending event: 1,000 record_stream frees on a
stream that ran behind made each allocation ask 1,000 times."""
import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.stream_events import free_after_use

KiB = 1 << 10


class CountingBackend(SimulatedBackend):
    """Counts event_done calls; an event answered done once must never be
    asked about again (a CUDA event is destroyed by that answer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.queries = 0
        self.answered_done = set()

    def event_done(self, event):
        assert id(event) not in self.answered_done, f"{event} asked about after it was done"
        self.queries += 1
        done = super().event_done(event)
        if done:
            self.answered_done.add(id(event))
        return done


def free_on(a, stream, n, size=4 * KiB):
    """``n`` new blocks used on ``stream`` and freed."""
    blocks = [a.malloc(size) for _ in range(n)]
    free_after_use(a, blocks, stream)
    return blocks


def test_an_allocation_asks_about_one_event_per_stream_however_many_are_pending():
    backend = CountingBackend()
    a = _core.CachingAllocator(backend, 0)
    free_on(a, 7, 200)
    free_on(a, 9, 50)
    assert a.memory_allocated() == 0 and a.memory_stats()["active.all.current"] == 250
    backend.queries = 0
    for _ in range(10):
        a.free(a.malloc(1 << 20))
    assert backend.queries == 10 * 2            # streams 7 and 9: their oldest event each
    a._check_invariants()


def test_a_stream_that_completes_gives_back_all_its_blocks_at_the_next_allocation():
    backend = CountingBackend()
    a = _core.CachingAllocator(backend, 0)
    blocks = free_on(a, 7, 100)
    free_on(a, 9, 30)
    backend.complete(7)
    a.free(a.malloc(1 << 20))
    stats = a.memory_stats()
    assert stats["active.all.current"] == 30    # stream 9's blocks still wait
    assert a.malloc(4 * KiB) in blocks          # stream 7's are back in the pool
    backend.complete(9)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 1
    a._check_invariants()


def test_events_recorded_after_a_stream_completed_wait_behind_none_of_the_done_ones():
    backend = CountingBackend()
    a = _core.CachingAllocator(backend, 0)
    first = [a.malloc(4 * KiB) for _ in range(3)]
    second = [a.malloc(4 * KiB) for _ in range(2)]
    free_after_use(a, first, 7)
    backend.complete(7)                         # the first three are done ...
    free_after_use(a, second, 7)                # ... these two are not
    backend.queries = 0
    a.process_events()
    assert backend.queries == 4                 # three done, then the first not done
    assert a.memory_stats()["active.all.current"] == 2
    backend.complete(7)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


class OutOfOrderBackend(SimulatedBackend):
    """A backend breaking the in-order promise: the events it lists are done
    whatever their stream's order."""

    def __init__(self):
        super().__init__()
        self.done_events = set()

    def event_done(self, event):
        return event.sequence in self.done_events


def test_an_event_done_out_of_order_only_delays_its_block_never_frees_it_early():
    backend = OutOfOrderBackend()
    a = _core.CachingAllocator(backend, 0)
    older, newer = free_on(a, 7, 2)
    backend.done_events.add(2)                  # the newer event only
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 2    # waits behind the older one
    backend.done_events.add(1)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


def test_empty_cache_waits_for_every_stream_and_asks_about_no_event_afterwards():
    backend = CountingBackend()
    a = _core.CachingAllocator(backend, 0)
    free_on(a, 7, 20)
    free_on(a, 9, 5)
    a.empty_cache()
    assert a.memory_stats()["active.all.current"] == 0 and a.memory_reserved() == 0
    backend.queries = 0
    a.free(a.malloc(4 * KiB))
    assert backend.queries == 0                 # nothing pending: the fast path
    a._check_invariants()


def test_a_query_error_keeps_the_events_not_asked_about_and_frees_those_found_done():
    backend = CountingBackend()
    a = _core.CachingAllocator(backend, 0)
    free_on(a, 7, 4)
    backend.complete(7)
    query = backend.event_done
    calls = []

    def failing_third(event):
        calls.append(event)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return query(event)

    backend.event_done = failing_third
    with pytest.raises(RuntimeError, match="device lost"):
        a.process_events()
    assert a.memory_stats()["active.all.current"] == 2    # the two found done came back
    backend.event_done = query
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


class FreesOnANewStreamInAQuery(SimulatedBackend):
    """While asked about an event, frees a block used on another stream (a
    finalizer run by the query would): its event opens a new stream's queue
    while the queues are being walked."""

    def __init__(self):
        super().__init__()
        self.allocator = None
        self.block = None

    def event_done(self, event):
        if self.block is not None:
            block, self.block = self.block, None
            self.allocator.record_stream(block, 11)
            self.allocator.free(block)
        return super().event_done(event)


def test_an_event_queued_on_a_new_stream_during_a_query_waits_for_its_stream():
    backend = FreesOnANewStreamInAQuery()
    a = _core.CachingAllocator(backend, 0)
    backend.allocator = a
    free_on(a, 7, 2)
    backend.block = a.malloc(8 * KiB)
    backend.complete(7)
    a.free(a.malloc(1 << 20))                   # no "dictionary changed size during iteration"
    assert a.memory_stats()["active.all.current"] == 1     # the block freed in the query waits
    backend.complete(11)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()
