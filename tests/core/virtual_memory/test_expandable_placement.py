"""Expandable segments: where a miss goes and which holes are unmapped
first (_core_holes.pxi), pinned one rule at a time on the
simulated CUDA VMM device (2 MiB pages) and the cpu pool's host backend.

* With max_reserved_ratio, a miss maps pages where the request needs the
  fewest new bytes (after a free block it extends, in a hole), the lowest
  address among equals; without one, at the first span in address order
  with room, as PyTorch (the model test checks that policy step by step).
* With max_reserved_ratio, mapping more unmaps the hole whose free whole
  pages best cover the excess over ratio x the high-water mark of memory
  in use (reset by empty_cache), never the place the request goes to.
* The unmapped spans of each pool are indexed by address; the index follows
  every map, unmap, merge and range release (``_check_invariants`` compares
  it with the ranges).
"""
import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.mapped_pages import mapped, unmapped

MiB = 1 << 20
CAPACITY = 256 * MiB
# A ratio no test here reaches: the placement rule alone.
LOOSE = 100.0


def simulated(**options):
    backend = SimulatedBackend(capacity=CAPACITY)
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True, **options)
    allocator.set_capacity(CAPACITY)
    return allocator, backend


def a_hole_and_a_free_end(a):
    """[0, 4) live, [4, 8) an unmapped hole, [8, 12) live, [12, 15) live and
    [15, 16) free at the end of what the range has mapped (MiB offsets)."""
    first = a.malloc(4 * MiB)
    hole = a.malloc(4 * MiB)
    after = a.malloc(4 * MiB)
    last = a.malloc(3 * MiB)
    a.free(hole)
    a.empty_cache()                  # unmaps the hole's two pages
    return first, hole, after, last


def test_a_miss_goes_where_it_maps_the_fewest_bytes():
    """3 MiB: in the hole it maps two pages (4 MiB); after the free 1 MiB at
    the end, one (2 MiB). PyTorch's first span in address order would be
    the hole."""
    a, backend = simulated(max_reserved_ratio=LOOSE)
    first, hole, after, last = a_hole_and_a_free_end(a)
    maps = backend.n_map
    ptr = a.malloc(3 * MiB)
    assert ptr == last + 3 * MiB                     # after the free end, not in the hole
    assert backend.n_map == maps + 1
    assert a.memory_reserved() == 14 * MiB           # 16 mapped, the hole's 4 unmapped, 2 more
    assert unmapped(backend, hole, 4 * MiB)
    a._check_invariants()


def test_without_a_ratio_the_first_span_in_address_order_is_taken():
    """PyTorch's find_expandable_block, kept when the core has no ratio."""
    a, backend = simulated()
    first, hole, after, last = a_hole_and_a_free_end(a)
    assert a.malloc(3 * MiB) == hole
    assert a.memory_reserved() == 16 * MiB
    a._check_invariants()


def test_equal_costs_go_to_the_lowest_address():
    """4 MiB costs two pages in the hole and two after the free end: the
    hole, as PyTorch's address order has it."""
    a, backend = simulated(max_reserved_ratio=LOOSE)
    first, hole, after, last = a_hole_and_a_free_end(a)
    assert a.malloc(4 * MiB) == hole
    assert mapped(backend, hole, 4 * MiB)
    a._check_invariants()


def test_a_request_extends_a_free_block_before_a_hole():
    """A free block before an unmapped span counts as room: 5 MiB after a
    free 2 MiB block needs one more page in the hole, not three at the end."""
    a, backend = simulated(max_reserved_ratio=LOOSE)
    first = a.malloc(4 * MiB)
    lead = a.malloc(2 * MiB)
    hole = a.malloc(4 * MiB)
    after = a.malloc(4 * MiB)
    a.free(hole)
    a.empty_cache()
    a.free(lead)                                     # mapped and free, right before the hole
    reserved = a.memory_reserved()
    assert a.malloc(5 * MiB) == lead
    assert a.memory_reserved() == reserved + 4 * MiB  # 3 MiB more, by whole pages
    assert a.reserved_address_space()["ranges"] == 1
    a._check_invariants()


def holes(a, sizes, gap=2 * MiB):
    """Live blocks separated by free mapped holes of ``sizes`` MiB."""
    live, free = [a.malloc(gap)], []
    for size in sizes:
        free.append(a.malloc(size * MiB))
        live.append(a.malloc(gap))
    for ptr in free:
        a.free(ptr)
    return live, free


def test_the_hole_that_best_covers_the_excess_is_unmapped():
    """Holes of 4, 8 and 12 MiB between 2 MiB live blocks (32 MiB mapped,
    and 32 MiB was the most in use): a 14 MiB request maps 14 MiB more, 14
    past ratio 1.0 x the high-water mark. No hole covers that alone, so the
    one with the most pages goes first (12), then the one that covers the
    2 MiB left with the fewest (4), not the 8 MiB one."""
    a, backend = simulated(max_reserved_ratio=1.0)
    live, (four, eight, twelve) = holes(a, [4, 8, 12])
    assert a.memory_reserved() == 32 * MiB
    frees = backend.n_unmap
    a.malloc(14 * MiB)
    assert backend.n_unmap == frees + 2
    assert unmapped(backend, twelve, 12 * MiB) and unmapped(backend, four, 4 * MiB)
    assert mapped(backend, eight, 8 * MiB)
    assert a.memory_reserved() == 30 * MiB           # 16 unmapped, 14 mapped
    a._check_invariants()


def test_the_bound_is_the_high_water_mark_of_memory_in_use():
    """A working set that shrinks and grows again keeps its holes: 40 MiB
    were in use, 20 are, and a 12 MiB miss that maps 2 MiB more (42 mapped,
    within 1.1 x 40) unmaps nothing, though 42 is past 1.1 x the 32 MiB in
    use then."""
    a, backend = simulated(max_reserved_ratio=1.1)
    blocks = [a.malloc(10 * MiB) for _ in range(4)]
    a.free(blocks[1])                                       # a hole
    a.free(blocks[3])                                       # the free end of the range
    assert a.malloc(12 * MiB) == blocks[3]                  # extends the free end by a page
    assert backend.n_unmap == 0 and mapped(backend, blocks[1], 10 * MiB)
    assert a.memory_reserved() == 42 * MiB
    a._check_invariants()


def test_empty_cache_starts_the_high_water_mark_again():
    """The same blocks, but the cache emptied when 20 MiB were in use: the
    mark is then what is in use since (30 MiB at most), and the 12 MiB miss
    (42 mapped, past 1.1 x 32) unmaps the hole first."""
    a, backend = simulated(max_reserved_ratio=1.1)
    blocks = [a.malloc(10 * MiB) for _ in range(4)]
    a.free(blocks[1])
    a.free(blocks[3])
    a.empty_cache()                                         # unmaps both: 20 MiB mapped
    assert a.memory_reserved() == 20 * MiB
    again = a.malloc(10 * MiB)
    assert again == blocks[1]                               # the hole (the end costs as much)
    a.free(again)                                           # 30 mapped, 20 in use
    unmaps = backend.n_unmap
    a.malloc(12 * MiB)
    assert backend.n_unmap == unmaps + 1 and unmapped(backend, blocks[1], 10 * MiB)
    assert a.memory_reserved() == 32 * MiB
    a._check_invariants()


def test_the_place_a_request_goes_is_not_unmapped_for_it():
    """A 6 MiB miss extends the free 4 MiB block before a hole by one page,
    2 MiB past the high-water mark (16 MiB) with ratio 1.0. The free block
    it extends holds as many whole pages as the other free one: the other
    is unmapped (unmapping the first would unmap and map the same pages)."""
    a, backend = simulated(max_reserved_ratio=1.0)
    first = a.malloc(4 * MiB)
    lead = a.malloc(4 * MiB)
    hole = a.malloc(4 * MiB)
    middle = a.malloc(2 * MiB)
    other = a.malloc(4 * MiB)
    last = a.malloc(2 * MiB)
    a.free(hole)
    a.empty_cache()                                  # 16 MiB mapped and in use: the mark
    a.free(lead)                                     # right before the hole
    a.free(other)
    unmaps = backend.n_unmap
    assert a.malloc(6 * MiB) == lead
    assert backend.n_unmap == unmaps + 1
    assert unmapped(backend, other, 4 * MiB) and mapped(backend, lead, 6 * MiB)
    assert a.memory_reserved() == 14 * MiB
    a._check_invariants()
    del first, middle, last


def test_the_span_index_follows_merges_splits_and_released_ranges():
    """Two holes unmapped apart and the free block between them, unmapped
    last, make one span, which a request of all three then fills; the range
    emptied and released leaves no span indexed."""
    a, backend = simulated(max_reserved_ratio=LOOSE)
    blocks = [a.malloc(4 * MiB) for _ in range(6)]
    a.free(blocks[1])
    a.free(blocks[3])
    a.empty_cache()                                  # two spans
    a._check_invariants()
    a.free(blocks[2])
    a.empty_cache()                                  # merged into one: [4, 16)
    a._check_invariants()
    assert a.malloc(12 * MiB) == blocks[1]          # only the merged span holds it
    assert a.reserved_address_space()["ranges"] == 1
    a._check_invariants()
    part = a.malloc(2 * MiB, 5)                     # another stream's range
    a.free(part)
    a.empty_cache()
    a.empty_virt_addr_cache()                       # stream 5's range goes
    assert a.reserved_address_space()["ranges"] == 1
    a._check_invariants()


def test_the_small_pool_maps_2_mib_at_a_time_on_host_pages():
    """On the cpu pool (4 KiB pages) small requests are mapped by 2 MiB, as
    PyTorch maps its small pool: 64 small blocks, one map call."""
    backend = PageAlignedBackend("CPU")
    a = _core.CachingAllocator(backend, 0, expandable_segments=True)
    a.set_capacity(CAPACITY)
    ptrs = [a.malloc(16 << 10) for _ in range(64)]
    stats = a.memory_stats()
    assert stats["num_device_alloc"] == 1
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB == backend.address_ranges.mapped_bytes()
    for ptr in ptrs:
        a.free(ptr)
    a.empty_cache()
    assert backend.address_ranges.mapped_bytes() == 0
    a.empty_virt_addr_cache()


def test_with_a_ratio_small_requests_share_the_large_pools_range():
    """Under max_reserved_ratio, requests up to 1 MiB go to the large pool's
    range: bytes freed by small blocks then hold a large request without a
    page mapped. PyTorch's two pools (no ratio) map a second range for it."""
    for ratio, ranges, maps in [(LOOSE, 1, 0), (0.0, 2, 1)]:
        a, backend = simulated(max_reserved_ratio=ratio)
        small = [a.malloc(512 << 10) for _ in range(8)]           # 4 MiB: two pages
        a.free(small[0])
        a.free(small[1])
        a.free(small[2])
        a.free(small[3])                                           # the first 2 MiB page, free
        calls = a.memory_stats()["num_device_alloc"]
        big = a.malloc(2 * MiB)
        stats = a.memory_stats()
        assert a.reserved_address_space()["ranges"] == ranges, ratio
        assert stats["num_device_alloc"] - calls == maps, ratio
        if ratio:
            assert big == small[0]                                 # in the small blocks' bytes
            assert stats["allocated_bytes.small_pool.current"] == 0
            assert stats["allocated_bytes.large_pool.current"] == 4 * MiB
        else:
            assert stats["allocated_bytes.small_pool.current"] == 2 * MiB
        a._check_invariants()
        for ptr in [big] + small[4:]:
            a.free(ptr)
        a.empty_cache()
        a.empty_virt_addr_cache()
        assert backend.held() == 0 and a.reserved_address_space()["ranges"] == 0


def test_a_private_pool_keeps_its_small_pool_under_a_ratio():
    """Private pools' segments are plain (never expandable): their small
    requests still go to 2 MiB small segments of their own."""
    a, backend = simulated(max_reserved_ratio=LOOSE)
    pool = (0, 1)
    a.create_pool(pool)
    a.begin_pool(pool)
    ptr = a.malloc(512 << 10)
    a.end_pool(pool)
    stats = a.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["allocated_bytes.small_pool.current"] == 512 << 10
    a._check_invariants()
    a.free(ptr)
    a.release_pool(pool)
    a.empty_cache()
    assert backend.held() == 0


class AllocatesWhileMapping(SimulatedBackend):
    """A backend whose map_pages runs Python that allocates from the same
    allocator (as a finalizer run by a garbage collection may), once."""

    allocator = None
    inner = None

    def map_pages(self, address, size, device):
        if self.allocator is not None and self.inner is None:
            self.inner = -1
            self.inner = self.allocator.malloc(4 * MiB)
        return super().map_pages(address, size, device)


def test_a_miss_re_entered_from_map_pages_maps_elsewhere():
    """The span being mapped is passed over by the re-entered miss (mapping
    it twice would be refused by the backend, or worse on a real driver)."""
    backend = AllocatesWhileMapping(capacity=CAPACITY)
    a = _core.CachingAllocator(backend, 0, expandable_segments=True)
    a.set_capacity(CAPACITY)
    backend.allocator = a
    outer = a.malloc(4 * MiB)
    inner = backend.inner
    assert inner not in (None, -1)
    assert abs(inner - outer) >= 4 * MiB             # disjoint
    assert a.memory_stats()["allocated_bytes.all.current"] == 8 * MiB
    assert a.memory_reserved() == backend.held() == 8 * MiB
    a._check_invariants()
    backend.allocator = None
    a.free(outer)
    a.free(inner)
    a.empty_cache()
    a.empty_virt_addr_cache()
    assert backend.held() == 0 and a.reserved_address_space()["ranges"] == 0


@pytest.mark.parametrize("ratio", [1.0, 1.09])
def test_mapped_memory_stays_within_the_ratio_of_the_high_water_mark(ratio):
    """Random sizes and frees on host pages: after every miss that mapped
    more, mapped memory is within ratio x the high-water mark of memory in
    use, or no hole held a whole free page."""
    import random
    rng = random.Random(11)
    backend = PageAlignedBackend("CPU")
    a = _core.CachingAllocator(backend, 0, expandable_segments=True, max_reserved_ratio=ratio)
    a.set_capacity(CAPACITY)
    live, high_water = [], 0
    for step in range(600):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
            continue
        before = a.memory_reserved()
        live.append(a.malloc(rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 6 << 20)])))
        stats = a.memory_stats()
        high_water = max(high_water, stats["allocated_bytes.all.current"])
        if a.memory_reserved() > before and a.memory_reserved() > ratio * high_water:
            assert not unmappable_holes(a, live[-1]), f"step {step}: a hole could have been unmapped"
        if step % 100 == 0:
            a._check_invariants()
    for ptr in live:
        a.free(ptr)
    a.empty_cache()
    assert backend.address_ranges.mapped_bytes() == 0
    a.empty_virt_addr_cache()


def unmappable_holes(a, newest):
    """Free blocks holding a whole 4 KiB page, other than the free end of
    what each range has mapped (where it grows) and the block right after
    ``newest`` (what mapping it left over)."""
    found = []
    segments = a.snapshot()              # one per run of mapped blocks
    ends = {}
    for segment in segments:
        key = (segment["stream"], segment["segment_type"])
        if segment["address"] >= ends.get(key, (-1, None))[0]:
            ends[key] = (segment["address"], segment["blocks"][-1]["address"])
    range_ends = {address for _, address in ends.values()}
    for segment in segments:
        blocks = segment["blocks"]
        for i, block in enumerate(blocks):
            start, end = -(-block["address"] // 4096) * 4096, (block["address"] + block["size"]) // 4096 * 4096
            if block["state"] != "inactive" or end <= start or block["address"] in range_ends:
                continue
            if i > 0 and blocks[i - 1]["address"] == newest:
                continue
            found.append(block["address"])
    return found
