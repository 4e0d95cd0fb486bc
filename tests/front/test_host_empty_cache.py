"""The pinned host pool's empty_cache does not wait for the device
(PyTorch's CachingHostAllocator queries its events and frees what is done);
the device pools' empty_cache still waits, as PyTorch's emptyCache does."""
import pytest

import unimem
from unimem import _core, host
from unimem._runtime.registry import DeviceRegistry
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def freed_while_stream_7_runs(allocator):
    """A block used on stream 7 (record_stream), then freed: its event is pending."""
    p = allocator.malloc(MiB)
    allocator.record_stream(p, 7)
    allocator.free(p)
    return p


def test_empty_cache_without_waiting_keeps_what_the_device_still_uses():
    backend = SimulatedBackend()
    allocator = _core.CachingAllocator(backend, 0)
    freed_while_stream_7_runs(allocator)
    reserved = allocator.memory_reserved()
    allocator.empty_cache(wait=False)
    assert allocator.memory_reserved() == reserved
    assert not backend.event_done(backend.record_event(7, 0))      # nothing waited for stream 7
    backend.complete(7)
    allocator.empty_cache(wait=False)
    assert allocator.memory_reserved() == 0
    allocator._check_invariants()


def test_empty_cache_of_a_device_pool_still_waits():
    backend = SimulatedBackend()
    allocator = _core.CachingAllocator(backend, 0)
    freed_while_stream_7_runs(allocator)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0


def test_empty_cache_refuses_a_wait_that_is_not_a_bool():
    allocator = _core.CachingAllocator(SimulatedBackend(), 0)
    freed_while_stream_7_runs(allocator)
    before = allocator.memory_stats()
    with pytest.raises(TypeError, match="wait must be a bool"):
        allocator.empty_cache(wait="no")
    assert allocator.memory_stats() == before


def test_empty_host_cache_does_not_wait_for_the_device(monkeypatch):
    """It waited (1 to 1.7 s on a busy SYCL queue) for the queue's work."""
    backend = SimulatedBackend()
    registry = DeviceRegistry("host", 1, lambda index: _core.CachingAllocator(backend, index))
    monkeypatch.setattr(host, "_registry", registry)
    allocator = host.caching_allocator()
    freed_while_stream_7_runs(allocator)
    unimem.host.empty_host_cache()
    assert allocator.memory_reserved() == MiB * 2          # the 2 MiB small segment stays
    backend.complete(7)
    unimem.host.empty_host_cache()
    assert allocator.memory_reserved() == 0


def test_a_block_stays_an_active_request_until_its_stream_work_is_done(monkeypatch):
    """PyTorch: active_requests "decrements when the block becomes reusable
    after stream deps finish"; it fell at the free."""
    backend = SimulatedBackend()
    registry = DeviceRegistry("host", 1, lambda index: _core.CachingAllocator(backend, index))
    monkeypatch.setattr(host, "_registry", registry)
    allocator = host.caching_allocator()
    p = allocator.malloc(MiB)
    allocator.record_stream(p, 7)
    allocator.free(p)
    stats = unimem.host_memory_stats()
    assert stats["active_requests.current"] == 1 and stats["active_bytes.current"] == MiB
    assert stats["allocated.current"] == 0                # no longer held by the caller
    backend.complete(7)
    allocator.process_events()
    stats = unimem.host_memory_stats()
    assert stats["active_requests.current"] == 0 and stats["active_bytes.current"] == 0
    assert stats["active_requests.freed"] == 1
