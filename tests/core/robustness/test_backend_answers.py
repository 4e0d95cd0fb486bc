"""Memory a backend's malloc hands out that the core refuses, changing
nothing: an address inside (or overlapping) a live segment, which would give
two owners the same bytes (the memory is not given back: freeing it could
free the live segment), a range that wraps around the address space, and an
address that is a float. The misbehaving-backend machine
(test_misbehaving_backend.py) draws such answers at random; these pin each one."""
import pytest

from unimem import _core
from unimem.backends.base import Backend
from unimem.backends.pluggable import PluggableAllocator

MiB = 1 << 20


BASE = 0x10000000


class Repeating(Backend):
    """Hands out whatever address it is told to."""

    def __init__(self):
        self.next = [BASE, BASE, BASE + 4 * MiB, BASE - MiB]
        self.frees = []

    def malloc(self, size, device, stream):
        return self.next.pop(0)

    def free(self, ptr, size, device, stream):
        self.frees.append(ptr)


def test_memory_that_overlaps_a_live_segment_is_refused():
    a = _core.CachingAllocator(Repeating(), 0)
    first = a.malloc(512)                                  # a 2 MiB segment at BASE
    before = dict(a.memory_stats())
    with pytest.raises(RuntimeError, match="overlaps memory it already gave"):
        a.malloc(2 * MiB)                                   # the same address again
    assert dict(a.memory_stats()) == before
    second = a.malloc(2 * MiB)                              # 4 MiB above: no overlap, fine
    assert second == BASE + 4 * MiB
    with pytest.raises(RuntimeError, match="overlaps"):
        a.malloc(30 * MiB)                                  # a segment 1 MiB below the first, into it
    assert a.live_allocations().keys() == {first, second}
    a._check_invariants()


def test_memory_that_wraps_around_the_address_space_is_refused():
    a = _core.CachingAllocator(PluggableAllocator(lambda s, d, st: (1 << 64) - 4096, lambda *x: None), 0)
    with pytest.raises(RuntimeError, match="wraps around"):
        a.malloc(100)
    assert a.memory_reserved() == 0


def test_a_backend_returning_a_float_address_is_refused():
    a = _core.CachingAllocator(PluggableAllocator(lambda *x: 4096.5, lambda *x: None), 0)
    with pytest.raises(TypeError, match="as a positive int, got 4096.5"):
        a.malloc(100)
    assert a.memory_reserved() == 0
