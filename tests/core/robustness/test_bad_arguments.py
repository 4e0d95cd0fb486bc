"""Calls the core refuses with a clear error, the allocator left as it was:
freeing by address a block an :class:`~unimem._core.Allocation` owns (the
handle's finalizer would later free the next owner's block), integers that
are not (bools, ``__index__`` returning a float), a second ``__init__`` and a
``max_reserved_ratio`` the configuration refuses, debug mode where the host
cannot read the memory."""
import gc

import pytest

from unimem import _core
from unimem._runtime.registry import DeviceRegistry
from unimem.backends.simulated import SimulatedBackend


def test_the_block_of_an_allocation_cannot_be_freed_by_address():
    """free(allocation) went through __index__ and freed the block behind the
    handle's back; the handle's finalizer later freed the next owner's block."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    handle = a.allocate(4096)
    for by_address in (handle, int(handle)):
        with pytest.raises(ValueError, match="belongs to an unimem Allocation"):
            a.free(by_address)
    assert a.memory_stats()["allocation.all.current"] == 1
    ptr = handle.ptr
    handle.release()
    reused = a.malloc(4096)                       # the next owner gets the same block
    assert reused == ptr
    del handle
    gc.collect()
    assert a.owns(reused), "the old handle freed the next owner's block"
    a.free(reused)
    a._check_invariants()


def test_a_registry_refuses_to_free_an_allocation_by_address():
    registry = DeviceRegistry("cpu", 1, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
    handle = registry.get(0).allocate(100)
    with pytest.raises(ValueError, match="belongs to an unimem Allocation"):
        registry.delete(handle.ptr)
    assert registry.get(0).owns(handle.ptr)


class FloatIndex:
    def __index__(self):
        return 4096.5


@pytest.mark.parametrize("call", [
    lambda a: a.malloc(FloatIndex()),
    lambda a: a.malloc(True),
    lambda a: a.malloc(100, FloatIndex()),
    lambda a: a.malloc(100, False),
    lambda a: a.set_memory_limit(FloatIndex()),
    lambda a: a.free(FloatIndex()),
])
def test_bools_and_index_methods_returning_floats_are_type_errors(call):
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    with pytest.raises(TypeError):
        call(a)
    assert a.memory_stats() == _core.CachingAllocator(SimulatedBackend(), 0).memory_stats()


def test_a_second_init_is_refused_and_leaves_the_allocator_working():
    """``__init__`` called again on a live allocator used to reset its
    statistics and replace its address table while segments and blocks
    existed (leaking the table and losing every live block)."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    with pytest.raises(RuntimeError, match="already initialized"):
        a.__init__(SimulatedBackend(), 0)
    assert a.memory_stats() == before
    assert a.owns(p)
    a.free(p)
    a._check_invariants()


@pytest.mark.parametrize("ratio", [float("inf"), float("nan"), 0.5, -1.0])
def test_the_core_refuses_the_max_reserved_ratios_the_configuration_refuses(ratio):
    """The core took inf, which UNIMEM_ALLOC_CONF refuses: one rule in both places."""
    with pytest.raises(ValueError, match="max_reserved_ratio"):
        _core.CachingAllocator(SimulatedBackend(), 0, max_reserved_ratio=ratio)


def test_debug_mode_is_refused_where_the_host_cannot_read_the_memory():
    """Debug mode fills free blocks from the host: on memory the host cannot
    read (a device's, or the simulated backend's made-up addresses) it
    crashed the process at the first fill."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(4096)
    a.free(p)
    with pytest.raises(NotImplementedError, match="host_accessible"):
        a.enable_debug()
    assert not a.debug
    a.free(a.malloc(4096))
    assert a.memory_stats()["allocation.all.current"] == 0


def test_debug_mode_refuses_a_site_function_that_cannot_be_called():
    from tests.helpers.pool_allocators import PageAllocator
    a = _core.CachingAllocator(PageAllocator(), 0)
    with pytest.raises(TypeError, match="site_fn"):
        a.enable_debug(site_fn=42)
    assert not a.debug
