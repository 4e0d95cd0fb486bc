"""Private pools in the core (PyTorch's PrivatePool behind MemPool) and the
cache switch (caching_allocator_enable), on the simulated device and on a
device that refuses memory past a capacity."""
import gc
import threading

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from unimem import OutOfMemoryError, _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.pluggable import PluggableAllocator
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.crash_guard import run_python
from tests.helpers.pool_allocators import PageAllocator, in_pool

MiB = 1 << 20
P1, P2 = (0, 1), (0, 2)


class Device:
    """Raw memory of ``capacity`` bytes; counts its calls."""

    def __init__(self, capacity=1 << 40, start=1 << 40):
        self.capacity, self.used, self.next = capacity, 0, start
        self.mallocs = self.frees = 0
        self.live = {}

    def malloc(self, size, device, stream):
        if self.used + size > self.capacity:
            return 0
        self.used += size
        self.mallocs += 1
        ptr, self.next = self.next, self.next + size
        self.live[ptr] = size
        return ptr

    def free(self, ptr, size, device, stream):
        assert self.live.pop(ptr) == size
        self.used -= size
        self.frees += 1


def allocator(device=None):
    device = device or Device()
    return _core.CachingAllocator(PluggableAllocator(device.malloc, device.free), 0), device




def pool_of_block(a, ptr):
    for s in a.snapshot():
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return s["segment_pool_id"]
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_routing_and_return_to_pool():
    a, _ = allocator()
    outside = a.malloc(MiB)
    a.create_pool(P1)
    inside = in_pool(a, P1, MiB)
    after = a.malloc(MiB)
    assert pool_of_block(a, inside) == P1
    assert pool_of_block(a, outside) == pool_of_block(a, after) == (0, 0)
    # freed after the context, the block goes back to the pool: the next
    # request in the pool takes it, a default request does not
    a.free(inside)
    other = a.malloc(MiB)
    assert pool_of_block(a, other) == (0, 0)
    again = in_pool(a, P1, MiB)
    assert again == inside
    # the pool's blocks count in the device's statistics
    assert a.memory_allocated() == 4 * MiB
    assert len(a.snapshot(P1)) == 1 and len(a.snapshot()) == 3   # 2 of the device's own
    a._check_invariants()


def test_nested_pools_restore_the_outer_one():
    a, _ = allocator()
    a.create_pool(P1)
    a.create_pool(P2)
    a.begin_pool(P1)
    first = a.malloc(20 * MiB)
    second = in_pool(a, P2, 20 * MiB)
    third = a.malloc(20 * MiB)
    a.end_pool(P1)
    assert [pool_of_block(a, p) for p in (first, second, third)] == [P1, P2, P1]
    assert (len(a.snapshot(P1)), len(a.snapshot(P2))) == (2, 1)
    assert a.pool_use_count(P1) == a.pool_use_count(P2) == 1


def test_only_the_routing_thread_allocates_from_the_pool():
    a, _ = allocator()
    a.create_pool(P1)
    a.begin_pool(P1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(a.malloc(MiB)))
    thread.start()
    thread.join()
    mine = a.malloc(MiB)
    a.end_pool(P1)
    assert pool_of_block(a, seen[0]) == (0, 0)
    assert pool_of_block(a, mine) == P1


def test_use_count_is_the_pool_plus_each_context():
    a, _ = allocator()
    assert a.pool_use_count(P1) == 0
    a.create_pool(P1)
    assert a.pool_use_count(P1) == 1
    a.begin_pool(P1)
    a.begin_pool(P1)
    assert a.pool_use_count(P1) == 3
    a.end_pool(P1)
    a.end_pool(P1)
    assert a.pool_use_count(P1) == 1
    a.release_pool(P1)
    assert a.pool_use_count(P1) == 0


def test_empty_cache_keeps_a_live_pool_and_releases_a_dead_one():
    a, device = allocator()
    a.create_pool(P1)
    a.begin_pool(P1)
    kept = a.malloc(MiB)
    spare = a.malloc(30 * MiB)
    a.end_pool(P1)
    a.free(spare)
    a.empty_cache()
    assert len(a.snapshot(P1)) == 2            # a live pool keeps its memory
    a.release_pool(P1)                          # the MemPool died: its free segment goes at once
    assert len(a.snapshot(P1)) == 1
    assert device.frees == 1
    a.free(kept)                                # freed later: back to the dead pool ...
    assert len(a.snapshot(P1)) == 1
    a.empty_cache()                             # ... until the next empty_cache
    assert a.snapshot() == [] and device.used == 0
    a._check_invariants()
    with pytest.raises(ValueError, match="not a live pool"):
        a.begin_pool(P1)                        # the pool is gone


def test_pool_memory_counts_against_the_device_limit():
    a, _ = allocator(Device(capacity=60 * MiB))
    a.create_pool(P1)
    held = in_pool(a, P1, 40 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(40 * MiB)
    a.free(held)
    with pytest.raises(OutOfMemoryError):       # a live pool's free memory is not released
        a.malloc(40 * MiB)
    a.release_pool(P1)
    a.free(a.malloc(40 * MiB))


def test_use_on_oom_pools_serve_a_request_about_to_fail():
    # PyTorch's test_mempool_limited_memory_with_allocator, in bytes
    a, _ = allocator(Device(capacity=80 * MiB))
    a.create_pool(P1)                           # do not use
    a.create_pool(P2, use_on_oom=True)
    x = in_pool(a, P1, 40 * MiB)
    y = in_pool(a, P2, 40 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(40 * MiB)
    a.free(x)
    a.free(y)
    c = a.malloc(30 * MiB)
    assert c == y and pool_of_block(a, c) == P2
    ooms = a.memory_stats()["num_ooms"]
    with pytest.raises(OutOfMemoryError):       # P1 is no fallback
        a.malloc(30 * MiB)
    assert a.memory_stats()["num_ooms"] == ooms + 1
    a.free(c)
    e = in_pool(a, P2, 20 * MiB)
    assert e == y
    a.free(e)
    a.release_pool(P2)                          # a dead pool is no fallback any more
    a._check_invariants()


def test_a_released_use_on_oom_pool_is_not_used():
    a, _ = allocator(Device(capacity=40 * MiB))
    a.create_pool(P1, use_on_oom=True)
    a.begin_pool(P1)                           # a context keeps the pool alive ...
    a.free(a.malloc(40 * MiB))
    outcome = []

    def other_thread():                        # not routed: the device's own pools
        try:
            outcome.append(a.malloc(20 * MiB))
        except OutOfMemoryError as error:
            outcome.append(error)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert pool_of_block(a, outcome[0]) == P1     # the fallback while the MemPool lives
    a.free(outcome.pop())
    a.release_pool(P1)                         # ... but its MemPool died: no fallback
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert isinstance(outcome[0], OutOfMemoryError)
    a.end_pool(P1)
    a._check_invariants()


def test_no_split_hands_out_whole_blocks():
    a, _ = allocator()
    a.create_pool(P1)
    a.create_pool(P2, no_split=True)
    for pool in (P1, P2, P1, P2):
        a.begin_pool(pool)
        a.malloc(4 * MiB)
        a.end_pool(pool)
    split, whole = a.snapshot(P1), a.snapshot(P2)
    assert len(whole) == 2 > len(split) == 1
    assert all(len(s["blocks"]) == 1 for s in whole)
    assert sum(len(s["blocks"]) for s in whole) < sum(len(s["blocks"]) for s in split)
    assert a.memory_stats()["requested_bytes.all.current"] == 16 * MiB
    a._check_invariants()


def test_a_pool_with_its_own_allocator():
    a, device = allocator()
    own = Device(start=1 << 44)
    a.create_pool(P1, PluggableAllocator(own.malloc, own.free))
    p = in_pool(a, P1, MiB)
    assert own.mallocs == 1 and device.mallocs == 0 and p >= 1 << 44
    a.free(p)
    a.release_pool(P1)
    assert own.frees == 1 and own.used == 0


def test_a_pool_allocator_that_allocates_from_the_allocator():
    """Reentrancy: the pool's malloc (Python) calls the same allocator."""
    a, device = allocator()
    inner, calls = [], []

    def malloc(size, dev, stream):
        if not calls:
            calls.append(size)
            inner.append(a.malloc(1000))      # this thread is routed to the pool
        return device.malloc(size, dev, stream)

    a.create_pool(P1, PluggableAllocator(malloc, device.free))
    p = in_pool(a, P1, MiB)
    assert pool_of_block(a, p) == P1 and pool_of_block(a, inner[0]) == P1
    a._check_invariants()


def test_a_finalizer_releasing_a_pool_during_an_allocation():
    """A MemPool dying in a cycle, collected inside the allocator's own
    call (a pool allocator's malloc): its use count drops at once, its
    memory waits for the next empty_cache."""
    a3, dev3 = allocator()
    a3.create_pool(P1)
    a3.begin_pool(P1)
    a3.free(a3.malloc(MiB))
    a3.end_pool(P1)
    state = {}

    class Dying:
        def __del__(self):
            a3.release_pool(P1)

    def finalizing_malloc(size, dev, stream):
        d = Dying()
        d.cycle = d
        del d
        gc.collect()
        state["pools during malloc"] = a3.pool_use_count(P1)
        return dev3.malloc(size, dev, stream)

    a3.create_pool(P2, PluggableAllocator(finalizing_malloc, dev3.free))
    a3.begin_pool(P2)
    a3.malloc(MiB)
    a3.end_pool(P2)
    assert state["pools during malloc"] == 0
    a3._check_invariants()
    a3.empty_cache()                            # the dead pool's memory went at the next empty_cache
    assert a3.snapshot(P1) == []
    a3._check_invariants()


def test_bad_input_changes_nothing():
    a, _ = allocator()
    with pytest.raises(TypeError):
        a.create_pool(42)
    with pytest.raises(TypeError):
        a.create_pool((0, "1"))
    with pytest.raises(ValueError):
        a.create_pool((0, 0))
    with pytest.raises(ValueError):
        a.create_pool((3, 0))
    with pytest.raises(TypeError):
        a.create_pool(P1, backend=object())
    a.create_pool(P1)
    with pytest.raises(ValueError, match="already exists"):
        a.create_pool(P1)
    with pytest.raises(ValueError):
        a.begin_pool(P2)
    with pytest.raises(ValueError, match="no thread is allocating from"):
        a.end_pool(P1)
    with pytest.raises(ValueError):
        a.release_pool(P2)
    assert a.pool_use_count(P1) == 1
    p = a.malloc(MiB)                           # not routed
    assert pool_of_block(a, p) == (0, 0)
    a._check_invariants()


def test_cache_off_every_allocation_and_free_reaches_the_backend():
    a, device = allocator()
    cached = a.malloc(MiB)
    a.free(cached)
    assert a.caching
    a.set_caching(False)
    assert not a.caching and device.used == 0      # what was cached went back
    p = a.malloc(1000)
    q = a.malloc(1000)
    assert device.mallocs == 3 and device.live[p] == 1024
    assert a.memory_stats()["allocated_bytes.all.current"] == 2048
    assert a.memory_reserved() == 2048
    a.free(p)
    assert device.frees == 2 and a.memory_reserved() == 1024
    assert a.memory_stats()["num_device_free"] == 2
    a.set_caching(True)
    a.free(q)
    assert a.memory_reserved() == 1024             # cached again
    a._check_invariants()


def test_cache_off_uses_no_pool():
    a, device = allocator()
    a.create_pool(P1)
    a.set_caching(False)
    p = in_pool(a, P1, 1000)
    assert pool_of_block(a, p) == (0, 0)
    a.free(p)
    assert device.used == 0


class PoolMachine(RuleBasedStateMachine):
    """Allocations in the device's pools and two private pools, frees,
    releases and empty_cache, in any order: the allocator stays consistent,
    each block stays in its pool's segments, and nothing leaks."""

    def __init__(self):
        super().__init__()
        self.device = Device(capacity=400 * MiB)
        self.a = _core.CachingAllocator(PluggableAllocator(self.device.malloc, self.device.free), 0)
        self.live = {}                 # ptr -> pool id
        self.alive = set()
        self.next_id = 1
        self.stack = []

    @rule(use_on_oom=st.booleans(), no_split=st.booleans())
    def create(self, use_on_oom, no_split):
        pool = (0, self.next_id)
        self.next_id += 1
        self.a.create_pool(pool, use_on_oom=use_on_oom, no_split=no_split)
        self.alive.add(pool)

    @precondition(lambda self: self.alive)
    @rule(data=st.data())
    def begin(self, data):
        pool = data.draw(st.sampled_from(sorted(self.alive)))
        self.a.begin_pool(pool)
        self.stack.append(pool)

    @precondition(lambda self: self.stack)
    @rule()
    def end(self):
        self.a.end_pool(self.stack.pop())

    @precondition(lambda self: self.alive)
    @rule(data=st.data())
    def release(self, data):
        pool = data.draw(st.sampled_from(sorted(self.alive)))
        self.a.release_pool(pool)
        self.alive.discard(pool)

    @rule(size=st.sampled_from([1, 1000, 600 * 1024, 3 * MiB, 12 * MiB, 30 * MiB]))
    def malloc(self, size):
        try:
            p = self.a.malloc(size)
        except OutOfMemoryError:
            return
        pool = pool_of_block(self.a, p)
        expected = self.stack[-1] if self.stack else (0, 0)
        if pool != expected:           # only a use_on_oom fallback may differ
            assert expected == (0, 0) and pool in self.alive
        self.live[p] = pool

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        p = data.draw(st.sampled_from(sorted(self.live)))
        assert pool_of_block(self.a, p) == self.live.pop(p)
        self.a.free(p)

    @rule()
    def empty_cache(self):
        self.a.empty_cache()
        for segment in self.a.snapshot():
            pool = segment["segment_pool_id"]
            in_use = pool in self.alive or pool in self.stack
            assert pool == (0, 0) or in_use or segment["allocated_size"] > 0

    @invariant()
    def consistent(self):
        self.a._check_invariants()
        assert self.device.used == self.a.memory_reserved()

    def teardown(self):
        for p in list(self.live):
            self.a.free(p)
        while self.stack:
            self.a.end_pool(self.stack.pop())
        for pool in list(self.alive):
            self.a.release_pool(pool)
        self.a.empty_cache()
        assert self.a.snapshot() == [] and self.device.used == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_inactive_split_counts_a_pool_block_in_an_expandable_allocator():
    """A MemPool's segments are plain even with expandable segments on, so
    their free split blocks count in inactive_split (PyTorch leaves out only
    the blocks of expandable segments); the allocator used to ask whether the
    allocator, not the block's segment, was expandable."""
    a = _core.CachingAllocator(PageAlignedBackend(), 0, expandable_segments=True)
    a.create_pool((0, 1))
    a.begin_pool((0, 1))
    first, second = a.malloc(1 << 20), a.malloc(1 << 20)
    a.end_pool((0, 1))
    a.free(first)
    assert a.memory_stats()["inactive_split.all.current"] == 1
    a._check_invariants()
    a.free(second)
    assert a.memory_stats()["inactive_split.all.current"] == 0
    a._check_invariants()
    a.release_pool((0, 1))
    a.empty_cache()
    a._check_invariants()


@pytest.mark.parametrize("stream", [0, 5])
def test_a_pool_request_that_fails_leaves_no_free_index_behind(stream):
    """A routed request failing on a stream where the pool has no segment
    made the pool's free indexes of that stream and kept them, one table per
    failure (_check_invariants failed)."""
    a = _core.CachingAllocator(SimulatedBackend(capacity=256 * MiB), 0)
    a.set_capacity(256 * MiB)
    a.create_pool(P1, None, False, False)
    a.begin_pool(P1)
    try:
        for _ in range(3):
            with pytest.raises(OutOfMemoryError):
                a.malloc(300 * MiB, stream)
        a._check_invariants()
        p = a.malloc(1 * MiB, stream)          # the pool still serves the stream
        a.free(p)
        a._check_invariants()
    finally:
        a.end_pool(P1)


class HookedDevice(Device):
    """A Device whose free runs ``hook`` once (Python run while the
    allocator let its lock go around the backend call)."""
    hook = None

    def free(self, ptr, size, device, stream):
        super().free(ptr, size, device, stream)
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()


REQUEST_OUTLIVING_ITS_POOL = """
from unimem import _core
from unimem.backends.pluggable import PluggableAllocator
from tests.core.pools.test_private_pools import HookedDevice, MiB, P1
dev = HookedDevice(capacity=24 * MiB)
a = _core.CachingAllocator(PluggableAllocator(dev.malloc, dev.free), 0)
a.free(a.malloc(4 * MiB))           # a cached 20 MiB segment of the device's own pools
a.create_pool(P1)
a.begin_pool(P1)
ended = []
def end_the_pool():                 # a generator inside use_mem_pool, collected just then
    a.end_pool(P1)
    a.release_pool(P1)
    junk = [bytearray(64) for _ in range(10000)]     # reuse the freed memory, if any
    ended.append(a.pool_use_count(P1))
dev.hook = end_the_pool
p = a.malloc(4 * MiB)               # routed to P1: misses, the retry frees the cached segment
assert ended == [1], ended          # the request's own use kept the pool alive
assert [s["segment_pool_id"] for s in a.snapshot()] == [P1]
assert a.pool_use_count(P1) == 0    # and let it go when done
a._check_invariants()
a.free(p)
a.empty_cache()
assert a.memory_reserved() == 0 and dev.used == 0, (a.memory_reserved(), dev.used)
a._check_invariants()
print("PASSED")
"""


def test_a_pool_ended_by_a_backend_call_during_its_own_request_outlives_the_request():
    """The pool a routed request allocates from stays while the request runs:
    the retry's backend free (Python, the lock let go) may end the thread's
    use_mem_pool and the MemPool. It was freed under the request (SIGSEGV)."""
    run_python(REQUEST_OUTLIVING_ITS_POOL)


EMPTY_CACHE_BY_A_FINALIZER_DURING_A_POOLS_RELEASE = r"""
import ctypes, gc, sys
import unimem.cpu as m
import unimem
K = int(sys.argv[1]) if len(sys.argv) > 1 else %d
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
alloc = unimem.PluggableAllocator(lambda s, d, st: libc.malloc(s) or 0, lambda p, s, d, st: libc.free(p))
pool = m.MemPool(allocator=alloc)
with m.use_mem_pool(pool):
    blocks = [m.caching_allocator_alloc(30 << 20) for _ in range(4)]     # 4 segments of the pool
for b in blocks:
    m.caching_allocator_delete(b)
fired, armed = [0], [False]
class Cleanup:                        # in a cycle: the collector finalizes it
    def __init__(self):
        self.me = self
    def __del__(self):
        if not armed[0]:
            return
        fired[0] += 1
        if fired[0] < K:
            Cleanup()                 # found by a later collection
        elif fired[0] == K:
            m.empty_cache()
gc.collect(); Cleanup(); armed[0] = True
gc.set_threshold(1)                   # a collection at every object made
del pool                              # its free segments go back: the collections land in the release
armed[0] = False; gc.set_threshold(700)
assert fired[0] >= K, fired
assert m.memory_reserved() == 0, m.memory_reserved()
print("PASSED")
"""


@pytest.mark.parametrize("finalizers", [1, 3, 4])
def test_a_finalizer_emptying_the_cache_while_a_dead_pool_is_released(finalizers):
    """A collection run while a dead MemPool's segments were being given back
    (a Python object made with the victims chosen but still linked) let a
    finalizer's empty_cache release the same segments first: the release
    then used freed Segments (SIGSEGV with 3 or 4 finalizers in the chain)."""
    run_python(EMPTY_CACHE_BY_A_FINALIZER_DURING_A_POOLS_RELEASE % finalizers, env={"UNIMEM_DEVICE": "cpu"})


class FullPageAllocator(PageAllocator):
    """PageAllocator (which can sleep) holding ``capacity`` bytes, whose free
    runs ``free_hook`` once."""
    capacity = 45 * MiB
    free_hook = None

    def malloc(self, size, device, stream):
        if sum(self.live.values()) + size > self.capacity:
            return 0
        return super().malloc(size, device, stream)

    def free(self, ptr, size, device, stream):
        super().free(ptr, size, device, stream)
        if self.free_hook is not None:
            hook, self.free_hook = self.free_hook, None
            hook()


@pytest.mark.parametrize("whole_device", [True, False])
def test_a_sleep_during_a_requests_retry_refuses_the_new_segment(whole_device):
    """sleep() run by the retry's backend free (the lock let go) came before
    the new segment: the request is refused, as any request while asleep,
    and nothing is reserved while asleep. It used to get a new segment."""
    backend = FullPageAllocator()
    a = _core.CachingAllocator(backend, 0)
    keep = a.malloc(12 * MiB)                  # 20 MiB segment, live
    a.free(a.malloc(15 * MiB))                 # 16 MiB segment, cached
    if not whole_device:                       # the request goes to a pool
        a.create_pool(P1)
        a.begin_pool(P1)
    backend.free_hook = (lambda: a.sleep(offload=True)) if whole_device else (lambda: a.sleep_pool(P1))
    with pytest.raises(RuntimeError, match="asleep"):
        a.malloc(22 * MiB)                     # misses; the retry frees the cached segment: sleep()
    assert backend.free_hook is None           # (the sleep did run in the retry)
    a._check_invariants()
    if whole_device:
        assert a.is_sleeping() and a.memory_reserved() == 0
        a.wake_up()
    else:
        a.wake_up_pool(P1)
        a.end_pool(P1)
    a.free(keep)
    a._check_invariants()


def test_a_use_begun_on_one_thread_may_end_on_another():
    """PyTorch's endAllocateToPool ends a use of the pool whatever thread
    began it: a use_mem_pool context in a generator started on a worker and
    closed on the main thread. It was a ValueError that left the worker's
    route (and the pool's use) behind."""
    a, _ = allocator()
    a.create_pool(P1)
    worker = threading.Thread(target=lambda: a.begin_pool(P1))
    worker.start()
    worker.join()
    assert a.pool_use_count(P1) == 2
    a.begin_pool(P1)                       # this thread's own use is ended first
    a.end_pool(P1)
    assert pool_of_block(a, a.malloc(MiB)) == (0, 0)
    assert a.pool_use_count(P1) == 2
    a.end_pool(P1)                         # the worker's
    assert a.pool_use_count(P1) == 1
    with pytest.raises(ValueError, match="no thread is allocating from memory pool"):
        a.end_pool(P1)
    assert a.pool_use_count(P1) == 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(a.malloc(MiB)))
    thread.start()
    thread.join()
    assert pool_of_block(a, seen[0]) == (0, 0)
    a._check_invariants()


def test_use_mem_pool_closed_on_another_thread():
    """The front's use_mem_pool, suspended in a generator on a worker thread
    and closed on this one."""
    import unimem.cpu

    pool = unimem.cpu.MemPool()

    def allocating():
        with unimem.cpu.use_mem_pool(pool):
            yield unimem.cpu.caching_allocator_alloc(4096)

    gen = allocating()
    out = []
    worker = threading.Thread(target=lambda: out.append(next(gen)))
    worker.start()
    worker.join()
    assert pool.use_count() == 2
    gen.close()
    assert pool.use_count() == 1
    unimem.cpu.caching_allocator_delete(out[0])
