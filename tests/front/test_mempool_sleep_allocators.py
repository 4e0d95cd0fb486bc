"""MemPool(allocator=...).sleep() on ``unimem.cpu``: a pool with its own
allocator sleeps through that allocator (which handed its segments out), and
one whose allocator cannot give memory back is refused with nothing changed,
by ``pool.sleep()`` and by ``unimem.cpu.sleep()`` alike. Before, the cpu
backend was asked to give back the pool's segments and refused them as
unknown (ValueError), leaving the pool (or the device) asleep."""
import ctypes
import gc

import pytest

import unimem.cpu
from unimem.backends.pluggable import PluggableAllocator

from tests.helpers.pool_allocators import PageAllocator, PlainAllocator

MiB = 1 << 20


@pytest.fixture
def clean():
    gc.collect()
    unimem.cpu.empty_cache()
    yield
    if unimem.cpu.is_sleeping():
        unimem.cpu.wake_up()
    gc.collect()
    unimem.cpu.empty_cache()


def fill(ptr, size, seed):
    data = bytes((seed + i) % 251 for i in range(size))
    ctypes.memmove(ptr, data, size)
    return data


@pytest.mark.parametrize("whole_device", [False, True])
def test_a_mempool_sleeps_through_its_own_allocator(clean, whole_device):
    pages = PageAllocator()
    pool = unimem.cpu.MemPool(allocator=pages)
    with unimem.cpu.use_mem_pool(pool):
        inside = unimem.cpu.caching_allocator_alloc(3 * MiB)
    data = fill(inside, 3 * MiB, 5)
    reserved = unimem.cpu.memory_reserved()
    pool_bytes = sum(s["total_size"] for s in pool.snapshot())

    (unimem.cpu.sleep if whole_device else pool.sleep)()
    assert [name for name in pages.names() if name != "malloc"] == ["release"]
    assert unimem.cpu.memory_reserved() == (0 if whole_device else reserved - pool_bytes)
    (unimem.cpu.wake_up if whole_device else pool.wake_up)()
    assert pages.names()[-1] == "restore" and not pages.released
    assert ctypes.string_at(inside, 3 * MiB) == data
    assert unimem.cpu.memory_reserved() == reserved
    unimem.cpu.caching_allocator_delete(inside)
    del pool
    gc.collect()
    unimem.cpu.empty_cache()
    assert not pages.live                              # the dead pool's segment went back to its allocator


@pytest.mark.parametrize("whole_device", [False, True])
def test_a_mempool_whose_allocator_cannot_sleep_is_refused_with_nothing_changed(clean, whole_device):
    plain = PlainAllocator()
    pool = unimem.cpu.MemPool(allocator=PluggableAllocator(plain.malloc, plain.free))
    with unimem.cpu.use_mem_pool(pool):
        inside = unimem.cpu.caching_allocator_alloc(MiB)
    outside = unimem.cpu.caching_allocator_alloc(MiB)
    data = fill(inside, MiB, 1)
    stats, snapshot = unimem.cpu.memory_stats(), unimem.cpu.memory_snapshot()

    with pytest.raises(NotImplementedError, match=r"memory pool \(0, \d+\).*PluggableAllocator.*release_pages"):
        (unimem.cpu.sleep if whole_device else pool.sleep)()
    assert unimem.cpu.memory_stats() == stats and unimem.cpu.memory_snapshot() == snapshot
    assert not pool.is_sleeping() and not unimem.cpu.is_sleeping()
    pool._core._check_invariants()
    assert ctypes.string_at(inside, MiB) == data
    with unimem.cpu.use_mem_pool(pool):                # the pool still serves
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(4096))
    for ptr in (inside, outside):
        unimem.cpu.caching_allocator_delete(ptr)
    del pool
    gc.collect()
