"""Sleep mode for a private pool with its own allocator (PyTorch's
``MemPool(allocator=...)``; the core's ``create_pool(pool_id, backend)``).

The pool's segments come from its allocator, so they sleep through it:
its ``release_pages``/``restore_pages`` give the memory back and back it
again, its ``copy_to_host``/``copy_from_host`` (or direct copies, when
``host_accessible``) keep the bytes. Before, the device's backend was asked
for all of them: the host backend refused the pool's segments as unknown
(ValueError, with the pool left asleep and nothing given back), a device
backend without page release refused a pool whose allocator could. An
allocator that cannot give memory back is refused up front, nothing changed,
by a pool's sleep and by a whole-device sleep while its pool holds a segment."""
import ctypes

import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.pluggable import PluggableAllocator
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.pool_allocators import PageAllocator, PlainAllocator, in_pool as routed

MiB = 1 << 20
POOL = (0, 1)
SIZES = (700, 300 << 10, 3 * MiB)                     # small pool, large pool, its own segment


def make(device, pool_allocator, whole_device=False):
    """An allocator on the host (``cpu``'s backend) or on a simulated device,
    with pool POOL over ``pool_allocator``. The simulated device gives no
    segment from malloc back; for a whole-device sleep it has expandable
    segments (its own memory sleeps through its virtual memory calls)."""
    if device == "host":
        a = _core.CachingAllocator(PageAlignedBackend(), 0)
    else:
        a = _core.CachingAllocator(SimulatedBackend(), 0, expandable_segments=whole_device)
    a.create_pool(POOL, pool_allocator)
    return a


def in_pool(a, size):
    return routed(a, POOL, size)


def fill(ptr, size, seed):
    data = (bytes((seed * 31 + i * 7) & 0xFF for i in range(251)) * (size // 251 + 1))[:size]
    ctypes.memmove(ptr, data, size)
    return data


def pool_segments(a):
    return {(s["address"], s["total_size"]) for s in a.snapshot(POOL)}


def counters_aside(stats):
    """memory_stats() without what a sleep and wake_up count: the release and
    restore calls, their times and bytes (reserved_bytes.*.freed/allocated)."""
    return {k: v for k, v in stats.items()
            if not k.startswith(("num_device_", "device_alloc_time", "device_free_time", "num_sync_all_streams"))
            and not (k.startswith("reserved_bytes.") and k.endswith((".allocated", ".freed")))}


@pytest.mark.parametrize("device", ["host", "simulated"])
@pytest.mark.parametrize("host_accessible", [True, False])
@pytest.mark.parametrize("whole_device", [False, True])
def test_the_pool_sleeps_through_its_own_allocator_and_keeps_its_bytes(device, host_accessible, whole_device):
    pages = PageAllocator(host_accessible=host_accessible)
    a = make(device, pages, whole_device)
    blocks = {}
    for i, size in enumerate(SIZES):
        ptr = in_pool(a, size)
        blocks[ptr] = fill(ptr, size, i)
    # The device's own memory: real bytes on the host; the simulated device
    # has none to copy (its expandable segments sleep without a live block).
    own = a.malloc(2 * MiB) if device == "host" else None
    if device == "host":
        own_bytes = fill(own, 2 * MiB, 9)
    segments = pool_segments(a)
    before = a.memory_stats()
    del pages.calls[:]

    if whole_device:
        a.sleep()
    else:
        a.sleep_pool(POOL)
    a._check_invariants()
    assert {(addr, size) for name, addr, size in pages.calls if name == "release"} == segments
    assert pages.released == {addr for addr, _ in segments}
    asleep = a.memory_stats()
    in_pool_bytes = sum(size for _, size in segments)
    if whole_device:
        assert asleep["reserved_bytes.all.current"] == 0
    else:
        assert asleep["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] - in_pool_bytes
        if device == "host":
            assert ctypes.string_at(own, 2 * MiB) == own_bytes        # the device's memory is untouched
    assert asleep["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    copied = [name for name in pages.names() if name.startswith("copy")]
    assert copied == ([] if host_accessible else ["copy_to_host"] * len(SIZES))

    a.wake_up() if whole_device else a.wake_up_pool(POOL)
    a._check_invariants()
    assert not pages.released
    assert {(addr, size) for name, addr, size in pages.calls if name == "restore"} == segments
    for ptr, data in blocks.items():
        assert ctypes.string_at(ptr, len(data)) == data
    if device == "host":
        assert ctypes.string_at(own, 2 * MiB) == own_bytes
    assert counters_aside(a.memory_stats()) == counters_aside(before)

    for ptr in list(blocks) + ([own] if own else []):
        a.free(ptr)
    a.empty_cache()
    a.release_pool(POOL)
    a.empty_cache()
    assert not pages.live and a.memory_stats()["reserved_bytes.all.current"] == 0
    a._check_invariants()


@pytest.mark.parametrize("device", ["host", "simulated"])
@pytest.mark.parametrize("whole_device", [False, True])
@pytest.mark.parametrize("kind", ["pluggable", "duck"])
def test_an_allocator_that_cannot_give_memory_back_is_refused_with_nothing_changed(device, whole_device, kind):
    plain = PlainAllocator()
    allocator = PluggableAllocator(plain.malloc, plain.free) if kind == "pluggable" else plain
    a = make(device, allocator, whole_device)
    inside = in_pool(a, 3 * MiB)
    data = fill(inside, 3 * MiB, 4)
    own = a.malloc(MiB)
    before, snapshot = a.memory_stats(), a.snapshot()

    with pytest.raises(NotImplementedError, match=r"memory pool \(0, 1\).*own allocator.*release_pages") as error:
        if whole_device:
            a.sleep()
        else:
            a.sleep_pool(POOL)
    assert type(allocator).__name__ in str(error.value)
    if kind == "duck":
        assert "page_release_unavailable_reason" in str(error.value)
    assert a.memory_stats() == before                      # not even a synchronization counted
    assert a.snapshot() == snapshot
    assert not a.is_sleeping() and not a.is_sleeping(POOL)
    assert plain.pages.names() == ["malloc"]              # its memory was never touched
    assert ctypes.string_at(inside, 3 * MiB) == data
    a._check_invariants()
    a.free(in_pool(a, 4096))                              # allocation into the pool works
    a.free(a.malloc(4096))
    for ptr in (inside, own):
        a.free(ptr)
    a._check_invariants()


def test_a_pool_that_cannot_sleep_and_holds_nothing_does_not_stop_the_device():
    plain = PlainAllocator()
    a = make("host", PluggableAllocator(plain.malloc, plain.free))   # a pool never allocated from
    own = a.malloc(MiB)
    data = fill(own, MiB, 1)
    a.sleep()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    with pytest.raises(NotImplementedError, match=r"memory pool \(0, 1\)"):
        a.sleep_pool(POOL)
    a.wake_up()
    assert ctypes.string_at(own, MiB) == data
    a.free(own)
    a._check_invariants()


@pytest.mark.parametrize("whole_device", [False, True])
def test_offload_needs_copies_from_an_allocator_the_host_cannot_read(whole_device):
    class NoCopies(PageAllocator):
        copy_to_host = None
        copy_from_host = None

    pages = NoCopies(host_accessible=False)
    a = make("simulated", pages, whole_device)
    ptr = in_pool(a, MiB)
    before = a.memory_stats()
    with pytest.raises(NotImplementedError, match=r"memory pool \(0, 1\).*copy_to_host"):
        a.sleep(offload=True) if whole_device else a.sleep_pool(POOL, offload=True)
    assert a.memory_stats() == before and not a.is_sleeping() and not a.is_sleeping(POOL)
    assert not pages.released
    a._check_invariants()
    a.sleep(offload=False) if whole_device else a.sleep_pool(POOL, offload=False)   # without contents it can
    assert pages.released
    a.wake_up() if whole_device else a.wake_up_pool(POOL)
    a.free(ptr)
    a._check_invariants()


@pytest.mark.parametrize("whole_device", [False, True])
def test_the_pool_allocator_re_entering_the_allocator_is_refused_or_handled(whole_device):
    """From release_pages and restore_pages the pool's allocator allocates,
    frees a block of the sleeping pool, and tries to sleep and wake again:
    the sleep calls are refused, the rest works, and nothing is corrupted."""
    pages = PageAllocator()
    a = make("host", pages)
    kept, dropped = in_pool(a, 3 * MiB), in_pool(a, 3 * MiB)
    kept_data = fill(kept, 3 * MiB, 2)
    fill(dropped, 3 * MiB, 3)
    allocated = a.memory_stats()["allocated_bytes.all.current"]
    seen, made, freed, refused = [], [], [], []

    def hook(call):
        seen.append(call)
        try:
            made.append(a.malloc(4096))                    # outside the pool
        except RuntimeError as exc:                        # the whole device sleeps
            assert whole_device and "asleep" in str(exc)
        if call == "release" and not freed:
            a.free(dropped)                                # a block of what sleeps: held
            freed.append(dropped)
        # The sleep under way: asleep already (nothing to do) or refused; the wake_up refused.
        for again in (a.sleep, a.wake_up, lambda: a.sleep_pool(POOL), lambda: a.wake_up_pool(POOL)):
            try:
                again()
            except RuntimeError as exc:
                assert "already under way" in str(exc) or "wake_up() the device" in str(exc)
                refused.append(again)
        with pytest.raises(RuntimeError, match="already under way"):
            a.wake_up() if whole_device else a.wake_up_pool(POOL)
        a.empty_cache()                                    # gives back nothing that sleeps
        a._check_invariants()

    pages.hook = hook
    a.sleep() if whole_device else a.sleep_pool(POOL)
    a._check_invariants()
    a.wake_up() if whole_device else a.wake_up_pool(POOL)
    pages.hook = None
    assert "release" in seen and "restore" in seen and refused
    a._check_invariants()
    assert ctypes.string_at(kept, 3 * MiB) == kept_data
    assert a.memory_stats()["allocated_bytes.all.current"] == allocated - 3 * MiB + 4096 * len(made)
    for ptr in [kept] + made:
        a.free(ptr)
    a.release_pool(POOL)
    a.empty_cache()
    assert not pages.live and a.memory_stats()["reserved_bytes.all.current"] == 0
    a._check_invariants()
