"""MemPool, use_mem_pool and caching_allocator_enable in the namespaces.

PyTorch's test_mempool_* expectations (test/test_cuda.py, TestMemPool),
ported to the simulated CUDA runtime (tests/helpers/fake_cuda.py, with
CuPy's allocator entry ``unimem.cuda.allocator``) and to the ``cpu`` pool;
dpnp arrays made inside a pool context on the real SYCL device."""
import gc
import inspect
import os
import threading
from collections import defaultdict

import pytest

import unimem
import unimem.cpu
import unimem.cuda
import unimem.xpu
from unimem.backends.pluggable import PluggableAllocator

from tests.helpers.crash_guard import answer_of_forked_child
from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

MiB = 1 << 20


class Counting:
    """A pool allocator (PyTorch's dummy_alloc / dummy_free) over plain ids."""

    def __init__(self):
        self.allocs = self.frees = 0
        self.next = 9 << 40

    def malloc(self, size, device, stream):
        self.allocs += 1
        ptr, self.next = self.next, self.next + size
        return ptr

    def free(self, ptr, size, device, stream):
        self.frees += 1


@pytest.fixture(params=["cuda", "cpu"])
def ns(request):
    """A namespace on a fresh device: the simulated CUDA runtime, or unimem.cpu."""
    if request.param == "cuda":
        request.getfixturevalue("fake")
        yield unimem.cuda
        return
    gc.collect()
    unimem.cpu.empty_cache()
    before = {s["address"] for s in unimem.cpu.memory_snapshot()}
    yield unimem.cpu
    gc.collect()
    unimem.cpu.empty_cache()
    assert {s["address"] for s in unimem.cpu.memory_snapshot()} <= before


def alloc(ns, size):
    return ns.caching_allocator_alloc(size)


def pool_ids(ns):
    return [s["segment_pool_id"] for s in ns.memory_snapshot()]


def test_mempool_id(ns):
    first, second = ns.MemPool().id, ns.MemPool().id
    assert first[0] == second[0] == 0 and second[1] > first[1] > 0


def test_mempool_empty_cache(ns):
    pool = ns.MemPool()
    x = alloc(ns, 4 * MiB)
    with ns.use_mem_pool(pool):
        y = alloc(ns, 4 * MiB)
    assert sorted(pool_ids(ns)) == [(0, 0), pool.id]
    ns.caching_allocator_delete(y)
    ns.caching_allocator_delete(x)
    del pool
    assert pool_ids(ns) == [(0, 0)]        # the pool's segment went with it; x's is cached


def test_mempool_with_allocator(ns):
    assert ns.MemPool().allocator is None
    counting = Counting()
    allocator = PluggableAllocator(counting.malloc, counting.free)
    pool = ns.MemPool(allocator)
    assert pool.allocator is allocator and pool.use_count() == 1
    with ns.use_mem_pool(pool):
        out_0 = alloc(ns, MiB)
        assert pool.use_count() == 2
    assert pool.use_count() == 1 and counting.allocs == 1
    out_non_pool = alloc(ns, MiB)
    with ns.use_mem_pool(pool):
        assert len(pool.snapshot()) == 1
        out_1 = alloc(ns, MiB)
        assert len(pool.snapshot()) == 1
        out_2 = alloc(ns, MiB)
        assert len(pool.snapshot()) == 2
    assert len(pool.snapshot()) == 2 and pool.snapshot() == ns.memory_snapshot(pool.id)
    for p in (out_0, out_1, out_2, out_non_pool):
        ns.caching_allocator_delete(p)
    del pool
    assert counting.frees == 2


def test_mempool_empty_cache_inactive(ns):
    counting = Counting()

    def f():
        pool = ns.MemPool(PluggableAllocator(counting.malloc, counting.free))
        with ns.use_mem_pool(pool):
            return alloc(ns, 8 * MiB)

    x = f()                                 # the pool died, x lives
    assert (counting.allocs, counting.frees) == (1, 0)
    ns.caching_allocator_delete(x)
    assert counting.frees == 0
    ns.empty_cache()
    assert counting.frees == 1


def test_mempool_limited_memory_with_allocator(fake):
    import unimem.cuda as ns
    ns.set_per_process_memory_fraction(80 * MiB / fake.capacity)
    try:
        pool_do_not_use = ns.MemPool()
        pool_use = ns.MemPool(use_on_oom=True)
        with ns.use_mem_pool(pool_do_not_use):
            a = alloc(ns, 40 * MiB)
        with ns.use_mem_pool(pool_use):
            b = alloc(ns, 40 * MiB)
        with pytest.raises(unimem.OutOfMemoryError):
            alloc(ns, 40 * MiB)
        ns.caching_allocator_delete(a)
        ns.caching_allocator_delete(b)
        c = alloc(ns, 30 * MiB)             # the use_on_oom pool's free memory
        assert c == b
        with pytest.raises(unimem.OutOfMemoryError):
            alloc(ns, 30 * MiB)             # never pool_do_not_use's
        ns.caching_allocator_delete(c)
        with ns.use_mem_pool(pool_use):
            e = alloc(ns, 20 * MiB)
        assert e == c
        ns.caching_allocator_delete(e)
        del pool_use, pool_do_not_use
        assert ns.memory_reserved() == 0
    finally:
        ns.set_per_process_memory_fraction(1.0)


def test_mempool_no_split(ns):
    pool_split, pool_no_split = ns.MemPool(), ns.MemPool(no_split=True)
    data = []
    for pool in (pool_split, pool_no_split, pool_split, pool_no_split):
        with ns.use_mem_pool(pool):
            data.append(alloc(ns, 4 * MiB))
    assert len(pool_no_split.snapshot()) > len(pool_split.snapshot())
    assert all(len(segment["blocks"]) == 1 for segment in pool_no_split.snapshot())
    blocks = [sum(len(s["blocks"]) for s in pool.snapshot()) for pool in (pool_no_split, pool_split)]
    assert blocks[0] < blocks[1]
    for p in data:
        ns.caching_allocator_delete(p)


def test_deleted_mempool_not_used_on_oom(fake):
    import unimem.cuda as ns
    ns.set_per_process_memory_fraction(40 * MiB / fake.capacity)
    try:
        for _ in range(10):
            pool = ns.MemPool(use_on_oom=True)
            with ns.use_mem_pool(pool):
                ns.caching_allocator_delete(alloc(ns, 40 * MiB))
            del pool
        pool = ns.MemPool(use_on_oom=True)
        with ns.use_mem_pool(pool):
            ns.caching_allocator_delete(alloc(ns, 40 * MiB))
        b, c = alloc(ns, 20 * MiB), alloc(ns, 20 * MiB)
        assert {s["segment_pool_id"] for s in ns.memory_snapshot()} == {pool.id}
        ns.caching_allocator_delete(b)
        ns.caching_allocator_delete(c)
    finally:
        ns.set_per_process_memory_fraction(1.0)


def test_mempool_multithread(ns):
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(ns.MemPool().id)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 4


def test_mempool_emptycache_multithread(ns):
    pools = [ns.MemPool() for _ in range(4)]

    def work(pool):
        with ns.use_mem_pool(pool):
            ns.caching_allocator_delete(alloc(ns, 16))
            ns.empty_cache()

    threads = [threading.Thread(target=work, args=(p,)) for p in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pool in pools:                      # empty_cache leaves a live pool alone
        assert len(pool.snapshot()) == 1


def test_nested_mempool(ns):
    pool1, pool2, pool3 = ns.MemPool(), ns.MemPool(), ns.MemPool()
    data = []
    with ns.use_mem_pool(pool1):
        data.append(alloc(ns, 20 * MiB))
        with ns.use_mem_pool(pool2):
            data.append(alloc(ns, 20 * MiB))
            with ns.use_mem_pool(pool3):
                data.append(alloc(ns, 20 * MiB))
            data.append(alloc(ns, 20 * MiB))
        data.append(alloc(ns, 20 * MiB))
    assert [len(ns.memory_snapshot(p.id)) for p in (pool1, pool2, pool3)] == [2, 2, 1]
    for p in data:
        ns.caching_allocator_delete(p)


def test_mempool_ctx_multithread(ns):
    trigger, done = threading.Event(), threading.Event()
    seen = []
    pool = ns.MemPool()

    def main_thread():
        with ns.use_mem_pool(pool):
            ns.caching_allocator_delete(alloc(ns, MiB))
            trigger.set()
            done.wait(10)

    def side_thread():
        trigger.wait(10)
        seen.append(alloc(ns, MiB))
        seen.append(ns.memory_snapshot())
        done.set()

    threads = [threading.Thread(target=main_thread), threading.Thread(target=side_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    active = defaultdict(int)
    for segment in seen[1]:
        active[segment["segment_pool_id"]] += segment["active_size"]
    assert active[(0, 0)] == MiB and active[pool.id] == 0
    ns.caching_allocator_delete(seen[0])


def test_an_exception_inside_the_context_restores_routing(ns):
    pool = ns.MemPool()
    with pytest.raises(KeyError):
        with ns.use_mem_pool(pool):
            raise KeyError("boom")
    assert pool.use_count() == 1
    p = alloc(ns, 100)
    assert pool.snapshot() == []
    ns.caching_allocator_delete(p)


def test_bad_input(fake):
    import unimem.cuda as ns
    with pytest.raises(TypeError):
        with ns.use_mem_pool(42):
            pass
    with pytest.raises(TypeError):
        ns.memory_snapshot(mempool_id="pool")
    pool = ns.MemPool()                     # on device 0
    with pytest.raises(ValueError, match="belongs to device 0"):
        with ns.use_mem_pool(pool, device=1):
            pass
    with pytest.raises(ValueError, match="pool of cuda"):
        with unimem.cpu.use_mem_pool(pool):
            pass
    assert pool.use_count() == 1
    ns.set_device(1)
    try:
        other = ns.MemPool()
        assert other.device == 1
        with ns.use_mem_pool(other, device=1):
            p = alloc(ns, 100)
        assert len(other.snapshot()) == 1
        ns.caching_allocator_delete(p)
    finally:
        ns.set_device(0)


@pytest.mark.parametrize("flag", ["use_on_oom", "no_split"])
def test_mempool_flags_take_what_pytorchs_bool_arguments_take(ns, flag):
    """torch's MemPool hands its flags to a C++ bool (pybind11): True, False,
    None and numbers are taken by their truth; a string or a list is a
    TypeError, and makes no pool."""
    import numpy
    for value, meant in ((None, False), (0, False), (2, True), (numpy.bool_(True), True), (0.0, False)):
        pool = ns.MemPool(**{flag: value})
        if flag == "no_split":              # what the flag means is seen in the pool's blocks
            with ns.use_mem_pool(pool):
                p = alloc(ns, 4 * MiB)
            blocks = [len(segment["blocks"]) for segment in pool.snapshot()]
            assert blocks == ([1] if meant else [2]), (value, blocks)
            ns.caching_allocator_delete(p)
        del pool
    before = ns.MemPool().id
    for value in ("no", "", [], [0], {}):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            ns.MemPool(**{flag: value})
    assert ns.MemPool().id == (before[0], before[1] + 1)     # no id spent on a refusal


def test_cupy_allocations_in_a_pool(fake):
    import unimem.cuda as ns
    pool = ns.MemPool()
    with ns.use_mem_pool(pool):
        pointer = ns.allocator(1000)        # what cupy.cuda.set_allocator(unimem.cuda.allocator) calls
    outside = ns.allocator(1000)
    assert [s["segment_pool_id"] for s in pool.snapshot()] == [pool.id]
    assert pool.snapshot()[0]["allocated_size"] == 1024
    del pointer, outside
    gc.collect()
    assert pool.snapshot()[0]["allocated_size"] == 0


def test_caching_allocator_enable(ns):
    ns.caching_allocator_delete(alloc(ns, 100))
    stats = ns.memory_stats()
    with ns.caching_allocator_disabled():
        assert ns.memory_reserved() == 0           # what was cached went back
        p, q = alloc(ns, 100), alloc(ns, 100)
        after = ns.memory_stats()
        assert after["num_device_alloc"] == stats["num_device_alloc"] + 2
        assert after["allocated_bytes.all.current"] == 1024 and ns.memory_reserved() == 1024
        ns.caching_allocator_delete(p)
        ns.caching_allocator_delete(q)
        assert ns.memory_reserved() == 0
        assert ns.memory_stats()["num_device_free"] == after["num_device_free"] + 2
    ns.caching_allocator_delete(alloc(ns, 100))
    assert ns.memory_reserved() == 2 * MiB          # cached again
    ns.caching_allocator_enable(False)
    ns.caching_allocator_enable()
    ns.caching_allocator_delete(alloc(ns, 100))
    assert ns.memory_reserved() == 2 * MiB


@pytest.mark.parametrize("value", [None, 0, 1, "no", 0.0])
def test_caching_allocator_enable_takes_a_bool_only(ns, value):
    """As torch's (THPUtils_checkBool: a bool or a NumPy bool): None read as
    false gave the cached segment back before."""
    ns.caching_allocator_delete(alloc(ns, 100))
    before = ns.memory_stats()
    with pytest.raises(TypeError, match="expects a bool"):
        ns.caching_allocator_enable(value)
    assert ns.memory_stats() == before and ns.memory_reserved() == 2 * MiB


def test_caching_allocator_enable_takes_numpy_bools(ns):
    import numpy
    ns.caching_allocator_delete(alloc(ns, 100))
    ns.caching_allocator_enable(numpy.bool_(False))
    assert ns.memory_reserved() == 0
    ns.caching_allocator_enable(numpy.bool_(True))
    ns.caching_allocator_delete(alloc(ns, 100))
    assert ns.memory_reserved() == 2 * MiB


def test_dpnp_arrays_made_in_a_pool(xpu, dpnp):
    xpu.set_allocator()
    try:
        pool = xpu.MemPool()
        with xpu.use_mem_pool(pool):
            inside = dpnp.ones(1024, dtype="f4")
            result = inside + 1               # an operation's result too
        outside = dpnp.ones(1024, dtype="f4")
        in_pool = {b["address"] for s in pool.snapshot() for b in s["blocks"] if b["state"] == "active_allocated"}
        assert inside.get_array().usm_data._pointer in in_pool and result.get_array().usm_data._pointer in in_pool
        assert outside.get_array().usm_data._pointer not in in_pool
        assert float(result.sum()) == 2048.0
        del inside, result, outside
    finally:
        xpu.reset_allocator()
        xpu.synchronize()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_after_fork_another_threads_use_of_a_pool_is_over_in_the_child():
    """Only the forking thread lives on in the child: a parent thread's
    use_mem_pool context will never exit there. Its route stayed: a thread
    the child started got the dead thread's ident (the system reuses it)
    and allocated into the pool, which also kept that use forever."""
    pool = unimem.cpu.MemPool()
    inside, leave = threading.Event(), threading.Event()

    def parent_thread():
        with unimem.cpu.use_mem_pool(pool):
            inside.set()
            leave.wait()

    worker = threading.Thread(target=parent_thread)
    worker.start()
    inside.wait()
    assert pool.use_count() == 2
    def in_the_child():
        seen = []
        child = threading.Thread(target=lambda: seen.append(unimem.cpu.caching_allocator_alloc(4096)))
        child.start()
        child.join()
        pool_of = next(s["segment_pool_id"] for s in unimem.cpu.memory_snapshot()
                       if s["address"] <= seen[0] < s["address"] + s["total_size"])
        return repr((pool_of, pool.use_count()))

    told = answer_of_forked_child(in_the_child)
    leave.set()
    worker.join()
    assert told == repr(((0, 0), 1))
    assert pool.use_count() == 1                         # the parent is as it was


def test_memory_snapshot_takes_pytorchs_include_traces_and_refuses_ids_no_pool_has():
    """torch.cuda's memory_snapshot(mempool_id, include_traces) and
    MemPool.snapshot(include_traces), on the cpu pool (which takes
    torch.cuda's history signatures; torch.xpu's has no include_traces).
    A negative or too large id was an empty list, as if a pool had nothing."""
    pool = unimem.cpu.MemPool()
    with unimem.cpu.use_mem_pool(pool):
        p = unimem.cpu.caching_allocator_alloc(4096)
    try:
        whole = unimem.cpu.memory_snapshot(pool.id)
        assert whole and unimem.cpu.memory_snapshot(pool.id, include_traces=False) == whole
        assert pool.snapshot(include_traces=False) == pool.snapshot()
        for bad, error in (((0, -1), ValueError), ((0, 1 << 64), ValueError), ((0, 1.0), TypeError)):
            with pytest.raises(error):
                unimem.cpu.memory_snapshot(bad)
        for call in (lambda: unimem.cpu.memory_snapshot(pool.id, include_traces="no"),
                     lambda: pool.snapshot(include_traces=None)):
            with pytest.raises(TypeError, match="include_traces must be a bool"):
                call()
        assert "include_traces" not in inspect.signature(unimem.xpu.memory_snapshot).parameters
    finally:
        unimem.cpu.caching_allocator_delete(p)
    assert unimem.accelerator.memory_snapshot(include_traces=False) == unimem.accelerator.memory_snapshot()
    with pytest.raises(TypeError, match="include_traces must be a bool"):
        unimem.accelerator.memory_snapshot(None, 1)


# ---------------------------------------------------------------------------
# a refused allocator takes no id; a snapshot's pool id as a list; a pluggable
# allocator's .allocator(), what MemPool(allocator=...) takes
# ---------------------------------------------------------------------------
def test_a_refused_mempool_takes_no_pool_id():
    first = unimem.cpu.MemPool().id
    for bad in (5, object()):
        with pytest.raises(TypeError):
            unimem.cpu.MemPool(allocator=bad)
    assert unimem.cpu.MemPool().id == (0, first[1] + 1)
    gc.collect()


def test_a_snapshot_takes_a_pool_id_as_a_list():
    """torch's memory_snapshot only indexes mempool_id[0] and [1]: a list (an
    id that went through JSON) names the pool as the tuple does."""
    pool = unimem.cpu.MemPool()
    with unimem.cpu.use_mem_pool(pool):
        ptr = unimem.cpu.caching_allocator_alloc(MiB)
    try:
        listed = unimem.cpu.memory_snapshot(list(pool.id))
        assert listed and listed == unimem.cpu.memory_snapshot(pool.id)
    finally:
        unimem.cpu.caching_allocator_delete(ptr)
        del pool
        gc.collect()
        unimem.cpu.empty_cache()


def test_mempool_takes_a_pluggable_allocators_allocator():
    """Ported code writes MemPool(allocator.allocator()) (torch's
    _CUDAAllocator.allocator() hands out the C allocator)."""
    from unimem.backends._host import PageAlignedBackend
    pages = PageAlignedBackend()
    allocator = PluggableAllocator(pages.malloc, pages.free)
    assert allocator.allocator() is allocator
    pool = unimem.cpu.MemPool(allocator.allocator())
    assert pool.allocator is allocator
    with unimem.cpu.use_mem_pool(pool):
        ptr = unimem.cpu.caching_allocator_alloc(4096)
    assert [s["segment_pool_id"] for s in unimem.cpu.memory_snapshot(pool.id)] == [pool.id]
    unimem.cpu.caching_allocator_delete(ptr)
    del pool
    gc.collect()
    unimem.cpu.empty_cache()
