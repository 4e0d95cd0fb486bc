"""Real host memory: what is written into a block stays there."""
import ctypes
import random

import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend


def fill(ptr, size, byte):
    ctypes.memset(ptr, byte, size)


def intact(ptr, size, byte):
    return ctypes.string_at(ptr, size) == bytes([byte]) * size


def test_patterns_survive_other_allocations_and_frees():
    a = _core.CachingAllocator(PageAlignedBackend(), 0)
    rng = random.Random(1234)
    live = {}   # ptr -> (size, byte)
    for step in range(4000):
        if live and rng.random() < 0.45:
            ptr = rng.choice(list(live))
            size, byte = live.pop(ptr)
            assert intact(ptr, size, byte), f"block {ptr:#x} was overwritten"
            a.free(ptr)
        else:
            size = rng.choice([1, 100, 512, 4096, 70_000, 1 << 20, 3 << 20, 12 << 20])
            ptr = a.malloc(size)
            byte = step % 251 + 1
            fill(ptr, size, byte)
            live[ptr] = (size, byte)
        if step % 500 == 0:
            a.empty_cache()
    for ptr, (size, byte) in live.items():
        assert intact(ptr, size, byte)
        a.free(ptr)
    a._check_invariants()
    a.empty_cache()
    assert a.memory_reserved() == 0


def test_host_memory_is_page_aligned():
    backend = PageAlignedBackend()
    ptr = backend.malloc(12345)
    assert ptr % 4096 == 0
    ctypes.memset(ptr, 1, 12345)
    backend.free(ptr, 12345)
    with pytest.raises(TypeError):
        backend.free(ptr)                  # the size is needed to give memory back
    free, total = backend.memory_info()
    assert 0 < free <= total


def test_free_takes_back_only_a_segment_it_handed_out():
    """free munmapped whatever it was given: someone else's mapping (whose
    owner then crashed on its next access), or part of a segment (the table
    forgot the segment and the rest stayed mapped for good). Now anything but
    a segment and its size is refused with nothing unmapped."""
    import mmap
    backend = PageAlignedBackend()
    foreign = mmap.mmap(-1, 1 << 16)
    address = ctypes.addressof(ctypes.c_char.from_buffer(foreign))
    with pytest.raises(ValueError, match="not a segment this backend handed out"):
        backend.free(address, 1 << 16)
    foreign[0] = 1                              # still mapped (a SIGSEGV before the fix)
    del address
    foreign.close()
    segment = backend.malloc(1 << 16)
    fill(segment, 1 << 16, 7)
    for ptr, size in ((segment, 4096), (segment + 4096, (1 << 16) - 4096), (segment, 1 << 17)):
        with pytest.raises(ValueError, match="not a segment"):
            backend.free(ptr, size)
    assert intact(segment, 1 << 16, 7)
    backend.release_pages(segment, 1 << 16)     # the table still knows the whole segment
    backend.restore_pages(segment, 1 << 16)
    backend.free(segment, 1 << 16)
    with pytest.raises(ValueError, match="not a segment"):
        backend.free(segment, 1 << 16)          # twice


@pytest.mark.parametrize("size, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_malloc_refuses_what_is_no_byte_count(size, error):
    """malloc(1.5) mapped 1 byte and malloc(True) 1; malloc(-1) raised OverflowError."""
    with pytest.raises(error, match="size must be"):
        PageAlignedBackend().malloc(size)
