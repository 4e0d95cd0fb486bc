"""``unimem.cuda.MemoryPool`` held to CuPy's own expectations.

Ported (in our own code) from CuPy's ``tests/cupy_tests/cuda_tests/test_memory.py``:
each test names the upstream test it comes from. They run on the simulated
CUDA runtime (``fake_cuda``). The stream expectations are in
``test_cuda_streams.py``.

Pools with allocators of their own (``MemoryPool(allocator)``,
``MemoryPool(backend=...)``) follow CuPy's segment policy, so CuPy's numbers
hold exactly. ``MemoryPool()`` shares ``unimem.cuda``'s allocators and keeps
PyTorch's policy (2 MiB / 20 MiB segments): the numbers that depend on the
policy differ there, by design, and are tested as such.
"""
import gc
import pickle
import warnings

import pytest

import unimem.cuda as ucuda
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fake_cuda import fake, on_stream, raw_allocator_of  # noqa: F401  (fixtures)

cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
memory = cupy.cuda.memory

UNIT = 512                       # cupy.cuda.memory._allocation_unit_size
MiB = 1 << 20
CAPACITY = 1 << 30
OWN_POOLS = ("MemoryPool(allocator)", "MemoryPool(backend=...)")
ALL_POOLS = OWN_POOLS + ("MemoryPool()",)

def make_pool(setup, runtime):
    if setup == "MemoryPool()":
        return ucuda.MemoryPool()
    if setup == "MemoryPool(allocator)":
        return ucuda.MemoryPool(raw_allocator_of(runtime))
    return ucuda.MemoryPool(backend=SimulatedBackend(capacity=CAPACITY))


@pytest.fixture(params=OWN_POOLS)
def pool(request, fake):
    pool = make_pool(request.param, fake)
    yield pool
    gc.collect()
    pool.set_limit(size=0)
    pool.free_all_blocks()


@pytest.fixture(params=ALL_POOLS)
def any_pool(request, fake):
    pool = make_pool(request.param, fake)
    yield pool
    gc.collect()
    pool.set_limit(size=0)
    pool.free_all_blocks()


# ---------------------------------------------------------------------------
# TestSingleDeviceMemoryPool
# ---------------------------------------------------------------------------
def test_round_size(any_pool):
    """TestSingleDeviceMemoryPool.test_round_size: through the block sizes."""
    assert any_pool.malloc(UNIT - 1).mem.size == UNIT
    assert any_pool.malloc(UNIT).mem.size == UNIT
    assert any_pool.malloc(UNIT + 1).mem.size == UNIT * 2


def test_alloc(any_pool):
    """TestSingleDeviceMemoryPool.test_alloc."""
    p1 = any_pool.malloc(UNIT * 4)
    p2 = any_pool.malloc(UNIT * 4)
    p3 = any_pool.malloc(UNIT * 8)
    assert len({p1.ptr, p2.ptr, p3.ptr}) == 3


def test_alloc_split(any_pool):
    """TestSingleDeviceMemoryPool.test_alloc_split."""
    p = any_pool.malloc(UNIT * 4)
    ptr = p.ptr
    del p
    head = any_pool.malloc(UNIT * 2)
    tail = any_pool.malloc(UNIT * 2)
    assert ptr == head.ptr
    assert ptr + UNIT * 2 == tail.ptr


def test_alloc_limit(any_pool):
    """TestSingleDeviceMemoryPool.test_alloc_limit."""
    any_pool.set_limit(size=UNIT * 6)
    p1 = any_pool.malloc(UNIT * 5)
    p2 = any_pool.malloc(UNIT * 1)
    with pytest.raises(memory.OutOfMemoryError):
        any_pool.malloc(UNIT)
    any_pool.set_limit(size=UNIT * 7)
    p3 = any_pool.malloc(UNIT)
    del p1, p2, p3


def test_alloc_limit_fragmented(any_pool):
    """TestSingleDeviceMemoryPool.test_alloc_limit_fragmented (CuPy #7678)."""
    any_pool.set_limit(size=UNIT * 6)
    p1 = any_pool.malloc(UNIT * 5)
    del p1
    p2 = any_pool.malloc(UNIT * 6)
    del p2


def test_free(any_pool):
    """TestSingleDeviceMemoryPool.test_free."""
    p1 = any_pool.malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    p2 = any_pool.malloc(UNIT * 4)
    assert ptr1 == p2.ptr


def test_free_merge(any_pool):
    """TestSingleDeviceMemoryPool.test_free_merge."""
    p = any_pool.malloc(UNIT * 4)
    ptr = p.ptr
    del p
    head = any_pool.malloc(UNIT * 2)           # merge head into tail
    tail = any_pool.malloc(UNIT * 2)
    assert ptr == head.ptr
    del tail
    del head
    p = any_pool.malloc(UNIT * 4)
    assert ptr == p.ptr
    del p
    head = any_pool.malloc(UNIT * 2)           # merge tail into head
    tail = any_pool.malloc(UNIT * 2)
    assert ptr == head.ptr
    del head
    del tail
    p = any_pool.malloc(UNIT * 4)
    assert ptr == p.ptr


def test_free_different_size(pool):
    """TestSingleDeviceMemoryPool.test_free_different_size."""
    p1 = pool.malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    p2 = pool.malloc(UNIT * 8)
    assert ptr1 != p2.ptr


def test_free_all_blocks(any_pool):
    """TestSingleDeviceMemoryPool.test_free_all_blocks."""
    p1 = any_pool.malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    any_pool.free_all_blocks()
    p2 = any_pool.malloc(UNIT * 4)
    assert ptr1 != p2.ptr


def test_free_all_blocks_split(any_pool):
    """TestSingleDeviceMemoryPool.test_free_all_blocks_split: split blocks stay."""
    p = any_pool.malloc(UNIT * 4)
    del p
    head = any_pool.malloc(UNIT * 2)
    tail = any_pool.malloc(UNIT * 2)
    tailptr = tail.ptr
    del tail
    any_pool.free_all_blocks()
    p = any_pool.malloc(UNIT * 2)
    assert tailptr == p.ptr
    del head


def test_free_all_free(any_pool):
    """TestSingleDeviceMemoryPool.test_free_all_free."""
    p1 = any_pool.malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    with pytest.warns(DeprecationWarning):
        any_pool.free_all_free()
    p2 = any_pool.malloc(UNIT * 4)
    assert ptr1 != p2.ptr


def test_used_bytes(any_pool):
    """TestSingleDeviceMemoryPool.test_used_bytes."""
    p1 = any_pool.malloc(UNIT * 2)
    assert UNIT * 2 == any_pool.used_bytes()
    p2 = any_pool.malloc(UNIT * 4)
    assert UNIT * 6 == any_pool.used_bytes()
    del p2
    assert UNIT * 2 == any_pool.used_bytes()
    del p1
    assert UNIT * 0 == any_pool.used_bytes()
    p3 = any_pool.malloc(UNIT * 1)
    assert UNIT * 1 == any_pool.used_bytes()
    del p3


def test_used_bytes_stream(any_pool, on_stream):
    """TestSingleDeviceMemoryPool.test_used_bytes_stream."""
    p1 = any_pool.malloc(UNIT * 4)
    del p1
    with on_stream(0x1000):
        p2 = any_pool.malloc(UNIT * 2)
    assert UNIT * 2 == any_pool.used_bytes()
    del p2


def test_free_bytes(pool):
    """TestSingleDeviceMemoryPool.test_free_bytes."""
    p1 = pool.malloc(UNIT * 2)
    assert UNIT * 0 == pool.free_bytes()
    p2 = pool.malloc(UNIT * 4)
    assert UNIT * 0 == pool.free_bytes()
    del p2
    assert UNIT * 4 == pool.free_bytes()
    del p1
    assert UNIT * 6 == pool.free_bytes()
    p3 = pool.malloc(UNIT * 1)
    assert UNIT * 5 == pool.free_bytes()
    del p3


def test_free_bytes_stream(pool, on_stream):
    """TestSingleDeviceMemoryPool.test_free_bytes_stream."""
    p1 = pool.malloc(UNIT * 4)
    del p1
    with on_stream(0x1000):
        p2 = pool.malloc(UNIT * 2)
    assert UNIT * 4 == pool.free_bytes()
    del p2


def test_total_bytes(pool):
    """TestSingleDeviceMemoryPool.test_total_bytes."""
    p1 = pool.malloc(UNIT * 2)
    assert UNIT * 2 == pool.total_bytes()
    p2 = pool.malloc(UNIT * 4)
    assert UNIT * 6 == pool.total_bytes()
    del p1
    assert UNIT * 6 == pool.total_bytes()
    del p2
    assert UNIT * 6 == pool.total_bytes()
    p3 = pool.malloc(UNIT * 1)
    assert UNIT * 6 == pool.total_bytes()
    assert pool.used_bytes() + pool.free_bytes() == pool.total_bytes()
    del p3
    pool.free_all_blocks()
    assert 0 == pool.total_bytes()


def test_total_bytes_stream(pool, on_stream):
    """TestSingleDeviceMemoryPool.test_total_bytes_stream."""
    p1 = pool.malloc(UNIT * 4)
    del p1
    with on_stream(0x1000):
        p2 = pool.malloc(UNIT * 2)
    assert UNIT * 6 == pool.total_bytes()
    del p2


def test_the_policy_numbers_of_the_shared_pool(fake):
    """The deliberate difference: MemoryPool() is unimem.cuda's allocators,
    PyTorch's policy, so a small request holds a 2 MiB segment."""
    pool = ucuda.MemoryPool()
    p = pool.malloc(UNIT * 2)
    assert pool.used_bytes() == UNIT * 2 and pool.total_bytes() == 2 * MiB
    assert pool.free_bytes() == 2 * MiB - UNIT * 2 and pool.n_free_blocks() == 1
    assert ucuda.memory_reserved(0) == 2 * MiB                   # one pool, one set of statistics
    del p


def test_get_limit(any_pool):
    """TestSingleDeviceMemoryPool.test_get_limit: no limit by default."""
    assert 0 == any_pool.get_limit()


def test_set_limit_size(any_pool):
    """TestSingleDeviceMemoryPool.test_set_limit_size."""
    any_pool.set_limit(size=1024)
    assert 1024 == any_pool.get_limit()
    any_pool.set_limit(size=2**33)
    assert 2**33 == any_pool.get_limit()
    any_pool.set_limit(size=0)
    assert 0 == any_pool.get_limit()
    with pytest.raises(ValueError):
        any_pool.set_limit(size=-1)


def test_set_limit_takes_a_numpy_integer(any_pool):
    """CuPy keeps the limit in a size_t, which any integer with __index__ fills."""
    numpy = pytest.importorskip("numpy")
    any_pool.set_limit(size=numpy.int64(4096))
    assert any_pool.get_limit() == 4096 and type(any_pool.get_limit()) is int
    with pytest.raises(ValueError):
        any_pool.set_limit(size=numpy.int64(-1))
    any_pool.set_limit(size=0)


def test_set_limit_fraction(any_pool):
    """TestSingleDeviceMemoryPool.test_set_limit_fraction."""
    total = CAPACITY
    any_pool.set_limit(fraction=0)
    assert 0 == any_pool.get_limit()
    any_pool.set_limit(fraction=0.5)
    assert total * 0.5 == any_pool.get_limit()
    any_pool.set_limit(fraction=1.0)
    assert total == any_pool.get_limit()
    for bad in (-1, 1.1):
        with pytest.raises(ValueError):
            any_pool.set_limit(fraction=bad)


# ---------------------------------------------------------------------------
# CuPy's pool allows these under a limit; so does every unimem pool
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("limit, request_size", [(3072, 2560), (10 * MiB, MiB + MiB // 2)])
def test_a_request_that_fits_the_limit_is_served(any_pool, limit, request_size):
    any_pool.set_limit(size=limit)
    p = any_pool.malloc(request_size)
    assert any_pool.used_bytes() == -(-request_size // UNIT) * UNIT
    assert any_pool.total_bytes() <= limit
    del p


def test_after_one_small_malloc_the_numbers_are_cupys(pool):
    """CuPy reports total 1024, free 0, no free block after malloc(1024)."""
    p = pool.malloc(1024)
    assert (pool.used_bytes(), pool.free_bytes(), pool.total_bytes(), pool.n_free_blocks()) == (1024, 0, 1024, 0)
    del p


# ---------------------------------------------------------------------------
# TestMemoryPool (over CuPy's raw allocators)
# ---------------------------------------------------------------------------
def test_zero_size_alloc(any_pool):
    """TestMemoryPool.test_zero_size_alloc."""
    mem = any_pool.malloc(0).mem
    assert isinstance(mem, memory.Memory)
    assert not isinstance(mem, memory.PooledMemory)
    assert mem.ptr == 0 and mem.size == 0
    assert any_pool.used_bytes() == 0


def test_double_free(any_pool):
    """TestMemoryPool.test_double_free: free() is idempotent."""
    mem = any_pool.malloc(1).mem
    mem.free()
    mem.free()
    assert any_pool.used_bytes() == 0


def test_memory_pool_free_all_blocks(pool):
    """TestMemoryPool.test_free_all_blocks."""
    mem = pool.malloc(1).mem
    assert isinstance(mem, memory.BaseMemory)
    assert isinstance(mem, ucuda.PooledMemory)
    assert pool.n_free_blocks() == 0
    mem.free()
    assert pool.n_free_blocks() == 1
    pool.free_all_blocks()
    assert pool.n_free_blocks() == 0


def test_memory_pool_free_all_free(pool):
    """TestMemoryPool.test_free_all_free."""
    mem = pool.malloc(1).mem
    assert pool.n_free_blocks() == 0
    mem.free()
    assert pool.n_free_blocks() == 1
    with pytest.warns(DeprecationWarning):
        pool.free_all_free()
    assert pool.n_free_blocks() == 0


def test_memory_pool_without_malloc(any_pool):
    """TestMemoryPool.test_free_all_blocks_without_malloc, ..._free_all_free_without_malloc,
    test_n_free_blocks_without_malloc, test_used_bytes, test_free_bytes, test_total_bytes."""
    assert any_pool.n_free_blocks() == 0
    any_pool.free_all_blocks()
    assert any_pool.n_free_blocks() == 0
    with pytest.warns(DeprecationWarning):
        any_pool.free_all_free()
    assert (any_pool.used_bytes(), any_pool.free_bytes(), any_pool.total_bytes()) == (0, 0, 0)


def test_pooled_memory_free_returns_the_block_early(any_pool):
    """What CuPy's PooledMemory does: size is the block's, free() gives the
    block back at once (the next request of the size gets it), ptr becomes 0."""
    pointer = any_pool.malloc(1000)
    mem = pointer.mem
    ptr = mem.ptr
    assert mem.size == 1024 and mem.device_id == 0 and int(mem) == ptr
    mem.free()
    assert mem.ptr == 0 and any_pool.used_bytes() == 0
    again = any_pool.malloc(1000)
    assert again.ptr == ptr
    del pointer                                  # the first pointer's death frees nothing more
    gc.collect()
    assert any_pool.used_bytes() == 1024
    del again


# ---------------------------------------------------------------------------
# TestAllocator.test_set_allocator; TestExceptionPicklable
# ---------------------------------------------------------------------------
def test_set_allocator(any_pool):
    """TestAllocator.test_set_allocator: 128 int64 are a 1024-byte block."""
    assert 0 == any_pool.used_bytes()
    pointer = any_pool.malloc(128 * 8)
    assert 1024 == pointer.mem.size
    assert 1024 == any_pool.used_bytes()
    del pointer


def test_out_of_memory_error_keeps_its_class_when_pickled(any_pool):
    """TestExceptionPicklable.test, for the error a unimem pool raises."""
    any_pool.set_limit(size=4 * MiB)
    with pytest.raises(memory.OutOfMemoryError) as info:
        any_pool.malloc(8 * MiB)
    error = info.value
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) is ucuda.OutOfMemoryError
    assert isinstance(again, memory.OutOfMemoryError) and isinstance(again, MemoryError)
    assert again.args == error.args and str(again) == str(error)
    assert again.__dict__ == error.__dict__
    assert (again.requested, again.device) == (8 * MiB, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pickle.loads(pickle.dumps(again, protocol=0))      # every protocol


def test_a_raw_allocators_out_of_memory_frees_the_cache_and_retries(fake):
    """MemoryPool(allocator): a raw allocator that runs out raises CUDA's
    cudaErrorMemoryAllocation (as cupy.cuda.malloc_managed does); the pool then
    frees its cached blocks and tries again, and a request that still does not
    fit is CuPy's OutOfMemoryError (SingleDeviceMemoryPool._try_malloc)."""
    pool = ucuda.MemoryPool(raw_allocator_of(fake))
    cached = pool.malloc(600 * MiB)
    del cached
    assert pool.free_bytes() == 600 * MiB
    served = pool.malloc(700 * MiB)          # fits once the 600 MiB go back
    assert pool.free_bytes() == 0
    with pytest.raises(memory.OutOfMemoryError):
        pool.malloc(800 * MiB)
    del served
    pool.free_all_blocks()
    assert pool.total_bytes() == 0


@pytest.mark.parametrize("setup", OWN_POOLS)
def test_an_own_pool_leaves_expandable_segments_to_the_devices_pools(setup, fake, monkeypatch):
    """UNIMEM_ALLOC_CONF=expandable_segments:True is for the device's pools: a
    pool of its own keeps CuPy's policy (a segment is the rounded request)."""
    monkeypatch.setenv("UNIMEM_ALLOC_CONF", "expandable_segments:True")
    pool = make_pool(setup, fake)
    held = pool.malloc(3 * MiB + 1)
    assert pool.total_bytes() == 3 * MiB + UNIT
    del held
    pool.free_all_blocks()
    assert pool.total_bytes() == 0


@pytest.mark.parametrize("setup", OWN_POOLS)
@pytest.mark.parametrize("limit, expected", [("67108864", 64 * MiB), ("25%", CAPACITY // 4)])
def test_an_own_pool_starts_with_the_limit_of_cupy_gpu_memory_limit(setup, limit, expected, fake, monkeypatch):
    """CuPy's SingleDeviceMemoryPool.__init__ calls set_limit(**_parse_limit_string())."""
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", limit)
    pool = make_pool(setup, fake)
    assert pool.get_limit() == expected
    with pytest.raises(memory.OutOfMemoryError):
        pool.malloc(expected + UNIT)
    assert pool.total_bytes() == 0


@pytest.mark.parametrize("setup", OWN_POOLS)
def test_record_stream_keeps_a_block_of_an_own_pool_from_reuse(setup, fake):
    """unimem.cuda.record_stream takes the memory of a pool with allocators
    of its own (found through the unimem Allocation the PooledMemory holds),
    and the block is not reused while the other stream's work may use it."""
    pool = make_pool(setup, fake)
    other = cupy.cuda.ExternalStream(0x5000)
    pointer = pool.malloc(4096)
    address = pointer.ptr
    ucuda.record_stream(pointer, other)
    del pointer
    again = pool.malloc(4096)
    assert again.ptr != address
    with pytest.raises(ValueError, match="not a live block"):
        ucuda.record_stream(0x7F00_0000_0000, other)


def test_record_stream_refuses_a_block_of_another_device_type(fake):
    """An Allocation of unimem.cpu's pool is no block of the cuda allocator."""
    from unimem._runtime.devices import get_type
    allocation = get_type("cpu").allocator(0).allocate(4096)
    with pytest.raises(ValueError, match="not a live block"):
        ucuda.record_stream(allocation, cupy.cuda.ExternalStream(0x5000))
    allocation.release()
