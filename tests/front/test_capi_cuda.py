"""unimem's C ABI on CUDA (``unimem_cuda_malloc``/``free``, what PyTorch's
CUDAPluggableAllocator calls), over the simulated CUDA runtime: the pools
are unimem.cuda's, shared with CuPy's allocator, keyed by stream as
unimem.cuda keys CuPy's requests."""
import ctypes
import gc
import threading

import pytest

from unimem._runtime import devices as _devices
from unimem.backends.cuda import per_thread_stream_key

from tests.helpers.capi import CUDA, last_error, library
from tests.helpers.clients import client_of
from tests.helpers.fake_cuda import FakeCudaRuntime, fake, serving_cuda  # noqa: F401  (fixture)

MiB = 1 << 20
PER_THREAD = ctypes.c_void_p(2)                         # cudaStreamPerThread


@pytest.fixture(scope="module")
def lib():
    return library()


@pytest.fixture
def ucuda(fake):
    import unimem.cuda
    return unimem.cuda


def stream_of(ucuda, ptr, device=0):
    return ucuda.caching_allocator(device).live_allocations()[ptr][2]


def test_a_block_from_c_is_unimem_cudas(lib, fake, ucuda):
    ptr = lib.unimem_cuda_malloc(1000, 0, None)
    assert ptr and ptr in fake.live and fake.live[ptr][0] == 0
    stats = ucuda.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == 1024 and stats["requested_bytes.all.current"] == 1000
    assert lib.unimem_memory_allocated(CUDA, 0) == 1024 and lib.unimem_memory_reserved(CUDA, 0) == 2 * MiB
    lib.unimem_cuda_free(ptr, 1000, 0, None)
    assert ucuda.memory_allocated(0) == 0 and ucuda.memory_reserved(0) == 2 * MiB
    assert lib.unimem_empty_cache(CUDA) == 0
    assert ucuda.memory_reserved(0) == 0 and not fake.live


def test_cupy_and_c_share_the_pool(lib, fake, ucuda):
    """A block CuPy's allocator let go of is the next C request's, and the
    statistics count both."""
    pointer = ucuda.allocator(4096)
    address = pointer.mem.ptr
    from_c = lib.unimem_cuda_malloc(4096, 0, None)
    stats = ucuda.memory_stats(0)
    assert stats["allocation.all.current"] == 2 and stats["num_device_alloc"] == 1
    del pointer
    gc.collect()
    again = lib.unimem_cuda_malloc(4096, 0, None)
    assert again == address
    for ptr in (from_c, again):
        lib.unimem_cuda_free(ptr, 4096, 0, None)
    again = ucuda.allocator(4096)
    assert again.mem.ptr in (address, from_c)
    assert ucuda.memory_stats(0)["allocation.all.allocated"] == 4


def test_c_and_pytorch_through_the_abi_are_told_apart(lib, fake, ucuda):
    """unimem_cuda_malloc's blocks are C code's; unimem_torch_cuda_malloc's,
    the same function for PyTorch's pluggable allocator, PyTorch's; CuPy's
    allocator beside them is CuPy's."""
    from_c = lib.unimem_cuda_malloc(1000, 0, None)
    from_torch = lib.unimem_torch_cuda_malloc(3000, 0, None)
    pointer = ucuda.allocator(5000)
    allocator = ucuda.caching_allocator(0)
    assert [client_of(allocator, p) for p in (from_c, from_torch, pointer.mem.ptr)] == ["c", "torch", "cupy"]
    assert ucuda.memory_allocated_by_client(0) == {"torch": 3072, "cupy": 5120, "c": 1024}
    assert sum(ucuda.memory_allocated_by_client(0).values()) == ucuda.memory_allocated(0)
    lib.unimem_torch_cuda_free(from_torch, 3000, 0, None)
    lib.unimem_cuda_free(from_c, 1000, 0, None)
    assert ucuda.memory_allocated_by_client(0) == {"cupy": 5120}
    assert lib.unimem_torch_cuda_malloc(-1, 0, None) is None and last_error(lib) == "ValueError: a negative size"


def test_the_device_argument_picks_the_pool(lib, fake, ucuda):
    ptr = lib.unimem_cuda_malloc(5 * MiB, 1, None)
    assert fake.live[ptr][0] == 1
    assert ucuda.memory_allocated(1) == 5 * MiB and ucuda.memory_allocated(0) == 0
    lib.unimem_cuda_free(ptr, 5 * MiB, 1, None)
    assert ucuda.memory_allocated(1) == 0
    assert lib.unimem_cuda_malloc(64, 2, None) is None
    assert last_error(lib) == "InvalidDeviceError: device index 2 is out of range: cuda has 2 devices"


def test_blocks_are_reused_in_stream_order(lib, fake, ucuda):
    stream_a, stream_b = ctypes.c_void_p(0x1000), ctypes.c_void_p(0x2000)
    ptr = lib.unimem_cuda_malloc(4096, 0, stream_a)
    assert stream_of(ucuda, ptr) == 0x1000
    lib.unimem_cuda_free(ptr, 4096, 0, stream_a)
    on_b = lib.unimem_cuda_malloc(4096, 0, stream_b)
    assert on_b != ptr, "a block freed on stream A went to stream B"
    on_a = lib.unimem_cuda_malloc(4096, 0, stream_a)
    assert on_a == ptr
    # CuPy's requests on the same stream are keyed alike
    fake.set_stream(0x1000)
    try:
        lib.unimem_cuda_free(on_a, 4096, 0, stream_a)
        assert ucuda.allocator(4096).mem.ptr == ptr
    finally:
        fake.set_stream(0)
    lib.unimem_cuda_free(on_b, 4096, 0, stream_b)


def test_the_per_thread_default_stream_is_keyed_per_thread(lib, fake, ucuda):
    """cudaStreamPerThread names each thread's own stream: the key is
    unimem.cuda's per-thread key of the calling thread (Python's or not)."""
    ptr = lib.unimem_cuda_malloc(4096, 0, PER_THREAD)
    assert stream_of(ucuda, ptr) == per_thread_stream_key()
    lib.unimem_cuda_free(ptr, 4096, 0, PER_THREAD)
    seen = []

    def other_thread():
        p = lib.unimem_cuda_malloc(4096, 0, PER_THREAD)
        seen.append((p, stream_of(ucuda, p), per_thread_stream_key()))
        lib.unimem_cuda_free(p, 4096, 0, PER_THREAD)
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    (other, other_key, its_own_key), = seen
    assert other_key == its_own_key != per_thread_stream_key()
    assert other != ptr, "another thread's per-thread stream got this thread's block"
    assert lib.unimem_cuda_malloc(4096, 0, PER_THREAD) == ptr


def test_a_block_used_on_another_stream_waits_for_it(lib, fake, ucuda):
    """record_stream from Python on a block from C, freed from C (no GIL):
    not reused before the other stream's work is done."""
    stream_a = ctypes.c_void_p(0x1000)
    ptr = lib.unimem_cuda_malloc(4096, 0, stream_a)
    ucuda.record_stream(ptr, 0x2000)
    lib.unimem_cuda_free(ptr, 4096, 0, stream_a)
    assert lib.unimem_cuda_malloc(4096, 0, stream_a) != ptr, "reused before stream B's work was done"
    fake.complete(0x2000)
    assert lib.unimem_cuda_malloc(4096, 0, stream_a) == ptr
    assert fake.events_alive() == 0


def test_out_of_memory_is_null_and_counted(lib, fake, ucuda):
    assert lib.unimem_cuda_malloc(2 << 30, 0, None) is None
    assert last_error(lib).startswith("OutOfMemoryError: CUDA out of memory")
    assert ucuda.memory_stats(0)["num_ooms"] == 1


def test_a_new_cuda_runtime_gets_new_pools():
    """The device type is replaced (here: another simulated runtime; on a
    GPU, change_current_allocator): the C entries follow it."""
    lib = library()
    first = FakeCudaRuntime(devices=1)
    with serving_cuda(first):
        ptr = lib.unimem_cuda_malloc(4096, 0, None)
        assert ptr in first.live
        lib.unimem_cuda_free(ptr, 4096, 0, None)
    second = FakeCudaRuntime(devices=1)
    with serving_cuda(second):
        ptr = lib.unimem_cuda_malloc(4096, 0, None)
        assert ptr in second.live
        assert _devices.get_type("cuda").allocator(0).owns(ptr)
        lib.unimem_cuda_free(ptr, 4096, 0, None)
