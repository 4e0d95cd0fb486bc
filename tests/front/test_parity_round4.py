"""PyTorch and CuPy parity found by an adversarial pass of this round, each
against what PyTorch 2.13 does (its Python sources and its C++ checks):
``unimem.cuda`` over the simulated CUDA runtime (tests/helpers/fake_cuda.py),
``unimem.cpu`` and ``unimem.xpu`` for real."""
import gc
import inspect

import pytest

import unimem
import unimem.accelerator
import unimem.cpu
import unimem.xpu
from unimem.backends.pluggable import PluggableAllocator

from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

MiB = 1 << 20


# ---------------------------------------------------------------------------
# caching_allocator_delete of an address the allocator does not hold: torch's
# allocator raises RuntimeError("invalid device pointer: ...")
# ---------------------------------------------------------------------------
def _namespaces_with_delete():
    return [pytest.param("cpu", id="cpu"), pytest.param("accelerator", id="accelerator"),
            pytest.param("cuda", id="cuda")]


@pytest.mark.parametrize("name", _namespaces_with_delete())
def test_freeing_what_the_allocator_does_not_hold_is_torchs_runtime_error(name, request):
    if name == "cuda":
        pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
        request.getfixturevalue("fake")
        import unimem.cuda as ns
    else:
        ns = getattr(unimem, name)
    ptr = ns.caching_allocator_alloc(4096)
    before = dict(ns.memory_stats())
    for bad in (ptr + 512, 0x7F00_0000_1000):
        with pytest.raises(RuntimeError) as caught:
            ns.caching_allocator_delete(bad)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, unimem.InvalidPointerError)
    ns.caching_allocator_delete(ptr)
    with pytest.raises(unimem.InvalidPointerError):
        ns.caching_allocator_delete(ptr)                 # freed already
    after = dict(ns.memory_stats())
    assert after["allocation.all.current"] == before["allocation.all.current"] - 1


@pytest.mark.parametrize("name", ["cpu", "accelerator", "xpu"])
def test_record_stream_of_an_address_not_handed_out_is_torchs_runtime_error(name):
    """torch: RuntimeError, "No allocated block can be found"; the namespaces
    raised a plain ValueError (the core's record_stream already raised
    InvalidPointerError)."""
    ns = getattr(unimem, name)
    before = dict(ns.memory_stats())
    with pytest.raises(unimem.InvalidPointerError) as caught:
        ns.record_stream(0x7F00_0000_1000, 0)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)
    assert dict(ns.memory_stats()) == before


def test_the_cores_own_free_raises_it_too():
    from unimem import _core
    from unimem.backends.simulated import SimulatedBackend
    core = _core.CachingAllocator(SimulatedBackend(), 0)
    with pytest.raises(unimem.InvalidPointerError):
        core.free(0x1000)


# ---------------------------------------------------------------------------
# torch.accelerator's _snapshot(device=None, augment_with_fx_traces=False)
# ---------------------------------------------------------------------------
def test_the_accelerators_snapshot_takes_torchs_arguments():
    assert list(inspect.signature(unimem.accelerator._snapshot).parameters) == ["device", "augment_with_fx_traces"]
    for snapshot in (unimem.accelerator._snapshot(None, False), unimem.accelerator._snapshot(augment_with_fx_traces=True)):
        assert {"segments", "device_traces"} <= set(snapshot)


# ---------------------------------------------------------------------------
# torch.xpu.set_per_process_memory_fraction: XPUCachingAllocator takes (0, 1]
# ---------------------------------------------------------------------------
def test_xpu_refuses_a_memory_fraction_of_zero_and_changes_nothing():
    before = unimem.xpu.get_per_process_memory_fraction()
    with pytest.raises(ValueError, match=r"invalid fraction:0\. Please set within \(0, 1\]"):
        unimem.xpu.set_per_process_memory_fraction(0.0)
    assert unimem.xpu.get_per_process_memory_fraction() == before
    unimem.cpu.set_per_process_memory_fraction(0.0)          # CUDA's (and the cpu pool's) range: [0, 1]
    try:
        assert unimem.cpu.get_per_process_memory_fraction() == 0.0
    finally:
        unimem.cpu.set_per_process_memory_fraction(1.0)


# ---------------------------------------------------------------------------
# MemPool: a refused allocator takes no id; a snapshot's pool id as a list
# ---------------------------------------------------------------------------
def test_a_refused_mempool_takes_no_pool_id():
    first = unimem.cpu.MemPool().id
    for bad in (5, object()):
        with pytest.raises(TypeError):
            unimem.cpu.MemPool(allocator=bad)
    assert unimem.cpu.MemPool().id == (0, first[1] + 1)
    gc.collect()


def test_a_snapshot_takes_a_pool_id_as_a_list():
    """torch's memory_snapshot only indexes mempool_id[0] and [1]: a list (an
    id that went through JSON) names the pool as the tuple does."""
    pool = unimem.cpu.MemPool()
    with unimem.cpu.use_mem_pool(pool):
        ptr = unimem.cpu.caching_allocator_alloc(MiB)
    try:
        listed = unimem.cpu.memory_snapshot(list(pool.id))
        assert listed and listed == unimem.cpu.memory_snapshot(pool.id)
    finally:
        unimem.cpu.caching_allocator_delete(ptr)
        del pool
        gc.collect()
        unimem.cpu.empty_cache()


# ---------------------------------------------------------------------------
# A pluggable allocator's .allocator(): what MemPool(allocator=...) takes
# ---------------------------------------------------------------------------
def test_mempool_takes_a_pluggable_allocators_allocator():
    """Ported code writes MemPool(allocator.allocator()) (torch's
    _CUDAAllocator.allocator() hands out the C allocator)."""
    from unimem.backends._host import PageAlignedBackend
    pages = PageAlignedBackend()
    allocator = PluggableAllocator(pages.malloc, pages.free)
    assert allocator.allocator() is allocator
    pool = unimem.cpu.MemPool(allocator.allocator())
    assert pool.allocator is allocator
    with unimem.cpu.use_mem_pool(pool):
        ptr = unimem.cpu.caching_allocator_alloc(4096)
    assert [s["segment_pool_id"] for s in unimem.cpu.memory_snapshot(pool.id)] == [pool.id]
    unimem.cpu.caching_allocator_delete(ptr)
    del pool
    gc.collect()
    unimem.cpu.empty_cache()
