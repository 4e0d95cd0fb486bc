"""Pools and backends as types, not strings: the Pool of every allocator, the
Backend Protocol and the wrappers that forward it, and dpnp routing that no
longer hides unimem's own errors."""
import gc
import os
import pickle

import pytest

import unimem
import unimem.cuda as ucuda
from unimem import host
from unimem._runtime import devices as _devices
from unimem._runtime.pools import Pool, PoolKind, named_pools
from unimem.backends._host import PageAlignedBackend
from unimem.backends.base import REQUIRED_MEMBERS, Backend, backend_members
from unimem.backends.faults import FaultInjectingBackend
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fake_cuda import fake, raw_allocator_of  # noqa: F401  (fixture)
from tests.helpers.minimal_backend import MinimalBackend

GiB = 1 << 30


# ---------------------------------------------------------------------------
# Pool
# ---------------------------------------------------------------------------
def test_every_allocator_knows_its_pool():
    cpu = unimem.cpu.caching_allocator(0)
    assert _devices.pool_of(cpu) == Pool(PoolKind.DEVICE, "cpu", "cpu", "CPU", None, None)
    assert _devices.pool_of(host.caching_allocator()) is host.POOL
    assert host.POOL.kind is PoolKind.PINNED_HOST and host.POOL.device_type == "cpu"


def test_pool_labels_are_derived_in_one_place():
    assert _devices.DEVICE_POOLS["xpu"].label(1) == "xpu:1"
    assert host.POOL.label(0) == "host"
    assert [p.kind for p in named_pools()][:3] == [PoolKind.DEVICE] * 3


def test_new_allocator_takes_a_pool_not_a_string():
    with pytest.raises(TypeError, match="Pool"):
        _devices.new_allocator("cpu", SimulatedBackend(), 0)


def test_a_pool_names_a_known_device_type():
    with pytest.raises(ValueError, match="unknown device type"):
        Pool(PoolKind.DEVICE, "cuda-pool", "cuda-pool", "GPU", None, None)


# ---------------------------------------------------------------------------
# reproduced bugs (a) and (b): an out-of-memory in a MemoryPool(allocator=...)
# ---------------------------------------------------------------------------
def _exhaust(pool):
    with pytest.raises(MemoryError):
        pool.malloc(4 * GiB)          # the fake GPU holds 1 GiB


def test_out_of_memory_in_a_cupy_allocator_pool_names_a_cuda_device(fake):
    """(a) The stats observer got device("xpu", 0): the pool string
    "cuda-pool" was guessed to be an XPU pool."""
    pytest.importorskip("cupy")
    seen = []

    def observer(device, requested, stats):
        seen.append(device)

    unimem.attach_out_of_memory_stats_observer(observer)
    try:
        pool = ucuda.MemoryPool(raw_allocator_of(fake))
        _exhaust(pool)
    finally:
        unimem.detach_out_of_memory_stats_observer(observer)
    assert seen == [unimem.device("cuda", 0)]


def test_out_of_memory_snapshot_of_a_cupy_allocator_pool_is_written(fake, tmp_path, monkeypatch):
    """(b) With UNIMEM_OOM_SNAPSHOT set, the writer looked the pool's registry
    up by its string and raised ValueError("unknown device type 'cuda-pool'")
    as an unraisable, writing nothing."""
    pytest.importorskip("cupy")
    path = tmp_path / "oom.pickle"
    monkeypatch.setenv("UNIMEM_OOM_SNAPSHOT", str(path))
    pool = ucuda.MemoryPool(raw_allocator_of(fake))
    kept = pool.malloc(1 << 20)
    _exhaust(pool)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["allocator_settings"]["pool"] == "cuda-pool"
    assert [s["address"] for s in snapshot["segments"]] == [kept.ptr]


def test_a_cupy_allocator_pool_does_not_keep_its_memory_pool_alive(fake):
    pool = ucuda.MemoryPool(raw_allocator_of(fake))
    block = pool.malloc(1024)
    own_pool = _devices.pool_of(block.mem.allocation.allocator)
    assert own_pool.kind is PoolKind.CUPY_POOL and own_pool.registry() is pool._registry
    del pool
    gc.collect()
    assert own_pool.existing_registry() is None     # the block lives on, the MemoryPool is gone


# ---------------------------------------------------------------------------
# the Backend Protocol, and wrappers that forward all of it
# ---------------------------------------------------------------------------
class DuckBackend(MinimalBackend):
    """A backend that does not subclass Backend: malloc, free and a 1 GiB
    single-allocation limit, nothing else."""

    def max_allocation_size(self, device):
        return GiB


def test_fault_injector_keeps_the_single_allocation_limit_of_any_backend():
    """(c) The fault injector forwarded a fixed list of methods: over a
    backend that lacks one of them (here memory_info) it raised
    AttributeError, and its own defaults hid what the inner backend lacks."""
    wrapped = FaultInjectingBackend(DuckBackend())
    allocator = _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], wrapped, 0)
    assert allocator.max_allocation_size == GiB
    with pytest.raises(unimem.OutOfMemoryError, match="at most"):
        allocator.malloc(2 * GiB)
    for name in backend_members() - {"malloc", "free", "map_pages", "_raw_api", "_raw_owner"}:
        assert hasattr(wrapped, name) == hasattr(wrapped.inner, name), name


def test_fault_injector_over_a_simulated_backend_forwards_its_limit():
    class Limited(SimulatedBackend):
        def max_allocation_size(self, device):
            return GiB

    allocator = _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], FaultInjectingBackend(Limited()), 0)
    assert allocator.max_allocation_size == GiB


def test_fault_injector_withholds_the_c_entry_points_so_faults_are_injected():
    wrapped = FaultInjectingBackend(PageAlignedBackend("CPU"), refuse_malloc={1, 2})
    assert not wrapped._raw_api
    allocator = _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], wrapped, 0)
    with pytest.raises(unimem.OutOfMemoryError):
        allocator.malloc(4096)
    assert wrapped.refused == 2


WITHHELD = {"_raw_api", "_raw_owner"}      # the C entry points would bypass the wrapper's malloc


@pytest.mark.parametrize("wrapper, intercepted", [
    (FaultInjectingBackend, REQUIRED_MEMBERS | WITHHELD | {"map_pages"}),   # faults while mapping
    (ucuda._CupyAllocatorBackend, REQUIRED_MEMBERS | WITHHELD | {"host_accessible"}),
])
def test_wrappers_forward_every_member_of_the_protocol(wrapper, intercepted):
    """Every member of Backend, including one added later, is forwarded to
    the inner backend unless the wrapper says it intercepts it; what it
    intercepts is reviewed here."""
    assert wrapper.__intercepted_members__ == intercepted
    assert wrapper.__forwarded_members__ == backend_members() - intercepted
    for name in REQUIRED_MEMBERS:
        assert name in vars(wrapper), name


def test_the_protocol_declares_what_the_core_asks():
    assert {"malloc", "free", "memory_info", "max_allocation_size", "record_event", "event_done",
            "event_synchronize", "release_event", "check_stream", "release_stream", "abandoned_streams", "synchronize",
            "api_name", "name", "host_accessible", "survives_fork", "_raw_api", "_raw_owner"} <= backend_members()
    assert isinstance(SimulatedBackend(), Backend)


def test_page_aligned_backend_is_a_backend():
    assert isinstance(PageAlignedBackend("CPU"), Backend)


def test_no_fork_handler_outside_the_runtime():
    """One fork handler: unimem._runtime.fork registers it, nobody else."""
    package = os.path.dirname(unimem.__file__)
    registering = []
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith((".py", ".pyx")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    if "register_at_fork(" in f.read():
                        registering.append(os.path.relpath(path, package))
    assert registering == [os.path.join("_runtime", "fork.py")]
