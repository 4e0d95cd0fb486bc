"""The snapshot of an allocator that sleeps: memory a sleep gave back is left
out, as PyTorch leaves out the unmapped parts of an expandable segment, so
that the snapshot's segment sizes add up to ``reserved_bytes.all.current``
asleep as they do awake (and the tools that read a snapshot agree with
``memory_stats``)."""
import pytest

from unimem import _core
from unimem.backends.base import Backend, forward_to_inner
from unimem.backends._host import PageAlignedBackend

MiB = 1 << 20
SIZES = (700, 300 << 10, 3 * MiB, 25 * MiB)          # small pool, large pool, an oversize segment


def allocator_with_blocks(expandable, backend=None):
    allocator = _core.CachingAllocator(backend or PageAlignedBackend(), 0, expandable_segments=expandable)
    live = [allocator.malloc(size) for size in SIZES]
    allocator.free(allocator.malloc(5 * MiB))          # free cached memory sleeps too
    return allocator, live


def reserved(allocator):
    return allocator.memory_stats()["reserved_bytes.all.current"]


def listed(snapshot):
    return sum(segment["total_size"] for segment in snapshot)


def well_formed(snapshot):
    """Each segment is tiled by its blocks, and its sums are its blocks'."""
    for segment in snapshot:
        address = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == address
            address += block["size"]
        assert address == segment["address"] + segment["total_size"]
        states = [(b["state"], b["size"], b["requested_size"]) for b in segment["blocks"]]
        assert segment["allocated_size"] == sum(size for state, size, _ in states if state == "active_allocated")
        assert segment["active_size"] == sum(size for state, size, _ in states if state != "inactive")
        assert segment["requested_size"] == sum(req for state, _, req in states if state != "inactive")


@pytest.mark.parametrize("expandable", [False, True])
def test_a_whole_sleep_leaves_no_memory_in_the_snapshot(expandable):
    allocator, _ = allocator_with_blocks(expandable)
    awake = allocator.snapshot()
    assert listed(awake) == reserved(allocator) > 0
    allocator.sleep()
    assert reserved(allocator) == 0
    assert allocator.snapshot() == []
    allocator.wake_up()
    assert allocator.snapshot() == awake


@pytest.mark.parametrize("expandable", [False, True])
def test_a_filtered_sleep_leaves_out_only_what_it_gave_back(expandable):
    allocator, live = allocator_with_blocks(expandable)
    small = live[0]
    awake = allocator.snapshot()
    allocator.sleep(segments=lambda address, size, stream: address <= small < address + size, tag="t")
    asleep = allocator.snapshot()
    assert listed(asleep) == reserved(allocator) < listed(awake)
    assert not any(s["address"] <= small < s["address"] + s["total_size"] for s in asleep)
    well_formed(asleep)
    untouched = [s for s in awake if not s["address"] <= small < s["address"] + s["total_size"]]
    assert [s for s in asleep if s in untouched] == untouched
    # a block handed out meanwhile (maybe a new segment, maybe next to what sleeps) is listed
    more = allocator.malloc(1000)
    asleep = allocator.snapshot()
    assert listed(asleep) == reserved(allocator)
    assert any(b["address"] == more for s in asleep for b in s["blocks"])
    well_formed(asleep)
    allocator.free(more)
    allocator.wake_up("t")
    assert listed(allocator.snapshot()) == reserved(allocator)


@forward_to_inner(intercepted={"release_pages"})
class ReleaseFailsOnce(Backend):
    """The first release_pages raises with the memory left as it was."""

    def __init__(self, inner):
        self.inner = inner
        self.failed = False

    def release_pages(self, address, size, device=0):
        if not self.failed:
            self.failed = True
            raise OSError("refused")
        self.inner.release_pages(address, size, device)


def test_memory_a_release_kept_stays_listed_with_its_free_blocks_inactive():
    allocator, _ = allocator_with_blocks(False, ReleaseFailsOnce(PageAlignedBackend()))
    stats = allocator.memory_stats()
    with pytest.raises(OSError):
        allocator.sleep()
    asleep = allocator.snapshot()
    assert len(asleep) == 1 and listed(asleep) == reserved(allocator) > 0
    well_formed(asleep)
    # the free blocks the sleep holds are not active (memory_stats agrees)
    assert allocator.memory_stats()["active_bytes.all.current"] == stats["active_bytes.all.current"]
    for block in asleep[0]["blocks"]:
        assert block["state"] in ("active_allocated", "inactive")
    allocator.wake_up()
