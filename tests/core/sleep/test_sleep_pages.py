"""After wake_up, host memory is advised as it was before the sleep.

wake_up asks for huge pages while it copies the offloaded bytes back (far
fewer page faults); that advice must not outlast the copy: later faults in
the woken range (a block handed out there) would get 2 MiB pages, with the
memory and the compaction stalls that brings, where before they did not."""
import ctypes
import os

import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend

from tests.helpers.mappings import vma_flags

MiB = 1 << 20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode():
    try:
        with open(THP) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")]


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not thp_mode(),
                                reason="needs Linux with transparent huge pages")


@pytest.mark.parametrize("expandable", [False, True])
def test_wake_up_leaves_no_huge_page_advice_behind(expandable):
    allocator = _core.CachingAllocator(PageAlignedBackend(), 0, expandable_segments=expandable)
    live = allocator.malloc(8 * MiB)
    ctypes.memset(live, 5, 8 * MiB)
    cached = allocator.malloc(6 * MiB)                # free memory of the woken range, faulted later
    allocator.free(cached)
    before = vma_flags(live) & {"hg", "nh"}
    allocator.sleep()
    allocator.wake_up()
    assert ctypes.string_at(live, 8 * MiB) == b"\x05" * (8 * MiB)
    after = vma_flags(live) & {"hg", "nh"}
    assert "hg" not in after - before                 # no huge pages on the range's later faults
    if thp_mode() == "always":                        # there a fresh range has huge pages: no "nh" either
        assert after == before
    for address in (live, cached):
        assert vma_flags(address) & {"hg"} == before & {"hg"}
    allocator.free(live)
