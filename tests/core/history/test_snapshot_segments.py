"""The snapshot's segments agree with memory_stats, as PyTorch's
_check_memory_stat_consistency checks them."""
from unimem import _core
from unimem.backends.simulated import SimulatedBackend


def test_the_snapshot_counts_requested_bytes_of_blocks_waiting_on_a_stream():
    """PyTorch's _check_memory_stat_consistency sums segment requested_size."""
    backend = SimulatedBackend()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 5)
    a.free(p)
    segments = a.snapshot()
    assert sum(s["requested_size"] for s in segments) == a.memory_stats()["requested_bytes.all.current"] == 1000
    backend.complete(5)
    a.process_events()
    assert sum(s["requested_size"] for s in a.snapshot()) == 0
