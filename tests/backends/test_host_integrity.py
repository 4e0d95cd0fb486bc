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
