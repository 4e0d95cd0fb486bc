"""Stream safety of unimem's CUDA pools, on the simulated CUDA runtime.

A block freed on stream S may go at once only to a request on S; on any other
stream only after S's work is done. CuPy's own expectations
(``tests/cupy_tests/cuda_tests/test_memory.py``) are ported here, each named
after the upstream test, and run against every way unimem gives CuPy memory:
``unimem.cuda.allocator`` and ``unimem.cuda.MemoryPool`` shared with it, over a
CuPy-style raw allocator, and over a unimem backend.
"""
import threading

import pytest

from unimem._runtime import devices as _devices
from unimem.backends.cuda import (CUDA_STREAM_LEGACY, CUDA_STREAM_PER_THREAD, CUDABackend,
                                  cuda_stream_of, per_thread_stream_key, stream_key)
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fake_cuda import CUDARuntimeError, fake, on_stream, raw_allocator_of  # noqa: F401  (fixtures)

cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")

UNIT = 512                   # CuPy's allocation unit, and unimem's rounding
STREAM_1, STREAM_2 = 0x1000, 0x2000
MiB = 1 << 20


POOL_SETUPS = ("unimem.cuda.allocator", "MemoryPool()", "MemoryPool(allocator)", "MemoryPool(backend=...)")


def make_malloc(setup, runtime):
    """``size -> cupy.cuda.MemoryPointer`` for one pool setup, and a
    ``free_all_blocks(stream=None)`` for it."""
    import unimem.cuda as ucuda
    if setup == "unimem.cuda.allocator":
        return ucuda.allocator, lambda stream=None: ucuda.MemoryPool().free_all_blocks(stream)
    if setup == "MemoryPool()":
        pool = ucuda.MemoryPool()
    elif setup == "MemoryPool(allocator)":
        pool = ucuda.MemoryPool(raw_allocator_of(runtime))
    else:
        pool = ucuda.MemoryPool(backend=SimulatedBackend(capacity=256 * MiB))
    return pool.malloc, pool.free_all_blocks


@pytest.fixture(params=POOL_SETUPS)
def pool(request, fake):
    return make_malloc(request.param, fake)


# ---------------------------------------------------------------------------
# CuPy: TestSingleDeviceMemoryPool
# ---------------------------------------------------------------------------
def test_free_stream(pool, on_stream):
    """CuPy test_memory.py TestSingleDeviceMemoryPool.test_free_stream."""
    malloc, _ = pool
    p1 = malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    with on_stream(STREAM_1):
        p2 = malloc(UNIT * 4)
    assert ptr1 != p2.ptr, "a block freed on the null stream went at once to another stream"
    del p2
    again = malloc(UNIT * 4)                 # and on its own stream it is reused
    assert again.ptr == ptr1


def test_free_all_blocks_stream(pool, on_stream):
    """CuPy test_memory.py TestSingleDeviceMemoryPool.test_free_all_blocks_stream."""
    malloc, free_all_blocks = pool
    p1 = malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    with on_stream(STREAM_1):
        p2 = malloc(UNIT * 4)
        ptr2 = p2.ptr
        del p2
    free_all_blocks(stream=cupy.cuda.Stream.null)
    p3 = malloc(UNIT * 4)
    assert ptr1 != p3.ptr
    assert ptr2 != p3.ptr
    with on_stream(STREAM_1):
        p4 = malloc(UNIT * 4)
        assert ptr1 != p4.ptr
        assert ptr2 == p4.ptr


def test_free_all_blocks_all_streams(pool, on_stream):
    """CuPy test_memory.py TestSingleDeviceMemoryPool.test_free_all_blocks_all_streams."""
    malloc, free_all_blocks = pool
    p1 = malloc(UNIT * 4)
    ptr1 = p1.ptr
    del p1
    with on_stream(STREAM_1):
        p2 = malloc(UNIT * 4)
        ptr2 = p2.ptr
        del p2
    free_all_blocks()
    p3 = malloc(UNIT * 4)
    assert ptr1 != p3.ptr
    assert ptr2 != p3.ptr
    with on_stream(STREAM_1):
        p4 = malloc(UNIT * 4)
        assert ptr1 != p4.ptr
        assert ptr2 != p4.ptr


# ---------------------------------------------------------------------------
# CuPy: TestAllocator._reuse_between_thread and its four tests
# ---------------------------------------------------------------------------
def reuse_between_thread(malloc, fake, stream_main, stream_sub):
    """Allocate 128 bytes (``cupy.arange(16)``) and free them in the main
    thread on ``stream_main``, then in a new thread on ``stream_sub``;
    return both addresses."""
    addresses = {}

    def job(name, stream):
        fake.set_stream(stream)
        try:
            arr = malloc(128)
            addresses[name] = arr.ptr
            del arr
        finally:
            fake.set_stream(0)

    job("main", stream_main)
    thread = threading.Thread(target=job, args=("sub", stream_sub), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and "sub" in addresses, "the thread's allocation failed"
    return addresses["main"], addresses["sub"]


def test_reuse_between_thread(pool, fake):
    """CuPy test_memory.py TestAllocator.test_reuse_between_thread: one null stream."""
    main_ptr, sub_ptr = reuse_between_thread(pool[0], fake, 0, 0)
    assert main_ptr == sub_ptr


def test_reuse_between_thread_same_stream(pool, fake):
    """CuPy test_memory.py TestAllocator.test_reuse_between_thread_same_stream."""
    main_ptr, sub_ptr = reuse_between_thread(pool[0], fake, STREAM_1, STREAM_1)
    assert main_ptr == sub_ptr


def test_reuse_between_thread_different_stream(pool, fake):
    """CuPy test_memory.py TestAllocator.test_reuse_between_thread_different_stream."""
    main_ptr, sub_ptr = reuse_between_thread(pool[0], fake, STREAM_1, STREAM_2)
    assert main_ptr != sub_ptr


def test_reuse_between_thread_ptds(pool, fake):
    """CuPy test_memory.py TestAllocator.test_reuse_between_thread_ptds: the
    per-thread default stream is a different stream in each thread."""
    main_ptr, sub_ptr = reuse_between_thread(pool[0], fake, CUDA_STREAM_PER_THREAD, CUDA_STREAM_PER_THREAD)
    assert main_ptr != sub_ptr


def test_the_per_thread_stream_is_reused_within_its_thread(pool, fake, on_stream):
    malloc, _ = pool
    with on_stream(CUDA_STREAM_PER_THREAD):
        first = malloc(128)
        ptr = first.ptr
        del first
        assert malloc(128).ptr == ptr


# ---------------------------------------------------------------------------
# Per-thread stream keys, and events recorded from another thread
# ---------------------------------------------------------------------------
def in_thread(function):
    result = {}

    def run():
        result["value"] = function()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert "value" in result, "the thread failed"
    return result["value"], thread.ident


def test_cupys_current_stream_is_keyed_as_stream_key_keys_it(monkeypatch):
    """The fast path for CuPy's current stream (one call into CuPy per
    allocation) keys every stream as :func:`stream_key` does, the per-thread
    default stream per thread included."""
    from types import SimpleNamespace

    from unimem.backends import cuda as cuda_backend
    current = {0: SimpleNamespace(ptr=STREAM_1), 1: SimpleNamespace(ptr=CUDA_STREAM_PER_THREAD)}
    monkeypatch.setattr(cuda_backend, "_get_current_stream", current.__getitem__)
    assert cuda_backend.cupy_current_stream_key(0) == STREAM_1 == stream_key(current[0])
    mine = cuda_backend.cupy_current_stream_key(1)
    assert mine == per_thread_stream_key() == stream_key(CUDA_STREAM_PER_THREAD)
    assert in_thread(lambda: cuda_backend.cupy_current_stream_key(1))[0] not in (mine, CUDA_STREAM_PER_THREAD)
    current[0] = SimpleNamespace(ptr=0)                      # the null stream
    assert cuda_backend.cupy_current_stream_key(0) == 0


def test_the_cuda_device_type_uses_the_fast_current_stream_over_cupys_runtime(monkeypatch):
    from unimem.backends import cuda as cuda_backend
    from tests.helpers.fake_cuda import FakeCudaRuntime
    monkeypatch.setattr(cuda_backend, "_default_runtime", lambda: FakeCudaRuntime(devices=1))
    assert _devices.make_cuda_type().registry.current_stream_fn is cuda_backend.cupy_current_stream_key
    given = _devices.make_cuda_type(FakeCudaRuntime(devices=1), current_stream_fn=lambda device: STREAM_2)
    assert given.registry.stream_handle_of(None, 0) == STREAM_2


def test_per_thread_stream_keys_are_one_per_thread_and_no_stream():
    mine = stream_key(CUDA_STREAM_PER_THREAD)
    assert mine == per_thread_stream_key() == stream_key(cupy.cuda.Stream.ptds)
    theirs, _ = in_thread(lambda: stream_key(CUDA_STREAM_PER_THREAD))
    later, _ = in_thread(lambda: stream_key(CUDA_STREAM_PER_THREAD))
    assert len({mine, theirs, later}) == 3, "a key was shared or reused by a later thread"
    assert stream_key(mine) == mine                        # a key stands for itself
    for handle in (0, 1, STREAM_1, cupy.cuda.Stream.null):
        assert stream_key(handle) == getattr(handle, "ptr", handle)
    # events go on the thread's own stream from the owner, the legacy stream elsewhere
    assert cuda_stream_of(mine) == CUDA_STREAM_PER_THREAD
    assert cuda_stream_of(theirs) == CUDA_STREAM_LEGACY
    assert in_thread(lambda: cuda_stream_of(mine))[0] == CUDA_STREAM_LEGACY
    assert cuda_stream_of(STREAM_1) == STREAM_1 and cuda_stream_of(0) == 0
    with pytest.raises(TypeError):
        stream_key("2")


def test_a_per_thread_stream_use_freed_by_another_thread_waits_for_that_thread(fake):
    """Thread A uses a block on its per-thread default stream and hands it to
    the main thread, which frees it: the event (recorded from the main
    thread, where cudaStreamPerThread is another stream) must still wait for
    A's work."""
    import unimem.cuda as ucuda

    def thread_a():
        block = ucuda.allocator(4096)                   # on stream 0
        fake.launch(CUDA_STREAM_PER_THREAD)             # A's kernel reads it on A's stream
        ucuda.record_stream(block, CUDA_STREAM_PER_THREAD)
        return block
    block, a_ident = in_thread(thread_a)
    ptr = block.ptr
    del block                                          # freed here, in the main thread
    assert fake.recorded[-1] == (CUDA_STREAM_LEGACY, threading.get_ident())
    assert ucuda.allocator(4096).ptr != ptr, "reused before anything completed"
    fake.complete(CUDA_STREAM_PER_THREAD, thread=threading.get_ident())   # the main thread's own stream
    fake.complete(0)                                                      # and the legacy stream
    assert ucuda.allocator(4096).ptr != ptr, "reused before thread A's per-thread stream was done"
    fake.complete(CUDA_STREAM_PER_THREAD, thread=a_ident)
    assert ucuda.allocator(4096).ptr == ptr
    assert fake.events_alive() == 0


def test_a_per_thread_stream_use_freed_by_its_thread_records_on_it(fake):
    import unimem.cuda as ucuda

    def thread_a():
        block = ucuda.allocator(4096)
        ptr = block.ptr
        ucuda.record_stream(block, cupy.cuda.Stream.ptds)
        del block
        return ptr
    ptr, a_ident = in_thread(thread_a)
    assert fake.recorded[-1] == (CUDA_STREAM_PER_THREAD, a_ident)
    assert ucuda.allocator(4096).ptr != ptr
    fake.complete(CUDA_STREAM_PER_THREAD, thread=a_ident)
    assert ucuda.allocator(4096).ptr == ptr


def test_caching_allocator_alloc_keys_the_per_thread_stream_per_thread(fake):
    import unimem.cuda as ucuda
    ptr = ucuda.caching_allocator_alloc(4096, 0, CUDA_STREAM_PER_THREAD)
    ucuda.caching_allocator_delete(ptr)
    other, _ = in_thread(lambda: ucuda.caching_allocator_alloc(4096, 0, CUDA_STREAM_PER_THREAD))
    assert other != ptr


# ---------------------------------------------------------------------------
# an event recorded for a free that fails is not leaked
# ---------------------------------------------------------------------------
def test_a_failed_event_record_leaks_no_event(fake):
    allocator = _devices.get_type("cuda").registry.get(0)
    ptr = allocator.malloc(4096, STREAM_1)
    allocator.record_stream(ptr, STREAM_2)
    allocator.record_stream(ptr, 0x3000)
    fake.failing_event_streams.add(0x3000)
    with pytest.raises(CUDARuntimeError):
        allocator.free(ptr)
    assert fake.events_alive() == 0, "the event recorded on the first stream leaked"
    assert allocator.memory_allocated() == 4096         # the block stays allocated: nothing committed
    fake.failing_event_streams.clear()
    allocator.free(ptr)
    assert fake.events_alive() == 2
    allocator.empty_cache()
    assert fake.events_alive() == 0 and allocator.memory_allocated() == 0


def test_release_event_destroys_the_event(fake):
    backend = CUDABackend(fake)
    event = backend.record_event(STREAM_1, 0)
    assert fake.events_alive() == 1
    backend.release_event(event)
    assert fake.events_alive() == 0
