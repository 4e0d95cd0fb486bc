"""Streams on a real GPU: a block is never handed to new work while
a kernel may still use it.

Each round frees an array while a kernel that uses it is still running, then
allocates and writes at once. The kernel writes a pattern, spins, and counts
the elements that no longer hold it; the new array's owner checks its own
value after everything is done. A block handed out too early shows up in one
of the two counts. Several threads, each with its own streams, run rounds at
the same time. Skipped without an NVIDIA GPU.
"""
import threading

import pytest

from tests.helpers.gpu import needs_gpu

cupy = pytest.importorskip("cupy")


pytestmark = needs_gpu

ELEMENTS = 1 << 18                       # 1 MiB of uint32: one block of the large pool
ROUNDS = 1500
THREADS = 4
SPIN_CYCLES = 40_000                     # ~20 us at the H100's clock: the free lands mid-kernel

_SOURCE = r"""
extern "C" __global__ void fill_spin_check(unsigned int* data, unsigned long long n, unsigned int value,
                                           long long cycles, unsigned long long* mismatches) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned long long i = first; i < n; i += stride) data[i] = value;
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long bad = 0;
    for (unsigned long long i = first; i < n; i += stride) bad += data[i] != value;
    if (bad) atomicAdd(mismatches, bad);
}
"""


@pytest.fixture(scope="module")
def kernel():
    compiled = cupy.RawKernel(_SOURCE, "fill_spin_check")
    probe, mismatches = cupy.empty(1024, cupy.uint32), cupy.zeros(1, cupy.uint64)
    _launch(compiled, probe, 5, mismatches)                  # compiled once, before the threads start
    assert int(mismatches[0]) == 0 and int(probe[-1]) == 5
    return compiled


def _launch(kernel, array, value, mismatches):
    kernel((64,), (256,), (array, cupy.uint64(array.size), cupy.uint32(value), cupy.int64(SPIN_CYCLES),
                           mismatches))


def _rounds(kernel, record, errors, seed):
    """One thread's rounds on its own two streams (``using_allocator`` is per thread)."""
    import unimem.cuda as ucuda
    try:
        with cupy.cuda.using_allocator(ucuda.allocator):
            _rounds_with_unimem(kernel, record, seed, ucuda)
    except BaseException as error:          # noqa: BLE001  (reported by the main thread)
        errors.append(error)


def _rounds_with_unimem(kernel, record, seed, ucuda):
    """Rounds of free-while-in-use and allocate-at-once; the checks at the end."""
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    mismatches = cupy.zeros(1, cupy.uint64)
    early_reuse = 0
    checks = []
    for round_ in range(ROUNDS):
        value = (seed << 20) | round_
        if record:
            with a:
                x = cupy.empty(ELEMENTS, cupy.uint32)       # a block of stream a ...
            a.synchronize()
            with b:
                _launch(kernel, x, value, mismatches)       # ... used on stream b
            ucuda.record_stream(x, b)
            address = x.data.ptr
            del x                                           # freed while b's kernel runs
            with a:
                y = cupy.empty(ELEMENTS, cupy.uint32)       # may not take x's block before b is done
                busy = not b.done
                y.fill(value ^ 0xFFFFFFFF)
        else:
            with a:
                x = cupy.empty(ELEMENTS, cupy.uint32)
                _launch(kernel, x, value, mismatches)
            address = x.data.ptr
            del x                                           # freed on a while its kernel runs
            with b:
                y = cupy.empty(ELEMENTS, cupy.uint32)       # another stream: never a's block
                busy = not a.done
                y.fill(value ^ 0xFFFFFFFF)
        early_reuse += busy and y.data.ptr == address
        checks.append((y, value ^ 0xFFFFFFFF))
        if len(checks) == 32:
            a.synchronize()
            b.synchronize()
            for array, expected in checks:
                assert int((array != expected).sum()) == 0, "a new array was overwritten by older work"
            checks.clear()
    a.synchronize()
    b.synchronize()
    for array, expected in checks:
        assert int((array != expected).sum()) == 0, "a new array was overwritten by older work"
    assert int(mismatches[0]) == 0, f"{int(mismatches[0])} elements changed under a running kernel"
    assert early_reuse == 0, f"{early_reuse} blocks were handed out while a kernel could use them"


@pytest.mark.parametrize("record", [True, False], ids=["record_stream", "one-stream-then-another"])
def test_gpu_blocks_are_not_reused_while_a_kernel_may_use_them(kernel, record):
    import unimem.cuda as ucuda
    with cupy.cuda.using_allocator(ucuda.allocator):
        # {} in a process where unimem has not allocated yet (as torch.cuda.memory_stats):
        # the first GPU test of a pytest-xdist worker failed on a KeyError here.
        allocations_before = ucuda.memory_stats().get("allocation.all.allocated", 0)
        errors = []
        threads = [threading.Thread(target=_rounds, args=(kernel, record, errors, seed)) for seed in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        served = ucuda.memory_stats()["allocation.all.allocated"] - allocations_before
        assert served >= THREADS * ROUNDS * 2
    cupy.cuda.Device().synchronize()
    ucuda.empty_cache()


def test_gpu_a_recorded_block_comes_back_once_the_stream_is_done(kernel):
    """Reuse is held back, not lost: after the other stream's work ends, the
    block serves its own stream again (no new segment)."""
    import unimem.cuda as ucuda
    mismatches = cupy.zeros(1, cupy.uint64)
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(ucuda.allocator):
        with a:
            x = cupy.empty(ELEMENTS, cupy.uint32)
        a.synchronize()
        with b:
            _launch(kernel, x, 7, mismatches)
        ucuda.record_stream(x, b)
        address = x.data.ptr
        del x
        b.synchronize()
        segments = ucuda.memory_stats()["segment.all.current"]
        with a:
            y = cupy.empty(ELEMENTS, cupy.uint32)
        assert y.data.ptr == address
        assert ucuda.memory_stats()["segment.all.current"] == segments
        del y
    assert int(mismatches[0]) == 0
