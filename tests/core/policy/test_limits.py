"""The limits on what the core reserves: a byte limit (CuPy's
MemoryPool.set_limit) serves a request that fits with a segment of the
request's size, and the largest request and reservation
(``MAX_REQUEST_SIZE``, ``MAX_RESERVED_SIZE``) keep every statistic from
overflowing on a backend that tells no capacity."""
import pytest

from unimem import OutOfMemoryError, _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def test_a_byte_limit_shrinks_the_segment_to_the_request_when_that_fits():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    a.set_memory_limit(3072)
    p = a.malloc(2560)                                  # a 2 MiB segment would pass the limit
    assert a.memory_reserved() == 2560
    with pytest.raises(OutOfMemoryError, match="3.00 KiB allowed"):
        a.malloc(1024)
    a.free(p)
    b = _core.CachingAllocator(SimulatedBackend(), 0)
    b.set_memory_limit(10 * MiB)
    b.malloc(MiB + MiB // 2)                            # not a 20 MiB segment: 1.5 MiB
    assert b.memory_reserved() == MiB + MiB // 2


def test_huge_blocks_from_a_backend_with_no_capacity_never_overflow_the_statistics():
    a = _core.CachingAllocator(SimulatedBackend(capacity=1 << 63), 0)   # no capacity told
    held = []
    for _ in range(40):
        try:
            held.append(a.malloc(_core.MAX_REQUEST_SIZE))
        except OutOfMemoryError:
            break
    s = a.memory_stats()
    assert 0 < s["reserved_bytes.all.current"] <= _core.MAX_RESERVED_SIZE
    assert all(v >= 0 for k, v in s.items() if k != "max_split_size")
    with pytest.raises(OutOfMemoryError):
        a.malloc(1 << 62)
