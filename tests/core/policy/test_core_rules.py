"""The documented allocation rules, checked statistic by statistic."""
import pytest

from unimem import OutOfMemoryError, _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def stats(a):
    return a.memory_stats()


def test_one_byte_takes_512_bytes_of_a_2mib_small_segment(make_sim):
    a, backend = make_sim()
    p = a.malloc(1)
    s = stats(a)
    assert s["allocated_bytes.all.current"] == 512
    assert s["allocated_bytes.small_pool.current"] == 512
    assert s["requested_bytes.all.current"] == 1
    assert s["segment.small_pool.current"] == 1 and s["segment.large_pool.current"] == 0
    assert s["reserved_bytes.all.current"] == 2 * MiB
    # the rest of the segment is an inactive split block
    assert s["inactive_split.small_pool.current"] == 1
    assert s["inactive_split_bytes.small_pool.current"] == 2 * MiB - 512
    assert s["allocation.all.current"] == s["allocated.all.current"] == 1
    a.free(p)
    s = stats(a)
    assert s["allocated_bytes.all.current"] == 0 and s["inactive_split.all.current"] == 0
    assert s["reserved_bytes.all.current"] == 2 * MiB     # cached, not returned
    a._check_invariants()


def test_size_zero_is_a_null_pointer_and_changes_nothing(make_sim):
    a, backend = make_sim()
    assert a.malloc(0) == 0
    assert stats(a)["allocation.all.allocated"] == 0 and backend.n_malloc == 0
    a.free(0)  # freeing null is a no-op, as in PyTorch


def test_three_mib_takes_a_20mib_large_segment(make_sim):
    a, _ = make_sim()
    a.malloc(3 * MiB)
    s = stats(a)
    assert s["segment.large_pool.current"] == 1
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["allocated_bytes.large_pool.current"] == 3 * MiB
    assert s["inactive_split_bytes.large_pool.current"] == 17 * MiB
    a._check_invariants()


def test_twelve_mib_takes_a_12mib_segment_without_split(make_sim):
    a, _ = make_sim()
    a.malloc(12 * MiB)
    s = stats(a)
    assert s["reserved_bytes.large_pool.current"] == 12 * MiB
    assert s["inactive_split.all.current"] == 0


def test_large_segments_round_up_to_2mib(make_sim):
    a, _ = make_sim()
    a.malloc(11 * MiB + 1)
    assert stats(a)["reserved_bytes.all.current"] == 12 * MiB


def test_exactly_one_mib_is_small_and_one_more_block_is_large(make_sim):
    a, _ = make_sim()
    a.malloc(MiB)
    a.malloc(MiB + 1)
    s = stats(a)
    assert s["allocated_bytes.small_pool.current"] == MiB
    assert s["allocated_bytes.large_pool.current"] == MiB + 512


def test_large_split_only_when_more_than_1mib_remains(make_sim):
    a, _ = make_sim()
    # 19 MiB + 512 from a 20 MiB segment leaves 1 MiB - 512: not split
    p = a.malloc(19 * MiB + 512)
    s = stats(a)
    assert s["inactive_split.all.current"] == 0
    assert s["allocated_bytes.all.current"] == 20 * MiB
    assert s["requested_bytes.all.current"] == 19 * MiB + 512
    a.free(p)
    # 18 MiB leaves 2 MiB > 1 MiB: split
    a.malloc(18 * MiB)
    assert stats(a)["inactive_split_bytes.large_pool.current"] == 2 * MiB


def test_best_fit_takes_the_smallest_then_the_lowest_address(make_sim):
    a, _ = make_sim()
    # three 40 KiB blocks separated by live ones, and one of 8 KiB
    blocks = [a.malloc(40 << 10), a.malloc(512), a.malloc(8 << 10), a.malloc(512),
              a.malloc(40 << 10), a.malloc(512)]
    for i in (0, 2, 4):
        a.free(blocks[i])
    assert a.malloc(8 << 10) == blocks[2]          # exact size wins
    assert a.malloc(20 << 10) == blocks[0]         # smallest fitting, lowest address
    a._check_invariants()


def test_freeing_merges_free_neighbours(make_sim):
    a, _ = make_sim()
    x, y, z = a.malloc(4096), a.malloc(4096), a.malloc(4096)
    a.free(x)
    a.free(z)
    assert stats(a)["inactive_split.all.current"] == 2
    a.free(y)   # x, y, z and the rest of the segment become one block again
    s = stats(a)
    assert s["inactive_split.all.current"] == 0 and s["inactive_split_bytes.all.current"] == 0
    assert a.malloc(2 * MiB) != 0  # large pool: a new segment
    assert a.malloc(1 * MiB) == x  # the whole small segment is one free block again
    a._check_invariants()


def test_empty_cache_returns_only_whole_free_segments(make_sim):
    a, backend = make_sim()
    keep = a.malloc(512)
    drop = a.malloc(3 * MiB)
    a.free(drop)
    a.empty_cache()
    s = stats(a)
    assert s["segment.all.current"] == 1 and s["reserved_bytes.all.current"] == 2 * MiB
    assert s["num_device_free"] == 1 and s["num_sync_all_streams"] == 1
    assert backend.held() == 2 * MiB
    a.free(keep)
    a.empty_cache()
    assert backend.held() == 0 and stats(a)["reserved_bytes.all.current"] == 0


def test_roundup_power2_divisions(make_sim):
    a, _ = make_sim(roundup_power2_divisions=[4] * 16)
    # 1.2 MiB with 4 divisions of [1 MiB, 2 MiB) rounds to 1.25 MiB
    p = a.malloc(int(1.2 * MiB))
    assert stats(a)["allocated_bytes.all.current"] == int(1.25 * MiB)
    assert a.round_size(3000) == 3072      # 4 divisions of [2 KiB, 4 KiB)
    assert a.round_size(4096) == 4096      # powers of two stay
    assert a.round_size(1000) == 1024      # below 512 × divisions: plain rounding
    a.free(p)


def test_max_split_size_keeps_oversize_blocks_whole(make_sim):
    a, _ = make_sim(max_split_size=64 * MiB)
    big = a.malloc(100 * MiB)
    s = stats(a)
    assert s["oversize_allocations.current"] == 1 and s["oversize_segments.current"] == 1
    assert s["max_split_size"] == 64 * MiB
    a.free(big)
    # a normal request never takes the cached oversize block
    small = a.malloc(30 * MiB)
    assert small != big
    assert stats(a)["segment.large_pool.current"] == 2
    # an oversize request takes it only when it wastes less than 20 MiB
    assert a.malloc(90 * MiB) == big
    a._check_invariants()


def test_max_split_size_releases_cached_oversize_blocks_before_failing(make_sim):
    a, backend = make_sim(capacity=200 * MiB, max_split_size=64 * MiB)
    big = a.malloc(150 * MiB)
    a.free(big)
    # 100 MiB does not fit next to the cached 150 MiB; the oversize block goes first
    p = a.malloc(100 * MiB)
    s = stats(a)
    assert p != 0 and s["num_device_free"] == 1 and s["num_alloc_retries"] == 0
    assert s["oversize_segments.current"] == 1
    a._check_invariants()


def test_max_split_size_is_minus_one_when_unset(make_sim):
    a, _ = make_sim()
    a.malloc(1)
    assert stats(a)["max_split_size"] == -1


def test_garbage_collection_frees_old_cached_blocks(make_sim):
    a, backend = make_sim(capacity=1000 * MiB, garbage_collection_threshold=0.5)
    a.set_memory_fraction(0.6)                 # 600 MiB allowed, GC above 300 MiB
    blocks = [a.malloc(100 * MiB) for _ in range(4)]
    for b in blocks:
        a.free(b)
    assert stats(a)["reserved_bytes.all.current"] == 400 * MiB
    a.malloc(150 * MiB)                        # a miss: GC runs before asking for more
    s = stats(a)
    assert s["reserved_bytes.all.current"] <= 300 * MiB + 150 * MiB
    assert s["num_device_free"] >= 1 and s["num_ooms"] == 0
    a._check_invariants()


def test_memory_fraction_limits_reservations(make_sim):
    a, _ = make_sim(capacity=1000 * MiB)
    a.set_memory_fraction(0.1)
    a.malloc(80 * MiB)
    with pytest.raises(OutOfMemoryError, match="100.00 MiB allowed; "):
        a.malloc(80 * MiB)
    with pytest.raises(ValueError, match="Allowed range"):
        a.set_memory_fraction(1.5)
    assert a.get_memory_fraction() == pytest.approx(0.1)


def test_oom_retries_after_releasing_the_cache(make_sim):
    a, backend = make_sim(capacity=100 * MiB)
    p = a.malloc(60 * MiB)
    a.free(p)                                   # cached, 60 MiB held
    q = a.malloc(80 * MiB)                      # must release the cached 60 MiB first
    s = stats(a)
    assert q != 0 and s["num_alloc_retries"] == 1 and s["num_sync_all_streams"] == 1
    assert s["num_device_free"] == 1 and backend.held() == 80 * MiB
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB)
    s = stats(a)
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 2
    message = str(info.value)
    for needed in ("Tried to allocate 30.00 MiB", "total capacity of 100.00 MiB",
                   "80.00 MiB is allocated by unimem", "reserved"):
        assert needed in message
    assert isinstance(info.value, MemoryError)
    assert info.value.requested == 30 * MiB and info.value.allocated == 80 * MiB


def test_request_beyond_capacity_fails_at_once_and_keeps_the_cache(make_sim):
    a, backend = make_sim(capacity=100 * MiB)
    p = a.malloc(10 * MiB)
    a.free(p)
    before = stats(a)
    with pytest.raises(OutOfMemoryError):
        a.malloc(101 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(10 ** 30)                      # beyond any size_t
    after = stats(a)
    assert after["num_ooms"] == 2
    del after["num_ooms"], before["num_ooms"]
    assert after == before                       # the cache was not flushed


def test_bad_sizes_are_clear_errors_and_change_nothing(make_sim):
    a, backend = make_sim()
    before = stats(a)
    for bad, error in ((-1, ValueError), (1.5, TypeError), ("8", TypeError), (None, TypeError),
                       ([1], TypeError)):
        with pytest.raises(error):
            a.malloc(bad)
    assert stats(a) == before and backend.n_malloc == 0


def test_unknown_and_double_free_are_value_errors(make_sim):
    a, _ = make_sim()
    p = a.malloc(100)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p + 512)
    before = stats(a)
    a.free(p)
    with pytest.raises(ValueError, match="already freed"):
        a.free(p)
    with pytest.raises(ValueError):
        a.free(-5)
    with pytest.raises(TypeError):
        a.free(None)
    after = stats(a)
    assert after["allocation.all.freed"] == before["allocation.all.freed"] + 1


def test_peak_and_reset(make_sim):
    a, _ = make_sim()
    p = a.malloc(5 * MiB)
    q = a.malloc(5 * MiB)
    a.free(p)
    s = stats(a)
    assert s["allocated_bytes.all.peak"] == 10 * MiB and s["allocated_bytes.all.current"] == 5 * MiB
    a.reset_peak_stats()
    assert stats(a)["allocated_bytes.all.peak"] == 5 * MiB
    a.reset_accumulated_stats()
    s = stats(a)
    assert s["allocated_bytes.all.allocated"] == 0 and s["allocated_bytes.all.freed"] == 0
    assert s["num_device_alloc"] == 0 and s["allocated_bytes.all.current"] == 5 * MiB
    a.free(q)


def test_stat_keys_are_sorted_and_complete(make_sim):
    a, _ = make_sim()
    a.malloc(1)
    keys = list(stats(a))
    assert keys == sorted(keys)
    for name in ("allocation", "allocated", "segment", "active", "inactive_split", "allocated_bytes",
                 "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for metric in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{metric}" in keys
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "max_split_size", "oversize_allocations.current",
                "oversize_segments.peak"):
        assert key in keys
    assert len(keys) == 10 * 3 * 4 + 2 * 4 + 6


def test_allocation_handle_frees_on_collection(make_sim):
    a, _ = make_sim()
    h = a.allocate(1000)
    assert isinstance(h, _core.Allocation) and h.size == 1000 and a.owns(h.ptr)
    ptr = h.ptr
    del h
    assert not a.owns(ptr) and stats(a)["allocation.all.current"] == 0
    h = a.allocate(10)
    h.release()
    h.release()   # idempotent
    assert stats(a)["allocation.all.current"] == 0


def test_backend_errors_other_than_oom_propagate_and_leave_state(make_sim):
    from unimem.backends.pluggable import PluggableAllocator

    def broken(size, device, stream):
        raise RuntimeError("driver crashed")

    a = _core.CachingAllocator(PluggableAllocator(broken, lambda *args: None), 0)
    with pytest.raises(RuntimeError, match="driver crashed"):
        a.malloc(10)
    s = stats(a)
    assert s["num_device_alloc"] == 0 and s["num_ooms"] == 0 and s["allocation.all.current"] == 0
    a._check_invariants()


def test_backend_returning_garbage_is_a_type_error():
    from unimem.backends.pluggable import PluggableAllocator
    a = _core.CachingAllocator(PluggableAllocator(lambda *a: "0x10", lambda *a: None), 0)
    with pytest.raises(TypeError, match="positive int"):
        a.malloc(10)
    a._check_invariants()


def test_format_size():
    assert _core.format_size(512) == "512 bytes"
    assert _core.format_size(1536) == "1.50 KiB"
    assert _core.format_size(20 * MiB) == "20.00 MiB"


def test_the_backend_gets_memory_back_outside_the_allocator_lock():
    """Giving memory back may wait for the device (the XPU backend waits on
    its queue, whose host tasks may need this allocator): it must not happen
    under the allocator's lock, or those tasks could never finish."""
    import threading

    from unimem.backends.simulated import SimulatedBackend

    class Probing(SimulatedBackend):
        allocator = None
        frees_seen = []

        def free(self, ptr, size, device=0, stream=0):
            if self.allocator is not None:
                other = threading.Thread(target=lambda a: a.free(a.malloc(512)), args=(self.allocator,))
                other.start()
                other.join(10)
                self.frees_seen.append(not other.is_alive())
            super().free(ptr, size, device, stream)

    backend = Probing()
    a = _core.CachingAllocator(backend, 0)
    a.free(a.malloc(3 * MiB))
    backend.allocator = a
    a.empty_cache()
    backend.allocator = None
    assert backend.frees_seen == [True], "another thread could not use the allocator during free"
    assert backend.held() == 2 * MiB       # the large segment went; the small one the thread used stays
    a._check_invariants()


@pytest.mark.parametrize("error", [RuntimeError("device busy"), KeyboardInterrupt()])
def test_a_backend_free_that_raises_forgets_the_segment_and_never_hands_it_out_again(error):
    """A free that raises may have released the memory (a Ctrl-C
    after the driver let go). Re-caching the segment handed the freed address
    out again, and freed it twice. Now it is forgotten and counted."""
    from unimem.backends.simulated import SimulatedBackend

    class FreesThenRaises(SimulatedBackend):
        def free(self, ptr, size, device=0, stream=0):
            super().free(ptr, size, device, stream)     # the memory is gone...
            raise error                                 # ...and then the error comes

    backend = FreesThenRaises()
    a = _core.CachingAllocator(backend, 0)
    first = a.malloc(3 * MiB)
    a.free(first)
    with pytest.raises(type(error)):
        a.empty_cache()
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0 and s["segment.all.current"] == 0
    assert a.lost_segments() == {"count": 1, "bytes": 20 * MiB}
    a._check_invariants()
    again = a.malloc(3 * MiB)
    assert again != first, "the freed segment was handed out again"
    assert backend.held() == 20 * MiB            # only the new segment is on the device


def test_an_allocator_dying_in_a_reference_cycle_still_gives_memory_back():
    """When an allocator is collected as part of a cycle, the collector tears
    down what the cycle references; the allocator keeps its backend whole."""
    import gc

    from unimem.backends.pluggable import PluggableAllocator
    freed = []
    device = {"next": 1 << 40}

    def malloc(size, dev, stream):
        device["next"] += size
        return device["next"] - size

    a = _core.CachingAllocator(PluggableAllocator(malloc, lambda ptr, size, dev, stream: freed.append(size)), 0)
    a.free(a.malloc(3 * MiB))
    a.add_oom_observer(lambda *args, allocator=a: allocator)     # a cycle through the allocator
    del a
    gc.collect()
    assert freed == [20 * MiB]


def test_max_reserved_ratio_gives_back_free_segments_before_growing(make_sim):
    a, backend = make_sim(max_reserved_ratio=1.1)
    keep = a.malloc(40 * MiB)
    a.free(a.malloc(60 * MiB))                  # 60 MiB cached, 100 reserved for 40 in use
    a.malloc(80 * MiB)                          # a miss: 180 > 1.1 x 120, so the 60 MiB goes first
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 120 * MiB and s["num_device_free"] == 1
    a.free(keep)
    with pytest.raises(ValueError, match="at least 1.0"):
        _core.CachingAllocator(backend, 0, max_reserved_ratio=0.5)
    plain, _ = make_sim()
    plain.free(plain.malloc(60 * MiB))
    plain.malloc(80 * MiB)                      # PyTorch's policy: the cache is kept
    assert plain.memory_stats()["reserved_bytes.all.current"] == 140 * MiB


def test_an_allocation_knows_its_blocks_rounded_size():
    """``Allocation.block_size`` is ``round_size(size)`` (what CuPy's
    ``PooledMemory.size`` reports), 0 for an empty allocation."""
    from unimem._core import CachingAllocator
    from unimem.backends.simulated import SimulatedBackend
    allocator = CachingAllocator(SimulatedBackend(), 0)
    for size in (0, 1, 511, 512, 513, 1000, (1 << 20) + 1, 10 << 20):
        allocation = allocator.allocate(size)
        assert allocation.block_size == allocator.round_size(size), size
        allocation.release()
    assert allocator.memory_stats()["allocated_bytes.all.current"] == 0


def test_the_registry_allocates_on_the_current_device_and_stream():
    from unimem._core import CachingAllocator
    from unimem._runtime.registry import DeviceRegistry
    from unimem.backends.simulated import SimulatedBackend
    backend = SimulatedBackend(devices=2)
    current = {"device": 1, "stream": 7}
    registry = DeviceRegistry("sim", 2, lambda i: CachingAllocator(backend, i),
                              current_device_fn=lambda: current["device"],
                              current_stream_fn=lambda device: current["stream"])
    allocation = registry.allocate_current(1000)
    assert allocation.allocator is registry.get(1) and allocation.size == 1000
    assert registry.get(1).snapshot()[0]["stream"] == 7
    current["device"] = 0
    assert registry.allocate_current(0).allocator is registry.get(0)
    with pytest.raises(TypeError):
        registry.allocate_current("10")
    assert registry.get(0).memory_stats()["allocation.all.current"] == 0


def test_exact_segments_hold_no_more_than_asked():
    a = _core.CachingAllocator(SimulatedBackend(), 0, exact_segments=True)
    p = a.malloc(1024)
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 1024 and a.free_block_count() == 0
    a.free(p)
    assert a.free_block_count() == 1
