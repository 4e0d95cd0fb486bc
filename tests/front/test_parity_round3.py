"""PyTorch parity found by the outside testers of round 3 (issue 26, items 6
and 7), checked against what PyTorch does: ``unimem.cuda`` over the
simulated CUDA runtime (tests/helpers/fake_cuda.py) and unimem's pinned pool.
"""
import pytest

import unimem

from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")


# ---------------------------------------------------------------------------
# item 7: memory_stats of a device not used yet
# ---------------------------------------------------------------------------
def test_memory_stats_of_an_unused_device_is_every_key_at_zero(fake):  # noqa: F811
    """torch.cuda.memory_stats(1) after device 0 was used and device 1 not:
    ``{}`` before CUDA is initialised, then every key of the allocator's
    statistics at 0 (one DeviceCachingAllocator per device exists from
    initialisation on)."""
    import unimem.cuda as cuda
    assert cuda.memory_stats(1) == {}
    assert cuda.memory_stats(0) == {}
    ptr = cuda.caching_allocator_alloc(4096, device=0)
    try:
        used = cuda.memory_stats(0)
        unused = cuda.memory_stats(1)
        assert list(unused) == list(used)
        assert {key: value for key, value in unused.items() if value != 0} == {
            "max_split_size": used["max_split_size"]}          # the configuration's, -1: unlimited
        assert cuda.memory_allocated(1) == cuda.max_memory_reserved(1) == 0
        assert cuda.memory_stats_as_nested_dict(1)["allocated_bytes"]["all"]["current"] == 0
        assert used["allocated_bytes.all.current"] == 4096
    finally:
        cuda.caching_allocator_delete(ptr)
