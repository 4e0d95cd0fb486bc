"""Sleep mode where it meets private pools, expandable segments and other
threads: a private pool's segments on a
backend that sleeps only through expandable segments, a pool put to sleep
while the device sleeps, two threads sleeping or waking at once, and a
segment filter that fails."""
import ctypes
import threading
import time

import pytest

from unimem import _core
from unimem.backends.base import Backend, forward_to_inner
from unimem.backends.cuda import CUDABackend
from unimem.backends._host import PageAlignedBackend

from tests.helpers.fake_cuda import FakeCudaDriver, FakeCudaRuntime
from tests.helpers.pool_allocators import in_pool

MiB = 1 << 20
POOL = (0, 1)


def stats(allocator):
    """memory_stats() less num_sync_all_streams (a refused sleep has waited)."""
    out = allocator.memory_stats()
    del out["num_sync_all_streams"]
    return out


def pool_block(allocator, size):
    return in_pool(allocator, POOL, size)


def cuda_expandable_with_a_pool():
    runtime = FakeCudaRuntime(devices=1, capacity=1 << 30)
    runtime.memcpy = lambda dst, src, size, kind: None
    allocator = _core.CachingAllocator(CUDABackend(runtime, driver=FakeCudaDriver(runtime)), 0,
                                       expandable_segments=True)
    allocator.create_pool(POOL)
    return allocator, [pool_block(allocator, MiB), allocator.malloc(3 * MiB)]


@pytest.mark.parametrize("whole_device", [True, False])
def test_a_pool_segment_cuda_cannot_give_back_is_refused_before_anything_sleeps(whole_device):
    """With expandable segments a MemPool's segments still come from
    cudaMalloc: sleep used to give back the expandable ranges, then fail on
    the pool's segment with the allocator left asleep (or the pool marked
    asleep) and an error telling to set expandable_segments:True."""
    allocator, ptrs = cuda_expandable_with_a_pool()
    before = stats(allocator)
    with pytest.raises(NotImplementedError, match=r"memory pool \(0, 1\).*not an expandable segment"):
        if whole_device:
            allocator.sleep()
        else:
            allocator.sleep_pool(POOL)
    assert not allocator.is_sleeping() and not allocator.is_sleeping(POOL)
    assert stats(allocator) == before
    allocator._check_invariants()
    for ptr in ptrs:                                 # allocation and free work as before
        allocator.free(ptr)
    allocator.free(pool_block(allocator, 1000))
    allocator._check_invariants()


def test_the_device_without_pools_still_sleeps_on_cuda_expandable():
    allocator, ptrs = cuda_expandable_with_a_pool()
    allocator.free(ptrs[0])
    allocator.release_pool(POOL)
    allocator.empty_cache()                          # the dead pool's segment goes
    allocator.sleep()
    assert allocator.memory_reserved() == 0
    allocator.wake_up()
    allocator.free(ptrs[1])
    allocator._check_invariants()


def test_a_pool_cannot_be_put_to_sleep_inside_the_device_sleep():
    """The device's sleep holds the pool's segments: a pool sleep started
    then used to leave the pool 'asleep' with its memory back after the
    device's wake_up."""
    allocator = _core.CachingAllocator(PageAlignedBackend(), 0)
    allocator.create_pool(POOL)
    ptr = pool_block(allocator, 3 * MiB)
    ctypes.memset(ptr, 7, 3 * MiB)
    allocator.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        allocator.sleep_pool(POOL)
    assert not allocator.is_sleeping(POOL)
    allocator.wake_up()
    assert allocator.memory_reserved() > 0 and ctypes.string_at(ptr, 3 * MiB) == b"\7" * (3 * MiB)
    # the other order works, and so does waking in either order
    allocator.sleep_pool(POOL)
    allocator.sleep()
    allocator.sleep_pool(POOL)                       # asleep already: nothing to do
    allocator.wake_up_pool(POOL)
    assert allocator.is_sleeping() and ctypes.string_at(ptr, 3 * MiB) == b"\7" * (3 * MiB)
    with pytest.raises(RuntimeError, match="asleep"):
        allocator.malloc(10)
    allocator.wake_up()
    allocator.free(ptr)
    allocator._check_invariants()


def test_a_segments_filter_that_raises_leaves_the_allocator_awake():
    allocator = _core.CachingAllocator(PageAlignedBackend(), 0)
    ptr = allocator.malloc(MiB)
    before = stats(allocator)

    def refuse(address, size, stream):
        raise ValueError("no")
    with pytest.raises(ValueError):
        allocator.sleep(segments=refuse)
    assert not allocator.is_sleeping()
    assert stats(allocator) == before
    allocator.free(ptr)
    allocator._check_invariants()


@forward_to_inner(intercepted={"synchronize", "restore_pages"})
class Slow(Backend):
    """Its synchronize and restore_pages take ``delay`` seconds, after
    setting ``entered``: another thread gets to run meanwhile."""

    def __init__(self, inner, delay=0.2):
        self.inner = inner
        self.delay = delay
        self.entered = threading.Event()

    def synchronize(self, device):
        self.entered.set()
        time.sleep(self.delay)

    def restore_pages(self, address, size, device):
        self.entered.set()
        time.sleep(self.delay)
        self.inner.restore_pages(address, size, device)


def run_two(allocator, backend, call):
    """``call`` in a thread, and again here once the thread is in the backend."""
    errors = []

    def first():
        try:
            call()
        except Exception as exc:                     # reported below
            errors.append(exc)
    thread = threading.Thread(target=first)
    backend.entered.clear()
    thread.start()
    assert backend.entered.wait(10)
    try:
        call()
    except Exception as exc:
        errors.append(exc)
    thread.join()
    return errors


def test_two_threads_putting_the_device_to_sleep_at_once():
    """Both used to pass the 'asleep already' check before either took the
    lock: the second sleep replaced the first's state, whose memory then
    never came back."""
    backend = Slow(PageAlignedBackend())
    allocator = _core.CachingAllocator(backend, 0)
    ptr = allocator.malloc(3 * MiB)
    ctypes.memset(ptr, 5, 3 * MiB)
    reserved = allocator.memory_reserved()
    assert run_two(allocator, backend, allocator.sleep) == []
    assert allocator.memory_reserved() == 0
    backend.delay = 0
    allocator.wake_up()
    assert not allocator.is_sleeping() and allocator.memory_reserved() == reserved
    assert ctypes.string_at(ptr, 3 * MiB) == b"\5" * (3 * MiB)
    allocator._check_invariants()
    allocator.free(ptr)


def test_two_threads_waking_the_device_at_once():
    """The second used to be refused as 'called again from within a backend call'."""
    backend = Slow(PageAlignedBackend())
    allocator = _core.CachingAllocator(backend, 0)
    ptr = allocator.malloc(3 * MiB)
    reserved = allocator.memory_reserved()
    allocator.sleep()
    assert run_two(allocator, backend, allocator.wake_up) == []
    assert not allocator.is_sleeping() and allocator.memory_reserved() == reserved
    allocator._check_invariants()
    allocator.free(ptr)


@forward_to_inner({"malloc", "_raw_api"})
class _SleepingInMalloc(Backend):
    """The cpu pool's backend with its malloc through Python, which may run
    a callback first (as a finalizer run there would)."""
    _raw_api = None

    def __init__(self):
        self.inner = PageAlignedBackend()
        self.before_malloc = None

    def malloc(self, size, device=0, stream=0):
        callback, self.before_malloc = self.before_malloc, None
        if callback is not None:
            callback()
        return self.inner.malloc(size, device, stream)


def test_a_sleep_made_by_the_backends_malloc_refuses_the_request():
    """sleep() run by Python inside the backend call of a cache miss: the
    request is refused and its new memory given back, as any request is while
    asleep, and reserved memory reads 0 until wake_up."""
    backend = _SleepingInMalloc()
    allocator = _core.CachingAllocator(backend, 0)
    kept = allocator.malloc(1000)
    ctypes.memset(kept, 7, 1000)
    backend.before_malloc = allocator.sleep
    with pytest.raises(RuntimeError, match="asleep"):
        allocator.malloc(30 * MiB)
    assert allocator.is_sleeping()
    assert allocator.memory_reserved() == 0
    assert allocator.memory_stats()["allocation.all.current"] == 1
    allocator.wake_up()
    allocator._check_invariants()
    assert ctypes.string_at(kept, 4) == b"\x07" * 4
    allocator.free(kept)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0


@pytest.mark.parametrize("expandable", [False, True])
def test_waking_a_pool_is_held_to_the_memory_limit(expandable):
    """The room a pool's sleep gave back went to the device meanwhile: waking
    it would have passed the limit (80 MiB reserved with 64 allowed, every
    later allocation refused). It raises, the pool stays asleep and nothing
    changed; once there is room it wakes with its bytes."""
    backend = PageAlignedBackend()
    a = _core.CachingAllocator(backend, 0, expandable_segments=expandable)
    a.set_memory_limit(64 * MiB)
    pool_id = (0, 1)
    a.create_pool(pool_id, None, False, False)
    a.begin_pool(pool_id)
    kept = a.malloc(40 * MiB)
    a.end_pool(pool_id)
    ctypes.memset(kept, 0x5A, 40 * MiB)
    a.sleep_pool(pool_id)
    device = a.malloc(40 * MiB)
    before = stats(a)
    with pytest.raises(_core.OutOfMemoryError, match="memory limit"):
        a.wake_up_pool(pool_id)
    assert a.is_sleeping(pool_id)
    assert stats(a) == {**before, "num_ooms": before["num_ooms"] + 1}
    assert a.memory_reserved() <= 64 * MiB
    a._check_invariants()
    a.free(device)
    a.empty_cache()
    a.wake_up_pool(pool_id)
    assert not a.is_sleeping(pool_id)
    assert ctypes.string_at(kept, 40 * MiB) == b"\x5a" * (40 * MiB)
    a.free(kept)
    a._check_invariants()


@pytest.mark.parametrize("expandable", [False, True])
def test_a_refused_pool_wake_backs_none_of_its_segments(expandable):
    """A pool of two segments whose whole wake passes the limit, though its
    small segment alone fits: the small one was backed again before the
    large one was refused. The refused wake_up changed reserved memory and
    num_device_alloc, the pool stayed asleep with those bytes unusable, and
    a device allocation that fitted before it was then refused. Nothing
    changes now but the out-of-memory count, and the observers hear of it."""
    a = _core.CachingAllocator(PageAlignedBackend(), 0, expandable_segments=expandable)
    a.set_memory_limit(60 * MiB)
    pool_id = (0, 1)
    a.create_pool(pool_id, None, False, False)
    a.begin_pool(pool_id)
    large = a.malloc(8 * MiB)
    small = a.malloc(1000)
    a.end_pool(pool_id)
    ctypes.memset(large, 0x11, 8 * MiB)
    ctypes.memset(small, 0x22, 1000)
    a.sleep_pool(pool_id)
    device = a.malloc(a.get_memory_limit() - a.memory_reserved() - 3 * MiB)
    before = stats(a)
    told = []
    a.add_oom_observer(lambda *args: told.append(args))
    with pytest.raises(_core.OutOfMemoryError, match="nothing changed"):
        a.wake_up_pool(pool_id)
    assert a.is_sleeping(pool_id)
    assert stats(a) == {**before, "num_ooms": before["num_ooms"] + 1}
    assert len(told) == 1 and told[0][1] > 3 * MiB
    a._check_invariants()
    extra = a.malloc(1000)                       # fitted before the refused wake, fits after it
    a.free(extra)
    a.free(device)
    a.empty_cache()
    a.wake_up_pool(pool_id)
    assert ctypes.string_at(large, 8 * MiB) == b"\x11" * (8 * MiB)
    assert ctypes.string_at(small, 1000) == b"\x22" * 1000
    a.free(large)
    a.free(small)
    a._check_invariants()


def test_a_whole_device_sleep_stays_in_force_while_another_tags_ends():
    """Two whole-device sleeps under two tags: ending one let allocation go on
    (and reserve new memory) while the other still held the device asleep."""
    a = _core.CachingAllocator(PageAlignedBackend(), 0)
    kept = a.malloc(MiB)
    ctypes.memset(kept, 5, MiB)
    a.sleep(True, None, "x")
    a.sleep(True)
    a.wake_up()
    assert a.is_sleeping("x")
    before = stats(a)
    with pytest.raises(RuntimeError, match="asleep"):
        a.malloc(1000)
    assert stats(a) == before
    a.wake_up("x")
    assert ctypes.string_at(kept, 4) == b"\x05" * 4
    a.free(a.malloc(1000))
    a.free(kept)
    a._check_invariants()


def test_a_whole_device_sleep_wakes_under_a_limit_lowered_before_it():
    """A limit set below what the device holds (allowed, as PyTorch's
    fraction) must not keep a whole-device sleep from waking: nothing else
    could have taken its room, and with allocation refused nothing could
    make room."""
    a = _core.CachingAllocator(PageAlignedBackend(), 0)
    kept = a.malloc(80 * MiB)
    ctypes.memset(kept, 7, 80 * MiB)
    a.set_memory_limit(64 * MiB)
    a.sleep()
    a.wake_up()
    assert not a.is_sleeping()
    assert ctypes.string_at(kept + 80 * MiB - 4, 4) == b"\x07" * 4
    a.free(kept)
    a._check_invariants()
