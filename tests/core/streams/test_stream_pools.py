"""The pools of each stream: empty_cache drops those of the streams that
hold no memory any more and tells the backend (``release_stream``), so that
a program using a stream per task keeps no pool per stream ever seen."""
import pytest

from unimem import OutOfMemoryError, _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def test_pools_of_streams_without_memory_are_dropped_and_the_backend_told():
    released = []

    class Telling(SimulatedBackend):
        def release_stream(self, stream, device):
            released.append(stream)

    a = _core.CachingAllocator(Telling(), 0)
    a.free(a.malloc(4096))                             # the default stream (0)
    for stream in range(1, 2001):
        a.free(a.malloc(4096, stream))
    a.empty_cache()
    assert a._stream_count() == 1                      # the default stream's pools stay
    assert sorted(released) == list(range(1, 2001))
    a._check_invariants()
    p = a.malloc(4096, 5)                              # a dropped stream comes back fine
    a.free(p)
    a._check_invariants()


def test_a_failed_allocation_leaves_no_pool_behind_after_empty_cache():
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 * MiB), 0)
    a.set_capacity(64 * MiB)
    for stream in range(1, 50):
        with pytest.raises(OutOfMemoryError):
            a.malloc(100 * MiB, stream)
    a.empty_cache()
    assert a._stream_count() == 0
