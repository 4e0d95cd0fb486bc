"""record_stream and the free of a block used on other streams: the stream
is checked by the backend, an address not handed out is PyTorch's invalid
pointer, a free re-entered from ``record_event`` is refused, and a free
whose events cannot all be recorded gives back those it recorded."""
import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend


def test_record_stream_asks_the_backend_to_check_the_stream():
    class TwoStreams(SimulatedBackend):
        def check_stream(self, stream, device):
            if stream not in (0, 1):
                raise ValueError(f"no stream {stream}")

    a = _core.CachingAllocator(TwoStreams(), 0)
    p = a.malloc(100)
    with pytest.raises(ValueError, match="no stream 1000000"):
        a.record_stream(p, 1000000)
    a.free(p)                                          # still freeable
    assert a.memory_stats()["active.all.current"] == 0


def test_record_stream_of_an_address_not_handed_out_is_torchs_invalid_pointer_error():
    """A plain ValueError, where freeing the same address raises
    InvalidPointerError (PyTorch: RuntimeError, "No allocated block can be found")."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    for bad in (p + 512, p + (1 << 30)):
        with pytest.raises(_core.InvalidPointerError, match="not a live allocation"):
            a.record_stream(bad, 7)
    assert a.memory_stats() == before
    a.free(p)


def test_a_free_reentered_from_record_event_is_refused_and_counts_stay_right():
    allocator_box = []

    class Reentrant(SimulatedBackend):
        def record_event(self, stream, device):
            allocator, ptr = allocator_box
            with pytest.raises(ValueError, match="already freed"):
                allocator.free(ptr)                   # as a finalizer would, mid-free
            return super().record_event(stream, device)

    backend = Reentrant()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 7)
    allocator_box[:] = [a, p]
    a.free(p)
    s = a.memory_stats()
    assert s["allocation.all.current"] == 0 and s["active.all.current"] == 1   # waits on stream 7
    backend.complete(7)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


def test_a_failed_event_recording_gives_back_the_events_already_recorded():
    """In the core (unimem.cuda's side: tests/front/test_cuda_streams.py): the
    first stream's event leaked when the second failed."""
    released = []

    class SecondEventFails(SimulatedBackend):
        def record_event(self, stream, device):
            if stream == 9:
                raise RuntimeError("event failed")
            return super().record_event(stream, device)

        def release_event(self, event):
            released.append(event)

    a = _core.CachingAllocator(SecondEventFails(), 0)
    p = a.malloc(1000)
    a.record_stream(p, 8)
    a.record_stream(p, 9)
    with pytest.raises(RuntimeError, match="event failed"):
        a.free(p)
    assert len(released) == 1
    assert a.owns(p) and a.memory_stats()["allocation.all.current"] == 1
    a._check_invariants()
