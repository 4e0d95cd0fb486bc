"""Expandable segments (``expandable_segments:True``): targeted regressions.

The model test (test_core_model.py) compares every step with a model of
PyTorch's policy; these pin single behaviours by name, so that a change that
breaks one says which.
"""
import pytest

from unimem import OutOfMemoryError, _core
from unimem._runtime import devices as _devices
from unimem.backends.faults import FaultInjectingBackend, InjectedFault
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
CAPACITY = 256 * MiB


def expandable(backend=None, **options):
    backend = backend if backend is not None else SimulatedBackend(capacity=CAPACITY)
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True, **options)
    allocator.set_capacity(CAPACITY)
    return allocator


def simulated(allocator):
    backend = allocator.backend
    return backend.inner if isinstance(backend, FaultInjectingBackend) else backend


def assert_exact(allocator):
    """reserved_bytes is the mapped memory, and the counters are the calls."""
    backend = simulated(allocator)
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == backend.held() == allocator.memory_reserved()
    assert stats["num_device_alloc"] == backend.n_map
    assert stats["num_device_free"] == backend.n_unmap
    assert stats["segment.all.current"] == 0            # PyTorch counts no expandable segment
    assert stats["inactive_split.all.current"] == 0     # nor expandable blocks in inactive_split
    allocator._check_invariants()


def test_one_range_grows_by_pages_and_reserved_counts_mapped_bytes():
    a = expandable()
    first = a.malloc(3 * MiB)
    second = a.malloc(5 * MiB)
    assert second == first + 3 * MiB                 # the same range, right after
    assert a.memory_reserved() == 8 * MiB            # 2 MiB pages: 4 MiB, then 4 more
    assert a.memory_stats()["num_device_alloc"] == 2
    assert a.reserved_address_space() == {"ranges": 1, "bytes": CAPACITY + CAPACITY // 8}
    assert_exact(a)


def test_each_stream_and_pool_has_its_own_range():
    a = expandable()
    a.malloc(4 * MiB)
    a.malloc(4096)              # small pool
    a.malloc(4 * MiB, 7)        # another stream
    assert a.reserved_address_space()["ranges"] == 3
    assert_exact(a)


def test_empty_cache_unmaps_free_pages_in_the_middle():
    a = expandable()
    left = a.malloc(4 * MiB)
    middle = a.malloc(8 * MiB)
    right = a.malloc(4 * MiB)
    a.free(middle)
    a.empty_cache()
    assert a.memory_reserved() == 8 * MiB
    pages = simulated(a).mapped_pages[0]
    assert not any(middle <= p < middle + 8 * MiB for p in pages)
    assert all(p in pages for p in (left, right))
    # The hole is mapped again for a request that fits it, at the same place.
    assert a.malloc(8 * MiB) == middle
    assert a.memory_reserved() == 16 * MiB
    assert_exact(a)
    for p in (left, right):
        a.free(p)


def test_empty_cache_keeps_the_partial_pages_of_a_free_block_mapped():
    a = expandable()
    live = a.malloc(3 * MiB)          # pages 0-1: the 1 MiB after it is free, page 1 shared
    a.empty_cache()
    assert a.memory_reserved() == 4 * MiB
    a.free(live)
    a.empty_cache()
    assert a.memory_reserved() == 0 and simulated(a).held() == 0
    assert_exact(a)


def test_empty_virt_addr_cache_releases_only_ranges_without_mapped_pages():
    a = expandable()
    kept = a.malloc(4 * MiB)
    gone = a.malloc(4 * MiB, 7)
    a.free(gone)
    a.empty_virt_addr_cache()                    # stream 7's pages are still mapped
    assert a.reserved_address_space()["ranges"] == 2
    a.empty_cache()
    a.empty_virt_addr_cache()
    assert a.reserved_address_space()["ranges"] == 1
    assert list(simulated(a).ranges[0]) == [kept - kept % (2 * MiB)]
    assert a._stream_count() == 1                # stream 7 is forgotten with its range
    assert_exact(a)


def test_snapshot_marks_expandable_segments_one_per_mapped_run():
    a = expandable()
    left = a.malloc(4 * MiB)
    middle = a.malloc(4 * MiB)
    a.malloc(4 * MiB)
    a.free(middle)
    a.empty_cache()
    segments = a.snapshot()
    assert [s["is_expandable"] for s in segments] == [True, True]
    assert [(s["address"], s["total_size"]) for s in segments] == [(left, 4 * MiB), (middle + 4 * MiB, 4 * MiB)]
    assert all(s["segment_type"] == "large" for s in segments)
    assert expandable().snapshot() == []
    fixed = _core.CachingAllocator(SimulatedBackend(), 0)
    fixed.malloc(1)
    assert [s["is_expandable"] for s in fixed.snapshot()] == [False]


def test_best_fit_keeps_the_growing_end_for_requests_that_need_it():
    """PyTorch's get_free_block: a free block followed by unmapped space
    counts as what it can grow to, so a larger block that cannot grow is
    taken first."""
    a = expandable()
    a.malloc(2 * MiB)
    hole = a.malloc(6 * MiB)
    a.malloc(2 * MiB)
    tail = a.malloc(4 * MiB)
    a.free(hole)
    a.free(tail)                      # best fit by size alone would be the tail (4 MiB)
    assert a.malloc(3 * MiB) == hole
    assert_exact(a)


@pytest.mark.parametrize("expandable_segments", [True, False])
def test_expandable_blocks_split_like_the_small_pool(expandable_segments):
    """PyTorch's should_split: with expandable segments a large block is
    split whenever 512 bytes remain; otherwise only when more than 1 MiB does."""
    a = _core.CachingAllocator(SimulatedBackend(capacity=CAPACITY), 0, expandable_segments=expandable_segments)
    big = a.malloc(30 * MiB)
    a.free(big)
    assert a.malloc(30 * MiB - 512 * 1024) == big
    assert a.memory_allocated() == (30 * MiB - 512 * 1024 if expandable_segments else 30 * MiB)
    a._check_invariants()


def test_out_of_memory_while_mapping_is_retried_after_unmapping_the_cache():
    faults = FaultInjectingBackend(SimulatedBackend(capacity=CAPACITY))
    a = expandable(faults)
    cached = a.malloc(64 * MiB)
    a.free(cached)
    before = a.memory_stats()
    faults.refuse_next(1)
    a.malloc(100 * MiB)               # refused once, then served after the retry
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert stats["num_ooms"] == 0
    assert_exact(a)


def test_out_of_memory_while_mapping_leaves_statistics_exact():
    faults = FaultInjectingBackend(SimulatedBackend(capacity=CAPACITY))
    a = expandable(faults)
    live = a.malloc(8 * MiB)
    faults.refuse_next(2)
    with pytest.raises(OutOfMemoryError):
        a.malloc(100 * MiB)
    assert a.memory_stats()["num_ooms"] == 1
    assert a.memory_allocated() == 8 * MiB
    assert_exact(a)
    a.free(live)


def test_the_device_filling_up_while_mapping_is_out_of_memory():
    a = expandable()
    live = [a.malloc(100 * MiB), a.malloc(100 * MiB)]
    with pytest.raises(OutOfMemoryError):
        a.malloc(100 * MiB)
    assert a.memory_reserved() == 200 * MiB
    assert_exact(a)
    a.free(live[0])
    assert a.malloc(100 * MiB) == live[0]


@pytest.mark.parametrize("request_size", [1 << 40, 3 << 40])
def test_a_request_no_range_can_hold_gives_its_address_space_back(request_size):
    """Without a known capacity a range is 64 GiB, or the request's size when
    larger: an impossible request must not leave its (unmapped) range behind."""
    backend = SimulatedBackend(capacity=CAPACITY)
    a = _core.CachingAllocator(backend, 0, expandable_segments=True)    # capacity unknown
    live = a.malloc(4 * MiB)
    address_space = a.reserved_address_space()
    ranges = dict(backend.ranges[0])
    for _ in range(2):
        with pytest.raises(OutOfMemoryError):
            a.malloc(request_size)
    assert a.reserved_address_space() == address_space
    assert backend.ranges[0] == ranges
    assert a.memory_stats()["num_ooms"] == 2
    assert_exact(a)
    a.free(live)


def test_a_failed_unmap_loses_the_pages_and_the_error_is_raised():
    class FailingUnmap(SimulatedBackend):
        def unmap_pages(self, address, size, device):
            raise InjectedFault("the driver refused")

    a = expandable(FailingUnmap(capacity=CAPACITY))
    p = a.malloc(4 * MiB)
    a.free(p)
    with pytest.raises(InjectedFault):
        a.empty_cache()
    assert a.lost_segments() == {"count": 1, "bytes": 4 * MiB}
    assert a.memory_reserved() == 0
    a._check_invariants()
    assert a.malloc(4 * MiB) != p          # lost addresses are never handed out again
    a.empty_virt_addr_cache()              # the range with a lost span stays reserved
    assert a.reserved_address_space()["ranges"] == 1


def test_the_history_records_maps_and_unmaps():
    a = expandable()
    events = []
    a.set_trace_hook(events.extend)
    p = a.malloc(3 * MiB)
    a.free(p)
    a.empty_cache()
    actions = [e[0] for e in events]
    assert actions == ["segment_map", "alloc", "free_requested", "free_completed", "segment_unmap"]
    assert events[0][2] == 4 * MiB


def test_a_backend_without_virtual_memory_refuses_the_option_by_name():
    with pytest.raises(NotImplementedError, match=r"the SIM backend \(SimulatedBackend\) cannot"):
        _core.CachingAllocator(SimulatedBackend(granularity=0), 0, expandable_segments=True)

    class Plain:
        name = "PLAIN"

        def malloc(self, size, device, stream):
            return 0

        def free(self, ptr, size, device, stream):
            pass

    with pytest.raises(NotImplementedError, match="PLAIN backend"):
        _core.CachingAllocator(Plain(), 0, expandable_segments=True)

    class SaysWhy(SimulatedBackend):
        def virtual_memory_granularity(self, device):
            raise NotImplementedError("no virtual-memory aspect on this device")

    with pytest.raises(NotImplementedError, match="no virtual-memory aspect"):
        _core.CachingAllocator(SaysWhy(), 0, expandable_segments=True)


@pytest.mark.parametrize("granularity, error", [(3 << 20, ValueError), (-4096, ValueError),
                                                (4096.0, TypeError), ("4096", TypeError)])
def test_a_bad_granularity_is_refused(granularity, error):
    class Odd(SimulatedBackend):
        def virtual_memory_granularity(self, device):
            return granularity

    with pytest.raises(error):
        _core.CachingAllocator(Odd(), 0, expandable_segments=True)


def test_a_refused_construction_leaves_the_allocator_uninitialized():
    a = _core.CachingAllocator.__new__(_core.CachingAllocator)
    with pytest.raises(NotImplementedError):
        a.__init__(SimulatedBackend(granularity=0), 0, expandable_segments=True)
    with pytest.raises(ValueError, match="exclude each other"):
        a.__init__(SimulatedBackend(), 0, expandable_segments=True, exact_segments=True)
    a.__init__(SimulatedBackend(), 0)               # and can still be made whole
    assert a.settings["expandable_segments"] is False
    a.malloc(1)
    assert a.snapshot()[0]["is_expandable"] is False


def test_the_environment_option_reaches_a_new_allocator(monkeypatch):
    monkeypatch.setenv("UNIMEM_ALLOC_CONF", "expandable_segments:True")
    a = _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], SimulatedBackend(), 0)
    assert a.settings["expandable_segments"] is True
    with pytest.raises(NotImplementedError, match="cannot"):
        _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], SimulatedBackend(granularity=0), 0)
    monkeypatch.setenv("UNIMEM_ALLOC_CONF", "expandable_segments:yes")
    with pytest.raises(ValueError, match="True or False"):
        _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], SimulatedBackend(), 0)


def test_empty_virt_addr_cache_without_expandable_segments_does_nothing():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(1)
    a.free(p)
    a.empty_virt_addr_cache()
    assert a.memory_reserved() == 2 * MiB and a.reserved_address_space() == {"ranges": 0, "bytes": 0}


def test_a_dying_allocator_unmaps_and_releases_its_free_ranges():
    backend = SimulatedBackend(capacity=CAPACITY)
    a = expandable(backend)
    a.free(a.malloc(6 * MiB))
    a.malloc(1, 7)                    # a live block: its range stays
    del a
    assert len(backend.ranges[0]) == 1 and backend.held() == 2 * MiB


# What an out-of-memory miss counts (PyTorch's retry synchronizes and counts it).
COUNTED_ON_OOM = ("num_ooms", "num_alloc_retries", "num_sync_all_streams")


@pytest.mark.parametrize("options", [{}, {"max_reserved_ratio": 1.1}])
def test_a_byte_limit_serves_what_fits_on_a_backend_with_small_pages(options):
    """CuPy's set_limit: a request under the limit is served even where the
    range maps by 2 MiB, when the backend can map its own 4 KiB pages; the
    pages mapped that way go back whole with empty_cache (PyTorch's policy
    unmaps by 2 MiB, which would have kept the last piece mapped)."""
    backend = SimulatedBackend(capacity=CAPACITY, granularity=4096)
    a = expandable(backend, **options)
    a.set_memory_limit(5 * MiB)
    p = a.malloc(5 * MiB - 100)                     # 5 MiB once rounded
    assert a.memory_reserved() == 5 * MiB
    assert_exact(a)
    before = a.memory_stats()
    with pytest.raises(OutOfMemoryError):
        a.malloc(4096)                              # nothing left under the limit
    after = a.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert {k: v for k, v in after.items() if k not in COUNTED_ON_OOM} == \
        {k: v for k, v in before.items() if k not in COUNTED_ON_OOM}
    a.free(p)
    a.set_memory_limit(6 * MiB + MiB // 2)
    q = a.malloc(6 * MiB)                           # the free 5 MiB and 1 MiB mapped after it
    assert q == p and a.memory_reserved() == 6 * MiB
    assert_exact(a)
    a.free(q)
    a.empty_cache()
    assert a.memory_reserved() == 0 and backend.held() == 0
    assert_exact(a)


def test_a_byte_limit_does_not_map_below_the_devices_own_page():
    """On 2 MiB pages (CUDA's granularity) nothing smaller can be mapped:
    the same request is out of memory, and nothing changes."""
    a = expandable()
    a.set_memory_limit(5 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(5 * MiB - 100)
    assert a.memory_reserved() == 0
    assert_exact(a)


def test_pytorchs_fraction_keeps_the_ranges_pages_on_a_backend_with_small_pages():
    backend = SimulatedBackend(capacity=CAPACITY, granularity=4096)
    a = expandable(backend)
    a.set_memory_fraction(5 * MiB / CAPACITY)
    with pytest.raises(OutOfMemoryError):
        a.malloc(5 * MiB - 100)                     # 6 MiB of 2 MiB pages
    assert a.memory_reserved() == 0
    assert_exact(a)


def test_a_refused_fine_map_leaves_the_range_unmapping_by_its_own_page():
    """The segment was marked as finely mapped before the map was tried: a
    refused attempt switched it to unmapping by 4 KiB for good, and a later
    empty_cache kept part of a 2 MiB page mapped."""
    backend = SimulatedBackend(capacity=8 * MiB, granularity=4096)
    a = _core.CachingAllocator(backend, 0, expandable_segments=True)
    a.set_capacity(8 * MiB)
    first = a.malloc(MiB + MiB // 2)                  # [0, 2 MiB) mapped
    a.set_memory_limit(5 * MiB)
    hog = backend.malloc(5 * MiB)                     # the device is nearly full
    with pytest.raises(OutOfMemoryError):
        a.malloc(3 * MiB - 100)                       # the 4 KiB map is tried and refused
    backend.free(hog, 5 * MiB)
    a.set_memory_limit(0)
    a.free(a.malloc(3 * MiB))
    a.empty_cache()
    assert a.memory_reserved() == 2 * MiB             # the first block's whole page only
    assert_exact(a)
    a.free(first)
