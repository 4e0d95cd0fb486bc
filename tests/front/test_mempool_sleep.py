"""MemPool.sleep / wake_up: sleep mode for one private pool's segments, on
the ``cpu`` pool's real host memory.

The pool's live blocks keep their addresses and (offloaded) bytes; its memory
goes back while the device's other memory and allocations are untouched;
allocating from the sleeping pool is refused, allocating outside it is not."""
import ctypes
import gc
import os
import threading

import pytest

import unimem.cpu

from tests.helpers.crash_guard import answer_of_forked_child

MiB = 1 << 20


def fill(ptr, size, seed):
    ctypes.memmove(ptr, bytes((seed + i) % 251 for i in range(256)) * (size // 256), size)


def same_bytes(ptr, size, seed):
    return ctypes.string_at(ptr, size) == bytes((seed + i) % 251 for i in range(256)) * (size // 256)


@pytest.fixture
def pool():
    gc.collect()
    unimem.cpu.empty_cache()
    pool = unimem.cpu.MemPool()
    yield pool
    if pool.is_sleeping():
        pool.wake_up()
    del pool
    gc.collect()
    unimem.cpu.empty_cache()


def pool_reserved(pool):
    return sum(s["total_size"] for s in pool.snapshot())


def test_the_pool_sleeps_alone_and_wakes_with_its_bytes_at_its_addresses(pool):
    outside = unimem.cpu.caching_allocator_alloc(3 * MiB)
    fill(outside, 3 * MiB, 7)
    with unimem.cpu.use_mem_pool(pool):
        inside = [unimem.cpu.caching_allocator_alloc(n) for n in (3 * MiB, 64 << 10, 12 * MiB)]
    for k, (ptr, n) in enumerate(zip(inside, (3 * MiB, 64 << 10, 12 * MiB))):
        fill(ptr, n, k)
    reserved = unimem.cpu.memory_reserved()
    in_pool = pool_reserved(pool)
    assert in_pool > 0

    pool.sleep(offload=True)
    assert pool.is_sleeping() and not unimem.cpu.is_sleeping()
    assert unimem.cpu.memory_reserved() == reserved - in_pool       # only the pool's memory went
    assert same_bytes(outside, 3 * MiB, 7)                           # the device's memory is untouched
    other = unimem.cpu.caching_allocator_alloc(1 * MiB)              # allocation outside the pool works
    unimem.cpu.caching_allocator_delete(other)
    awake_elsewhere = unimem.cpu.memory_reserved()                   # with the segment it may have made

    pool.wake_up()
    assert not pool.is_sleeping()
    assert unimem.cpu.memory_reserved() == awake_elsewhere + in_pool
    for k, (ptr, n) in enumerate(zip(inside, (3 * MiB, 64 << 10, 12 * MiB))):
        assert same_bytes(ptr, n, k)
    assert {b["address"] for s in pool.snapshot() for b in s["blocks"] if b["state"] == "active_allocated"} \
        == set(inside)
    for ptr in inside + [outside]:
        unimem.cpu.caching_allocator_delete(ptr)


def test_allocating_from_a_sleeping_pool_is_refused_and_changes_nothing(pool):
    with unimem.cpu.use_mem_pool(pool):
        kept = unimem.cpu.caching_allocator_alloc(1 * MiB)
    pool.sleep(offload=False)
    stats = unimem.cpu.memory_stats()
    with unimem.cpu.use_mem_pool(pool):
        with pytest.raises(RuntimeError, match="asleep"):
            unimem.cpu.caching_allocator_alloc(4096)
    after = unimem.cpu.memory_stats()
    assert {k: v for k, v in after.items() if not k.startswith("num_")} == \
        {k: v for k, v in stats.items() if not k.startswith("num_")}
    pool.wake_up()
    with unimem.cpu.use_mem_pool(pool):                              # awake: the pool serves again
        again = unimem.cpu.caching_allocator_alloc(4096)
    assert any(again == b["address"] for s in pool.snapshot() for b in s["blocks"])
    for ptr in (kept, again):
        unimem.cpu.caching_allocator_delete(ptr)


def test_a_block_of_a_sleeping_pool_may_be_freed(pool):
    with unimem.cpu.use_mem_pool(pool):
        a = unimem.cpu.caching_allocator_alloc(2 * MiB)
        b = unimem.cpu.caching_allocator_alloc(2 * MiB)
    fill(b, 2 * MiB, 3)
    allocated = unimem.cpu.memory_allocated()
    pool.sleep()
    unimem.cpu.caching_allocator_delete(a)
    assert unimem.cpu.memory_allocated() == allocated - 2 * MiB
    pool.wake_up()
    assert same_bytes(b, 2 * MiB, 3)
    unimem.cpu.caching_allocator_delete(b)
    assert unimem.cpu.memory_allocated() == allocated - 4 * MiB


def test_sleeping_twice_waking_while_awake_and_bad_input(pool):
    with unimem.cpu.use_mem_pool(pool):
        ptr = unimem.cpu.caching_allocator_alloc(1 * MiB)
    pool.wake_up()                                 # awake: nothing to do
    pool.sleep()
    pool.sleep()                                   # asleep already: nothing to do
    with pytest.raises(TypeError, match="offload"):
        pool.sleep(offload="yes")
    pool.wake_up()
    assert not pool.is_sleeping()
    with pytest.raises(TypeError):
        pool._core.sleep_pool(42)
    with pytest.raises(ValueError, match="not a live pool"):
        pool._core.sleep_pool((0, 1 << 40))
    unimem.cpu.caching_allocator_delete(ptr)


def test_the_device_and_a_pool_sleep_together(pool):
    with unimem.cpu.use_mem_pool(pool):
        inside = unimem.cpu.caching_allocator_alloc(3 * MiB)
    outside = unimem.cpu.caching_allocator_alloc(3 * MiB)
    fill(inside, 3 * MiB, 1)
    fill(outside, 3 * MiB, 2)
    pool.sleep()
    unimem.cpu.sleep()                             # the rest of the device
    assert unimem.cpu.memory_reserved() == 0
    unimem.cpu.wake_up()
    assert same_bytes(outside, 3 * MiB, 2) and pool.is_sleeping()
    pool.wake_up()
    assert same_bytes(inside, 3 * MiB, 1)
    for ptr in (inside, outside):
        unimem.cpu.caching_allocator_delete(ptr)


def test_a_pool_cannot_start_sleeping_while_the_device_sleeps(pool):
    with unimem.cpu.use_mem_pool(pool):
        inside = unimem.cpu.caching_allocator_alloc(3 * MiB)
    fill(inside, 3 * MiB, 3)
    unimem.cpu.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        pool.sleep()
    assert not pool.is_sleeping()
    unimem.cpu.wake_up()
    assert pool_reserved(pool) > 0 and same_bytes(inside, 3 * MiB, 3)
    unimem.cpu.caching_allocator_delete(inside)


def test_a_mempool_that_dies_asleep_leaves_nothing_behind():
    """Its block in use wakes with its bytes; everything else goes back, at
    once or at the next empty_cache, and the statistics say so."""
    gc.collect()
    unimem.cpu.empty_cache()
    reserved = unimem.cpu.memory_reserved()
    segments = unimem.cpu.memory_stats().get("segment.all.current", 0)
    pool = unimem.cpu.MemPool()
    with unimem.cpu.use_mem_pool(pool):
        kept = unimem.cpu.caching_allocator_alloc(3 * MiB)
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(12 * MiB))
    fill(kept, 3 * MiB, 5)
    pool_id, core = pool.id, pool._core
    pool.sleep()
    del pool
    gc.collect()
    assert not core.is_sleeping(pool_id)
    assert same_bytes(kept, 3 * MiB, 5)                              # woken: readable, its bytes back
    assert unimem.cpu.memory_snapshot(pool_id) != []
    unimem.cpu.caching_allocator_delete(kept)
    unimem.cpu.empty_cache()
    assert unimem.cpu.memory_snapshot(pool_id) == []
    assert unimem.cpu.memory_reserved() == reserved
    assert unimem.cpu.memory_stats()["segment.all.current"] == segments


def test_a_pool_put_back_to_sleep_by_the_wake_ups_history_hook_stays_refused(pool):
    """wake_up() runs the history hook after the wake; a hook that puts the
    pool back to sleep leaves it asleep, and allocating from it refused (it
    was marked awake: allocation from a sleeping pool succeeded)."""
    allocator = unimem.cpu.caching_allocator()
    with unimem.cpu.use_mem_pool(pool):
        freed = unimem.cpu.caching_allocator_alloc(MiB)
        kept = unimem.cpu.caching_allocator_alloc(MiB)
    fill(kept, MiB, 3)
    pool.sleep()
    unimem.cpu.caching_allocator_delete(freed)      # completed (and traced) at wake_up
    armed = [True]

    def hook(events):
        if armed[0]:
            armed[0] = False
            pool.sleep()                            # a scheduler reacting to memory events

    allocator.set_trace_hook(hook)
    try:
        pool.wake_up()
    finally:
        allocator.set_trace_hook(None)
    assert not armed[0] and pool.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        with unimem.cpu.use_mem_pool(pool):
            unimem.cpu.caching_allocator_alloc(4096)
    pool.wake_up()
    assert same_bytes(kept, MiB, 3)
    unimem.cpu.caching_allocator_delete(kept)
    allocator._check_invariants()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_while_another_thread_puts_a_pool_to_sleep_leaves_a_child_that_can_wake_it():
    """The fork handler resets the lock another thread held in a slow
    release_pages (a device synchronisation); the sleep stays half-way in
    the child. Its 'under way' mark stayed too: every sleep() and wake_up()
    in the child was refused for ever."""
    from tests.helpers.pool_allocators import PageAllocator
    entered, leave = threading.Event(), threading.Event()

    class Slow(PageAllocator):
        def release_pages(self, address, size, device):
            entered.set()
            leave.wait()
            super().release_pages(address, size, device)

    slow_pool = unimem.cpu.MemPool(allocator=Slow())
    with unimem.cpu.use_mem_pool(slow_pool):
        p = unimem.cpu.caching_allocator_alloc(MiB)
    fill(p, MiB, 9)
    sleeper = threading.Thread(target=slow_pool.sleep)
    sleeper.start()
    entered.wait()
    def in_the_child():
        leave.set()                                      # the child's own release_pages need not wait
        slow_pool.wake_up()
        awake = not slow_pool.is_sleeping() and same_bytes(p, MiB, 9)
        unimem.cpu.sleep(offload=True)
        unimem.cpu.wake_up()
        unimem.cpu.caching_allocator()._check_invariants()
        return f"awake={awake}"

    told = answer_of_forked_child(in_the_child)
    leave.set()
    sleeper.join()
    slow_pool.wake_up()
    assert told == "awake=True"
    assert same_bytes(p, MiB, 9)
    unimem.cpu.caching_allocator_delete(p)
