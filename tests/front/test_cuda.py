"""The CUDA backend and unimem.cuda.

Without a GPU (CI): CuPy imports, CUDA reports no device, the facade falls
back (test_cuda_without_a_gpu.py), and everything else runs against a
simulated CUDA runtime (fake_cuda.FakeCudaRuntime) driving the real backend
and front. With a GPU,
the tests at the end run on it; without one they are skipped.
"""
import gc

import pytest

import unimem
from unimem import _core
from unimem.backends.cuda import CUDABackend, CUDAPinnedBackend
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.clients import client_of
from tests.helpers.fake_cuda import CUDA_ERROR_INVALID_DEVICE, CUDARuntimeError, fake  # noqa: F401  (fixture)
from tests.helpers.gpu import requires_gpu

cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")

MiB = 1 << 20


# ---------------------------------------------------------------------------
# the simulated CUDA runtime
# ---------------------------------------------------------------------------
@pytest.fixture
def ucuda(fake):
    import unimem.cuda
    return unimem.cuda


def test_the_allocator_gives_cupy_memory_pointers_from_the_pool(fake, ucuda):
    pointer = ucuda.allocator(1000)
    assert isinstance(pointer, cupy.cuda.MemoryPointer)
    assert pointer.device_id == 0
    assert pointer.mem.size == 1024                        # the block's size, as CuPy's PooledMemory
    s = ucuda.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 1024 and s["requested_bytes.all.current"] == 1000
    assert fake.calls == [("malloc", 0, 2 * MiB)]
    del pointer
    gc.collect()
    assert ucuda.memory_stats(0)["allocated_bytes.all.current"] == 0
    assert ucuda.allocator(0).ptr == 0                     # CuPy may ask for nothing


def test_freed_memory_is_reused(fake, ucuda):
    for _ in range(100):
        ucuda.allocator(64 * 1024)
    s = ucuda.memory_stats(0)
    assert s["num_device_alloc"] == 1 and s["allocation.all.allocated"] == 100


def test_the_pointer_lives_on_the_allocating_device(fake, ucuda):
    fake.setDevice(1)
    try:
        pointer = ucuda.allocator(5 * MiB)
        assert pointer.device_id == 1
        assert fake.calls[-1] == ("malloc", 1, 20 * MiB)
        assert ucuda.memory_allocated(1) == 5 * MiB and ucuda.memory_allocated(0) == 0
        ucuda.set_device(0)
        assert fake.getDevice() == 0 and ucuda.current_device() == 0
        del pointer
        gc.collect()
        ucuda.empty_cache()                   # cudaFree runs with device 1 current (the fake checks)
        assert fake.used == [0, 0] and fake.getDevice() == 0
    finally:
        fake.setDevice(0)


class StreamLike:
    """Any object with a ``ptr`` (a CuPy stream, an external stream)."""

    def __init__(self, ptr):
        self.ptr = ptr


def test_stream_ordered_reuse_and_record_stream(fake, ucuda):
    stream_a, stream_b = 0x1000, 0x2000
    fake.set_stream(stream_a)
    try:
        x = ucuda.allocator(4096)
        ptr = x.mem.ptr
        del x
        fake.set_stream(stream_b)
        y = ucuda.allocator(4096)
        assert y.mem.ptr != ptr, "a block freed on stream A went to stream B"
        fake.set_stream(stream_a)
        z = ucuda.allocator(4096)
        assert z.mem.ptr == ptr
        ucuda.record_stream(z, StreamLike(stream_b))                 # z is also used on B
        del z
        w = ucuda.allocator(4096)
        assert w.mem.ptr != ptr, "reused before stream B's work was done"
        fake.complete(stream_b)
        again = ucuda.allocator(4096)
        assert again.mem.ptr == ptr
        assert fake.events_alive() == 0
        del w, again, y
    finally:
        fake.set_stream(0)


def test_empty_cache_waits_for_recorded_streams(fake, ucuda):
    x = ucuda.allocator(3 * MiB)
    ucuda.record_stream(x, 0x3000)
    del x
    syncs = ucuda.memory_stats(0)["num_sync_all_streams"]
    ucuda.empty_cache()
    s = ucuda.memory_stats(0)
    assert s["num_sync_all_streams"] == syncs + 1 and s["reserved_bytes.all.current"] == 0
    assert fake.events_alive() == 0


def test_out_of_memory_is_unimems_and_cupys(fake, ucuda):
    keep = ucuda.allocator(600 * MiB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        ucuda.allocator(600 * MiB)
    assert isinstance(info.value, unimem.OutOfMemoryError)
    assert "CUDA out of memory. Tried to allocate 600.00 MiB. GPU 0 has a total capacity of" in str(info.value)
    assert "GPU 0 has a total capacity of 1024.00 MiB" in str(info.value)      # PyTorch's wording
    s = ucuda.memory_stats(0)
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1
    assert ucuda.allocator(100 * MiB).mem.size == 100 * MiB          # still usable after
    del keep


def test_other_cuda_errors_propagate(fake):
    backend = CUDABackend(fake)
    with pytest.raises(CUDARuntimeError) as info:
        backend.malloc(100, 5, 0)
    assert info.value.status == CUDA_ERROR_INVALID_DEVICE


def test_memory_info_comes_from_the_device(fake, ucuda):
    ucuda.allocator(30 * MiB)
    free, total = ucuda.get_memory_info(0)
    assert total == 1 << 30 and free == (1 << 30) - 30 * MiB


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


# ---------------------------------------------------------------------------
# MemoryPool: CuPy's API over unimem
# ---------------------------------------------------------------------------
def test_memory_pool_has_cupys_api():
    import unimem.cuda as ucuda
    public = {name for name in dir(cupy.cuda.MemoryPool) if not name.startswith("_")}
    assert public <= {name for name in dir(ucuda.MemoryPool) if not name.startswith("_")}


def test_memory_pool_on_a_simulated_device():
    import unimem.cuda as ucuda
    pool = ucuda.MemoryPool(backend=SimulatedBackend(capacity=256 * MiB))
    a = pool.malloc(1000)
    b = pool.malloc(5 * MiB)
    assert isinstance(a, cupy.cuda.MemoryPointer)
    assert pool.used_bytes() == 1024 + 5 * MiB
    assert pool.total_bytes() == 1024 + 5 * MiB         # CuPy's policy: segments as asked
    assert pool.free_bytes() == pool.total_bytes() - pool.used_bytes() == 0
    del b
    gc.collect()
    assert pool.n_free_blocks() == 1
    pool.free_all_blocks()
    assert pool.total_bytes() == 1024 and pool.n_free_blocks() == 0
    pool.set_limit(size=4 * MiB)
    assert pool.get_limit() == 4 * MiB
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        pool.malloc(4 * MiB)                            # 1024 bytes are in use already
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == 128 * MiB
    pool.set_limit(size=0)
    assert pool.get_limit() == 0
    for bad in (dict(size=1, fraction=0.5), dict(fraction=1.5), dict(size=-1)):
        with pytest.raises(ValueError):
            pool.set_limit(**bad)
    with pytest.warns(DeprecationWarning):
        pool.free_all_free()
    del a


def test_memory_pool_draws_on_unimems_cuda_allocators(fake, ucuda):
    pool = ucuda.MemoryPool()
    pointer = pool.malloc(2 * MiB)
    assert ucuda.memory_allocated(0) == pool.used_bytes() == 2 * MiB
    del pointer


# ---------------------------------------------------------------------------
# pinned host memory
# ---------------------------------------------------------------------------
def test_pinned_backend_and_cupys_pinned_pointer(fake):
    from unimem.host import _PinnedBlock
    backend = CUDAPinnedBackend(fake)
    assert backend.pinning == "cuda"
    pool = _core.CachingAllocator(backend, 0)
    block = pool.allocate(10_000)
    pinned = cupy.cuda.PinnedMemoryPointer(_PinnedBlock(block, 10_000), 0)
    assert pinned.ptr == block.ptr and pinned.size() == 10_000
    assert block.ptr in fake.pinned
    del pinned, block
    gc.collect()
    pool.empty_cache()
    assert fake.pinned == {}


def test_the_host_pool_pins_with_cuda_when_there_is_a_gpu(fake):
    from unimem import host
    assert host._choose_backend().pinning == "cuda"


# ---------------------------------------------------------------------------
# on a real GPU
# ---------------------------------------------------------------------------
gpu = requires_gpu


@gpu
def test_gpu_cupy_arrays_through_the_allocator_are_right():
    import numpy as np

    import unimem.cuda as ucuda
    with cupy.cuda.using_allocator(ucuda.allocator):
        a = cupy.arange(4096 * 4096, dtype=cupy.float32).reshape(4096, 4096) / 1e6
        b = a @ a.T
        expected = cupy.asnumpy(a).astype(np.float64)
        np.testing.assert_allclose(cupy.asnumpy(b)[:8, :8], (expected @ expected.T)[:8, :8], rtol=1e-3)
        c = cupy.empty((1024, 1024), cupy.float32)       # may need a segment (cuBLAS took the free ones)
        del c
        before = ucuda.memory_stats()["num_device_alloc"]
        for _ in range(50):
            c = cupy.empty((1024, 1024), cupy.float32)
            del c
        assert ucuda.memory_stats()["num_device_alloc"] == before


@gpu
def test_gpu_two_streams_and_record_stream():
    import unimem.cuda as ucuda
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(ucuda.allocator):
        with s1:
            x = cupy.ones(1 << 20, cupy.float32)
            ptr = x.data.mem.ptr
        with s2:
            y = x * 2                                   # x is used on s2
            ucuda.record_stream(x, s2)
        del x
        with s1:
            z = cupy.empty(1 << 20, cupy.float32)
            if not s2.done:
                assert z.data.mem.ptr != ptr
        s2.synchronize()
        assert float(y.sum()) == 2.0 * (1 << 20)


@gpu
def test_gpu_oom_then_still_usable():
    import unimem.cuda as ucuda
    free, total = ucuda.get_memory_info()
    with cupy.cuda.using_allocator(ucuda.allocator):
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
            cupy.empty(total * 2, cupy.uint8)
        assert ucuda.memory_stats()["num_ooms"] >= 1
        assert int(cupy.ones(10).sum()) == 10


@gpu
def test_gpu_memory_pool_parity_with_cupys():
    import unimem.cuda as ucuda
    ours, theirs = ucuda.MemoryPool(), cupy.cuda.MemoryPool()
    for pool in (ours, theirs):
        with cupy.cuda.using_allocator(pool.malloc):
            a = cupy.empty(1 << 20, cupy.uint8)
            assert pool.used_bytes() >= 1 << 20
            del a
            assert pool.free_bytes() >= 1 << 20
            pool.free_all_blocks()
            pool.set_limit(size=1 << 30)
            assert pool.get_limit() == 1 << 30
            pool.set_limit(size=0)


@gpu
def test_gpu_pinned_copies_both_ways():
    import numpy as np

    import unimem.cuda as ucuda
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)
    try:
        with cupy.cuda.using_allocator(ucuda.allocator):
            host = np.arange(1 << 20, dtype=np.float32)
            device = cupy.asarray(host)
            back = cupy.asnumpy(device, stream=cupy.cuda.Stream(), blocking=True)
            np.testing.assert_array_equal(back, host)
        assert unimem.host_memory_stats().get("num_host_alloc", 0) >= 1
        assert unimem.host.backend_name() == "cuda"
    finally:
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        cupy.cuda.set_allocator(previous)


def test_cupys_pinned_blocks_are_cupys():
    """unimem.host.pinned_allocator (cupy.cuda.set_pinned_memory_allocator's)
    hands out the pinned pool's blocks as CuPy's."""
    pointer = unimem.host.pinned_allocator(5000)
    pool = unimem.host.caching_allocator()
    assert client_of(pool, pointer.ptr) == "cupy"
    assert pool.memory_allocated_by_client()["cupy"] >= 5120
    del pointer


def test_host_memory_stats_has_every_key_zeroed_before_the_first_pinned_allocation():
    """PyTorch's host_memory_stats gives its keys, zero, before any pinned
    allocation; unimem's gave {} (a KeyError for ["num_host_alloc"])."""
    import json
    import subprocess
    import sys
    script = (
        "import json, unimem\n"
        "before = dict(unimem.host_memory_stats())\n"
        "nested = unimem.host.host_memory_stats_as_nested_dict()\n"
        "unimem.host.caching_host_delete(unimem.host.caching_host_alloc(1000))\n"
        "after = dict(unimem.host_memory_stats())\n"
        "print(json.dumps([before, after, sorted(nested)]))\n")
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    before, after, nested_keys = json.loads(result.stdout.strip().splitlines()[-1])
    assert before, "no keys before the first pinned allocation"
    assert sorted(before) == sorted(after)
    assert all(value == 0 for value in before.values())
    assert before["num_host_alloc"] == 0 and after["num_host_alloc"] == 1
    assert {"allocated", "allocated_bytes", "segment", "reserved_bytes", "num_host_alloc",
            "host_alloc_time", "host_free_time"} <= set(nested_keys)


def test_synchronize_waits_for_every_stream_of_the_device(fake):
    """``unimem.accelerator.synchronize`` on CUDA: ``cudaDeviceSynchronize``."""
    backend = CUDABackend(fake)
    fake.launch(stream=5)
    event = backend.record_event(5, 0)
    assert not backend.event_done(event)
    backend.synchronize(0)
    assert backend.event_done(event)
