"""The statistics the hot path does not store are derived where they are read
(unimem/_native/stats.pxd): "freed" from "allocated", "current" and the
current value at the last reset; a pool "all" from its small and large pools,
but for its peak, which is kept. These tests pin the reported numbers to
PyTorch's meaning, where the derivation could go wrong: resets with memory
live, and peaks of small and large reached at different times."""
import itertools

from unimem import _core

MiB = 1 << 20
NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
         "active_bytes", "inactive_split_bytes", "requested_bytes")


def test_all_is_small_plus_large_and_current_is_allocated_less_freed(make_sim):
    a, _ = make_sim()
    live = []
    for step, size in enumerate(itertools.islice(itertools.cycle((1000, 3 * MiB, 200_000, 12 * MiB)), 40)):
        live.append(a.malloc(size))
        if step % 3 == 2:
            a.free(live.pop(0))
        if step == 17:
            a.reset_accumulated_stats()      # with blocks live in both pools
        s = a.memory_stats()
        for name in NAMES:
            for metric in ("current", "allocated", "freed"):
                assert s[f"{name}.all.{metric}"] == (s[f"{name}.small_pool.{metric}"]
                                                     + s[f"{name}.large_pool.{metric}"]), (name, metric)
            for pool in ("all", "small_pool", "large_pool"):
                assert s[f"{name}.{pool}.freed"] >= 0 and s[f"{name}.{pool}.peak"] >= s[f"{name}.{pool}.current"]
    for p in live:
        a.free(p)
    a._check_invariants()


def test_freed_counts_only_what_was_freed_since_the_reset(make_sim):
    a, _ = make_sim()
    p, q, r = a.malloc(1 * MiB), a.malloc(4 * MiB), a.malloc(512)
    a.free(p)
    a.reset_accumulated_stats()
    s = a.memory_stats()
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == 0
    assert s["allocation.all.current"] == 2 and s["allocated_bytes.all.current"] == 4 * MiB + 512
    a.free(q)
    s = a.memory_stats()
    assert s["allocation.all.freed"] == 1 and s["allocation.large_pool.freed"] == 1
    assert s["allocation.small_pool.freed"] == 0
    assert s["allocated_bytes.all.freed"] == 4 * MiB and s["allocated_bytes.all.allocated"] == 0
    assert s["allocation.all.current"] == 1        # current is not reset, and may exceed allocated - freed
    t = a.malloc(2000)
    a.free(r)
    a.free(t)
    s = a.memory_stats()
    assert s["allocation.all.allocated"] == 1 and s["allocation.all.freed"] == 3
    assert s["allocated_bytes.small_pool.allocated"] == 2048
    assert s["allocated_bytes.small_pool.freed"] == 2048 + 512
    a.reset_accumulated_stats()                    # a second reset starts from the new current
    s = a.memory_stats()
    assert s["allocated_bytes.all.freed"] == s["allocated_bytes.all.allocated"] == 0


def test_the_peak_of_all_is_the_peak_of_the_sum_not_the_sum_of_peaks(make_sim):
    a, _ = make_sim()
    p = a.malloc(1 * MiB)           # small pool peaks at 1 MiB ...
    a.free(p)
    q = a.malloc(8 * MiB)           # ... then large at 8 MiB, never together
    s = a.memory_stats()
    assert s["allocated_bytes.small_pool.peak"] == 1 * MiB
    assert s["allocated_bytes.large_pool.peak"] == 8 * MiB
    assert s["allocated_bytes.all.peak"] == 8 * MiB
    r = a.malloc(2000)              # now both at once: 8 MiB + 2048
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == 8 * MiB + 2048
    a.free(q)
    a.reset_peak_stats()            # back to the current sum, 2048
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == 2048 == s["allocated_bytes.small_pool.peak"]
    assert s["allocated_bytes.large_pool.peak"] == 0
    assert a.max_memory_allocated() == 2048 and a.memory_allocated() == 2048
    a.free(r)


def test_oversize_allocations_report_freed(make_sim):
    a, _ = make_sim(max_split_size=40 * MiB)
    p = a.malloc(50 * MiB)
    a.free(p)
    p = a.malloc(50 * MiB)
    s = a.memory_stats()
    assert s["oversize_allocations.allocated"] == 2 and s["oversize_allocations.freed"] == 1
    assert s["oversize_allocations.current"] == 1
    a.reset_accumulated_stats()
    a.free(p)
    s = a.memory_stats()
    assert (s["oversize_allocations.allocated"], s["oversize_allocations.freed"],
            s["oversize_allocations.current"]) == (0, 1, 0)
