"""A private pool whose last use ends (its MemPool dies) while it sleeps.

Nobody can wake it any more, so its sleep ends there: the segments with a
block still in use wake up (restore, copy back; a pool's blocks outlive its
MemPool, as in PyTorch), the wholly free ones go back to the backend without
being backed again, and whatever is left goes at a later empty_cache. Nothing
stays reserved, held or counted for good."""
import ctypes

import pytest

from unimem import _core
from unimem.backends.base import Backend, forward_to_inner
from tests.helpers.crash_guard import run_python
from unimem.backends._host import PageAlignedBackend

MiB = 1 << 20
POOL = (0, 1)


@forward_to_inner(intercepted={"restore_pages"})
class Counting(Backend):
    """Counts restore_pages; ``on_restore()`` runs first (it may raise or re-enter)."""

    def __init__(self, inner):
        self.inner = inner
        self.restores = 0
        self.on_restore = lambda: None

    def restore_pages(self, address, size, device):
        self.on_restore()
        self.restores += 1
        self.inner.restore_pages(address, size, device)


def setup(debug=False):
    backend = Counting(PageAlignedBackend())
    allocator = _core.CachingAllocator(backend, 0)
    if debug:
        allocator.enable_debug()
    outside = allocator.malloc(MiB)                   # the device's own memory stays
    allocator.create_pool(POOL)
    allocator.begin_pool(POOL)
    try:
        blocks = [allocator.malloc(n) for n in (3 * MiB, 12 * MiB, 40 * MiB)]
    finally:
        allocator.end_pool(POOL)
    return allocator, backend, outside, blocks


def baseline(allocator):
    stats = allocator.memory_stats()
    return {key: stats[key] for key in ("reserved_bytes.all.current", "segment.all.current",
                                        "allocated_bytes.all.current", "active_bytes.all.current")}


def test_a_pool_that_dies_asleep_wakes_what_is_in_use_and_gives_the_rest_back():
    allocator, backend, outside, (kept, freed_before, freed_asleep) = setup()
    ctypes.memset(kept, 7, 3 * MiB)
    allocator.free(freed_before)
    reserved_outside = allocator.memory_stats()["reserved_bytes.all.current"] - sum(
        s["total_size"] for s in allocator.snapshot(POOL))
    peak = allocator.memory_stats()["reserved_bytes.all.peak"]
    allocator.sleep_pool(POOL)
    allocator.free(freed_asleep)                      # its segment is wholly free now
    allocator.release_pool(POOL)                      # the MemPool dies
    assert not allocator.is_sleeping(POOL)
    assert backend.restores == 1                      # only the segment of the block in use came back
    assert ctypes.string_at(kept, 3 * MiB) == b"\x07" * (3 * MiB)
    allocator._check_invariants()
    kept_segment = [s for s in allocator.snapshot() if s["segment_pool_id"] == POOL]
    assert [s["address"] for s in kept_segment] == [kept]
    assert allocator.memory_stats()["reserved_bytes.all.current"] == reserved_outside + kept_segment[0]["total_size"]
    allocator.free(kept)
    allocator.empty_cache()
    allocator._check_invariants()
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == reserved_outside
    assert stats["segment.all.current"] == 1 and allocator.snapshot(POOL) == []
    allocator.free(outside)
    allocator.empty_cache()
    assert baseline(allocator) == dict.fromkeys(baseline(allocator), 0)
    assert allocator.memory_stats()["reserved_bytes.all.peak"] == peak     # nothing was backed again


def test_a_pool_that_dies_asleep_with_nothing_in_use_is_not_woken():
    allocator, backend, outside, blocks = setup(debug=True)   # no fill into memory given back
    allocator.free(blocks[0])
    allocator.sleep_pool(POOL, offload=False)
    for ptr in blocks[1:]:
        allocator.free(ptr)                           # freed while asleep
    allocator.release_pool(POOL)
    assert backend.restores == 0 and not allocator.is_sleeping(POOL)
    allocator._check_invariants()
    assert allocator.snapshot(POOL) == []
    assert allocator.memory_stats()["segment.all.current"] == 1
    allocator.free(outside)
    allocator.empty_cache()
    assert baseline(allocator) == dict.fromkeys(baseline(allocator), 0)
    assert allocator.debug_reports() == []


def test_a_pool_dying_inside_a_backend_call_is_ended_at_the_next_empty_cache():
    allocator, backend, outside, blocks = setup()
    for ptr in blocks:
        allocator.free(ptr)
    allocator.sleep_pool(POOL)
    allocator.sleep(tag="device")                     # the device's own memory sleeps too

    def die():                                        # a finalizer inside the wake_up's backend call
        backend.on_restore = lambda: None
        allocator.release_pool(POOL)
    backend.on_restore = die
    allocator.wake_up("device")
    assert allocator.is_sleeping(POOL)                # not from inside another call
    allocator._check_invariants()
    allocator.empty_cache()
    assert not allocator.is_sleeping(POOL)
    allocator._check_invariants()
    assert allocator.memory_stats()["segment.all.current"] == 1 and allocator.snapshot(POOL) == []
    allocator.free(outside)


def test_a_restore_that_fails_at_the_pools_death_is_tried_again_by_empty_cache():
    allocator, backend, outside, blocks = setup()
    ctypes.memset(blocks[0], 3, 3 * MiB)
    allocator.sleep_pool(POOL)

    def refuse():
        raise MemoryError("injected")
    backend.on_restore = refuse
    with pytest.raises(MemoryError):
        allocator.release_pool(POOL)
    assert allocator.is_sleeping(POOL)                # still asleep, the statistics right
    allocator._check_invariants()
    assert allocator.memory_stats()["reserved_bytes.all.current"] == 2 * MiB    # the outside block's segment
    backend.on_restore = lambda: None
    allocator.empty_cache()
    assert not allocator.is_sleeping(POOL)
    assert ctypes.string_at(blocks[0], 3 * MiB) == b"\x03" * (3 * MiB)
    allocator._check_invariants()
    for ptr in blocks + [outside]:
        allocator.free(ptr)
    allocator.empty_cache()
    assert baseline(allocator) == dict.fromkeys(baseline(allocator), 0)


DEAD_POOL_WOKEN_BY_A_RESTORE_THAT_EMPTIES_THE_CACHE = """
import sys
sys.path.insert(0, "tests/core/sleep")
from test_sleep_dead_pool import MiB, POOL, setup
allocator, backend, outside, (kept, *rest) = setup()
for ptr in rest:
    allocator.free(ptr)
newest = allocator.malloc(30 * MiB)          # a segment of the device's own, linked last: the list's head
allocator.free(newest)                       # wholly free
allocator.sleep_pool(POOL)

def empty_the_cache():                      # Python in the restore: a finalizer's empty_cache
    backend.on_restore = lambda: None
    allocator.empty_cache()
backend.on_restore = empty_the_cache
allocator.release_pool(POOL)                # the pool dies asleep: its segment in use is woken
allocator._check_invariants()
allocator.free(kept)
allocator.free(outside)
allocator.empty_cache()
assert allocator.memory_stats()["reserved_bytes.all.current"] == 0
print("PASSED")
"""


def test_a_dead_pools_release_reads_the_segments_after_its_wake_ran_python():
    """_empty_dead_pool read the head of the segment list before waking the
    dead pool's segments (restore_pages, Python): an empty_cache run there
    freed that head segment, and the scan then walked freed memory (seen with
    valgrind; with freed memory filled by MALLOC_PERTURB_ and no
    thread cache to keep it from being filled, a crash)."""
    run_python(DEAD_POOL_WOKEN_BY_A_RESTORE_THAT_EMPTIES_THE_CACHE,
               env={"MALLOC_PERTURB_": "165", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})


def dead_asleep_on_two_streams(debug=False):
    """A pool with a wholly free segment on stream 5 sleeps, and dies inside
    another allocator call (a finalizer in the device's wake_up): its sleep
    is ended at the next empty_cache."""
    backend = Counting(PageAlignedBackend())
    allocator = _core.CachingAllocator(backend, 0)
    if debug:
        allocator.enable_debug()
    outside = allocator.malloc(MiB)                   # the device's own segment, on stream 0
    allocator.create_pool(POOL)
    allocator.begin_pool(POOL)
    try:
        blocks = [allocator.malloc(3 * MiB, 5), allocator.malloc(12 * MiB, 5)]
    finally:
        allocator.end_pool(POOL)
    for ptr in blocks:
        allocator.free(ptr)
    allocator.sleep_pool(POOL)
    allocator.sleep(tag="device")

    def die():
        backend.on_restore = lambda: None
        allocator.release_pool(POOL)
    backend.on_restore = die
    allocator.wake_up("device")
    assert allocator.is_sleeping(POOL)
    return allocator, backend, outside


def test_a_pool_that_died_asleep_gives_back_every_stream_at_an_empty_cache_of_one_stream():
    """empty_cache(stream=...) (what unimem.cuda.MemoryPool.free_all_blocks
    calls) ended the dead pool's sleep, which counts its wholly free segments
    as reserved again for the release to take off, and then gave back only
    that stream's segments: the pool's 20 MiB on stream 5 stayed reserved,
    in the free index, with no memory behind them."""
    allocator, backend, outside = dead_asleep_on_two_streams()
    restores = backend.restores                       # the device's own segment's, at its wake_up
    allocator.empty_cache(stream=0)
    assert not allocator.is_sleeping(POOL) and backend.restores == restores   # nothing backed again
    allocator._check_invariants()
    assert allocator.memory_reserved() == 2 * MiB     # the device's own segment alone
    assert [s["address"] for s in allocator.snapshot()] == [outside] and allocator.snapshot(POOL) == []
    allocator.free(outside)
    allocator.empty_cache()
    assert baseline(allocator) == dict.fromkeys(baseline(allocator), 0)


DEAD_POOL_THEN_A_DEBUG_FILL = """
import sys
sys.path.insert(0, "tests/core/sleep")
from test_sleep_dead_pool import dead_asleep_on_two_streams
allocator, backend, outside = dead_asleep_on_two_streams()
allocator.empty_cache(stream=0)
allocator.enable_debug()                     # fills every free block: none may be memory given back
allocator.free(outside)
allocator.empty_cache()
assert allocator.memory_reserved() == 0
print("PASSED")
"""


def test_a_debug_fill_after_a_dead_pools_sleep_ended_writes_only_to_memory():
    """The unbacked segments left by the empty_cache above were free blocks
    to debug mode's fill, which wrote into memory given back (PROT_NONE on
    the host: the process died of SIGSEGV)."""
    run_python(DEAD_POOL_THEN_A_DEBUG_FILL)
