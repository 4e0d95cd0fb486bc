"""``unimem.cuda.allocator`` on a one-GPU machine wired as CuPy wires it.

There the allocator takes its short way (``unimem/_integrations/cupy.pyx``):
the stream key is read inline from CuPy's current stream instead of through
the registry's stream function. These tests run that way without a GPU: a
simulated one-GPU runtime whose type keeps unimem's default stream function
(``cupy_current_stream_key``), with CuPy's ``get_current_stream`` replaced by
the simulation's current stream.
"""
import threading
import types

import pytest

import unimem
from unimem._runtime import devices as _devices
from unimem.backends import cuda as cuda_backend

from tests.helpers.clients import client_of
from tests.helpers.crash_guard import run_python
from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda

cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")

MiB = 1 << 20


@pytest.fixture
def one_gpu(monkeypatch):
    """A one-GPU simulated runtime serving ``cuda`` with the stream function
    a real GPU gets; CuPy's current stream is the simulation's."""
    runtime = FakeCudaRuntime(devices=1, capacity=64 * MiB)
    monkeypatch.setattr(cuda_backend, "_get_current_stream",
                        lambda device: types.SimpleNamespace(ptr=runtime.current_stream(device)))
    with serving_cuda(runtime, cupy_streams=True):
        registry = _devices.get_type("cuda").registry
        assert registry.current_stream_fn is cuda_backend.cupy_current_stream_key   # the short way's condition
        yield runtime


def stats():
    import unimem.cuda as ucuda
    return ucuda.memory_stats(0)


def test_blocks_are_reused_on_the_stream_that_freed_them(one_gpu):
    import unimem.cuda as ucuda
    one_gpu.set_stream(7)
    first = ucuda.allocator(1000)
    address = first.ptr
    del first
    one_gpu.set_stream(9)
    other = ucuda.allocator(1000)
    assert other.ptr != address                      # stream 7's free block is not 9's
    one_gpu.set_stream(7)
    again = ucuda.allocator(1000)
    assert again.ptr == address
    s = stats()
    assert s["allocation.all.current"] == 2 and s["num_device_alloc"] == 2   # a segment per stream
    del other, again


def test_the_short_ways_blocks_are_cupys(one_gpu):
    import unimem.cuda as ucuda
    pointer = ucuda.allocator(1000)
    assert client_of(ucuda.caching_allocator(0), pointer.ptr) == "cupy"
    assert ucuda.memory_allocated_by_client(0) == {"cupy": 1024}
    del pointer
    assert ucuda.memory_allocated_by_client(0) == {}


def test_per_thread_default_streams_are_keyed_per_thread(one_gpu):
    """cudaStreamPerThread (2) names each thread's own stream: a block freed
    on it in one thread is not another thread's at once."""
    import unimem.cuda as ucuda
    seen = {}

    def in_thread(name, keep):
        one_gpu.set_stream(cuda_backend.CUDA_STREAM_PER_THREAD)
        pointer = ucuda.allocator(4096)
        seen[name] = pointer.ptr
        if keep:
            seen[name + " kept"] = pointer
    first = threading.Thread(target=in_thread, args=("a", False))
    first.start(), first.join()
    second = threading.Thread(target=in_thread, args=("b", True))
    second.start(), second.join()
    assert seen["a"] != seen["b"]
    one_gpu.set_stream(cuda_backend.CUDA_STREAM_PER_THREAD)
    mine = [ucuda.allocator(4096) for _ in range(2)]
    assert seen["a"] not in {p.ptr for p in mine}   # thread a's block is keyed to thread a
    del mine, seen["b kept"]


def test_what_cupy_gets_back(one_gpu):
    import unimem.cuda as ucuda
    pointer = ucuda.allocator(1000)
    assert isinstance(pointer, cupy.cuda.MemoryPointer) and pointer.device_id == 0
    assert isinstance(pointer.mem, ucuda.PooledMemory) and pointer.mem.size == 1024
    assert pointer.mem.allocation.size == 1000
    assert stats()["requested_bytes.all.current"] == 1000
    pointer.mem.free()
    assert stats()["allocated_bytes.all.current"] == 0
    empty = ucuda.allocator(0)
    assert empty.ptr == 0 and empty.mem.size == 0 and empty.device_id == 0


def test_out_of_memory_is_cupys_error_too_and_changes_nothing(one_gpu):
    import unimem.cuda as ucuda
    kept = ucuda.allocator(MiB)
    before = stats()
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        ucuda.allocator(128 * MiB)
    assert isinstance(info.value, unimem.OutOfMemoryError)
    after = stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] == 2 * MiB - MiB
    del kept


@pytest.mark.parametrize("size, error", [(-1, ValueError), ("1000", TypeError), (1.5, TypeError)])
def test_bad_sizes_are_refused_and_change_nothing(one_gpu, size, error):
    import unimem.cuda as ucuda
    kept = ucuda.allocator(1000)
    before = stats()
    with pytest.raises(error):
        ucuda.allocator(size)
    assert stats() == before
    del kept


def test_a_stream_that_cannot_be_read_is_an_error_that_changes_nothing(one_gpu, monkeypatch):
    import unimem.cuda as ucuda
    kept = ucuda.allocator(1000)
    before = stats()

    def broken(device):
        raise RuntimeError("no current stream")
    monkeypatch.setattr(cuda_backend, "_get_current_stream", broken)
    with pytest.raises(RuntimeError, match="no current stream"):
        ucuda.allocator(1000)
    assert stats() == before
    del kept


def test_the_allocator_unpickled_in_a_fresh_process_works(one_gpu):
    """Dask's ``client.run(cupy.cuda.set_allocator, unimem.cuda.allocator)``
    and spawned processes unpickle the function where unimem.cuda may not be
    imported: it is pickled by its name in unimem.cuda, and works from
    wherever it was reached first (the C function was unbound there)."""
    import base64
    import pickle

    import unimem.cuda as ucuda
    assert pickle.loads(pickle.dumps(ucuda.allocator)) is ucuda.allocator
    payload = base64.b64encode(pickle.dumps(ucuda.allocator)).decode()
    code = f"""
import base64, pickle, sys, types
allocator = pickle.loads(base64.b64decode({payload!r}))
from unimem._integrations.cupy import allocator as direct
assert direct is allocator
from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda
from unimem.backends import cuda as cuda_backend
cuda_backend._get_current_stream = lambda device: types.SimpleNamespace(ptr=0)
with serving_cuda(FakeCudaRuntime(devices=1, capacity=1 << 26), cupy_streams=True):
    pointer = allocator(1000)
    assert pointer.mem.size == 1024, pointer.mem.size
print("PASSED")
"""
    run_python(code)


def test_the_cupy_glue_allocates_without_importing_unimem_cuda():
    """The glue sits below the namespace that exports it: it allocates, wraps
    the block in unimem.cuda's PooledMemory and raises unimem.cuda's
    OutOfMemoryError (also CuPy's) in a process that never imports
    unimem.cuda (it imported unimem.cuda to be bound by it: a cycle)."""
    code = """
import sys, types
import cupy
from unimem._integrations.cupy import allocator
from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda
from unimem.backends import cuda as cuda_backend
cuda_backend._get_current_stream = lambda device: types.SimpleNamespace(ptr=0)
with serving_cuda(FakeCudaRuntime(devices=1, capacity=1 << 26), cupy_streams=True):
    pointer = allocator(1000)
    assert pointer.mem.size == 1024 and type(pointer.mem).__qualname__ == "PooledMemory", pointer.mem
    assert type(pointer.mem).__module__ == "unimem.cuda"
    try:
        allocator(1 << 27)
    except cupy.cuda.memory.OutOfMemoryError as error:
        assert type(error).__module__ == "unimem.cuda" and error.requested == 1 << 27, error
    else:
        raise AssertionError("no out-of-memory error")
    pointer.mem.free()
assert "unimem.cuda" not in sys.modules, "the CuPy glue imported the namespace"
print("PASSED")
"""
    run_python(code)


def test_threads_first_allocations_share_one_pooled_memory_class(one_gpu, monkeypatch):
    """The classes are made at the first allocation; threads making their
    first ones at once got different PooledMemory classes (isinstance of
    unimem.cuda.PooledMemory then failed for some blocks)."""
    import time

    from unimem._integrations import cupy_memory
    monkeypatch.setattr(cupy_memory, "_MEMORY_CLASSES", None)
    real_cupy = cupy_memory._cupy

    def slow_cupy():                    # the window in which another thread arrives
        time.sleep(0.05)
        return real_cupy()
    monkeypatch.setattr(cupy_memory, "_cupy", slow_cupy)
    barrier = threading.Barrier(6)
    made = []

    def first():
        barrier.wait()
        made.append(cupy_memory.memory_classes())
    threads = [threading.Thread(target=first) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(classes) for classes in made}) == 1 and len(made) == 6
