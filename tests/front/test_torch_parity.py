"""PyTorch's own expectations on memory history, snapshots, OOM observers,
the memory fraction and the pinned host pool's statistics, ported (in our own
code) from ``test/test_cuda.py`` (and ``test/test_xpu.py`` where it is the
same test) to run without a GPU: ``unimem.cuda`` over the simulated CUDA
runtime (tests/helpers/fake_cuda.py), and unimem's pinned pool. Each test
names the upstream test it comes from.
"""
import gc
import json
import random

import pytest

import unimem

from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda

pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")

GiB = 1 << 30
FLOAT = 4                     # bytes of a torch.float32, what torch.rand allocates


@pytest.fixture
def cuda():
    """``unimem.cuda`` served by a simulated one-GPU runtime of 1 GiB."""
    with serving_cuda(FakeCudaRuntime(devices=1, capacity=GiB)):
        import unimem.cuda
        yield unimem.cuda
        unimem.cuda._record_memory_history(None, clear_history=True)


class Tensor:
    """What a torch tensor is to the allocator: a block freed when it dies."""

    def __init__(self, cuda, nbytes):
        self.cuda = cuda
        self.ptr = cuda.caching_allocator_alloc(nbytes)

    def __del__(self):
        if hasattr(self, "ptr"):          # not when the allocation failed
            self.cuda.caching_allocator_delete(self.ptr)


def test_set_per_process_memory_fraction(cuda):
    """test/test_cuda.py::TestCuda::test_set_per_process_memory_fraction"""
    with pytest.raises(TypeError, match="Invalid type"):
        cuda.set_per_process_memory_fraction(int(1))
    with pytest.raises(ValueError, match="Invalid fraction value"):
        cuda.set_per_process_memory_fraction(-0.1)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        cuda.set_per_process_memory_fraction(2.0)

    tensor = Tensor(cuda, 1024 * FLOAT)
    cuda.empty_cache()
    total_memory = cuda.get_memory_info(0)[1]
    cuda.set_per_process_memory_fraction(0.5, 0)

    # an allocation of 0.499 of the memory is allowed
    application = int(total_memory * 0.499) - cuda.max_memory_reserved()
    tmp_tensor = Tensor(cuda, application)
    del tmp_tensor
    cuda.empty_cache()

    # half of the memory is more than is allowed
    with pytest.raises(unimem.OutOfMemoryError, match="out of memory"):
        Tensor(cuda, int(total_memory * 0.5))
    del tensor


def test_get_per_process_memory_fraction(cuda):
    """test/test_cuda.py::TestCuda::test_get_per_process_memory_fraction"""
    init_fraction = cuda.get_per_process_memory_fraction()
    cuda.set_per_process_memory_fraction(1.0)
    assert cuda.get_per_process_memory_fraction() == 1.0
    cuda.set_per_process_memory_fraction(0.0)
    assert cuda.get_per_process_memory_fraction() == 0.0
    for value in (random.random() for _ in range(3)):
        cuda.set_per_process_memory_fraction(value)
        assert cuda.get_per_process_memory_fraction() == value
    cuda.set_per_process_memory_fraction(init_fraction)


def test_memory_snapshot(cuda):
    """test/test_cuda.py::TestCuda::test_memory_snapshot
    (test/test_xpu.py::TestXpu::test_memory_snapshot_with_python)"""
    try:
        cuda.empty_cache()
        cuda._record_memory_history("state", stacks="python")
        # make x the second block in a segment
        Tensor(cuda, 2 * 311 * 411 * FLOAT)
        unused = Tensor(cuda, 310 * 410 * FLOAT)
        x = Tensor(cuda, 311 * 411 * FLOAT)

        # many 512-byte blocks tiling one segment, freed in random order
        tensors = [Tensor(cuda, 128 * FLOAT) for _ in range(1000)]
        while tensors:
            del tensors[random.randint(0, len(tensors) - 1)]
        Tensor(cuda, 128 * 5 * FLOAT)

        ss = cuda._snapshot()
        found_it = False
        for seg in ss["segments"]:
            assert "frames" in seg
            for b in seg["blocks"]:
                if b["requested_size"] == 311 * 411 * FLOAT:
                    assert "test_torch_parity" in b["frames"][0]["filename"]
                    found_it = True
                    assert x.ptr == b["address"]
        assert found_it

        del unused
        del x
        gc.collect()
        cuda.empty_cache()
        ss = cuda._snapshot()
        # "state" keeps PyTorch's one last entry
        assert ss["device_traces"][0][-1]["action"] in ("segment_free", "segment_unmap")
    finally:
        cuda._record_memory_history(None)


def test_memory_plots_free_stack(cuda):
    """test/test_cuda.py::TestCuda::test_memory_plots_free_stack"""
    # The upstream run has live tensors holding a small segment already: so
    # does this one, or the segment's own frames would name thealloc.
    keeper = Tensor(cuda, 512)
    for context in ["alloc", "all", "state"]:
        try:
            cuda.empty_cache()
            cuda._record_memory_history(context=context)
            x = None

            def thealloc():
                nonlocal x
                x = Tensor(cuda, 3 * 4 * FLOAT)

            def thefree():
                nonlocal x
                del x

            thealloc()
            thefree()
            ss = json.dumps(cuda._snapshot())
            assert ("thefree" in ss) == (context == "all"), context
            assert ("thealloc" in ss) == (context != "state"), context
        finally:
            cuda._record_memory_history(None)
    del keeper


def test_memory_plots_free_segment_stack(cuda):
    """test/test_cuda.py::TestCuda::test_memory_plots_free_segment_stack"""
    def empty_cache():
        # unimem leaves its own frames out of stacks; the user's caller stays
        cuda.empty_cache()

    for context in ["alloc", "all", "state"]:
        try:
            empty_cache()
            cuda._record_memory_history(context=context)
            x = Tensor(cuda, 3 * 4 * FLOAT)
            del x
            empty_cache()
            ss = json.dumps(cuda._snapshot())
            assert ("empty_cache" in ss) == (context == "all"), context
        finally:
            cuda._record_memory_history(None)


def test_notifies_oom(cuda):
    """test/test_cuda.py::TestCuda::test_notifies_oom"""
    x = False

    def cb(device, alloc, device_alloc, device_free):
        nonlocal x
        x = True

    unimem.attach_out_of_memory_observer(cb)
    try:
        with pytest.raises(unimem.OutOfMemoryError):
            Tensor(cuda, 1024 * 1024 * 1024 * 1024)
    finally:
        unimem.detach_out_of_memory_observer(cb)
    assert x


def test_disabling_history_drops_the_trace(cuda):
    """Not an upstream test: c10's recordHistory (CUDACachingAllocator.cpp)
    clears the trace when recording is disabled or clear_history is given."""
    try:
        cuda._record_memory_history()
        Tensor(cuda, 4096)
        assert cuda._snapshot()["device_traces"][0]
        cuda._record_memory_history(clear_history=True)
        assert cuda._snapshot()["device_traces"][0] == []
        Tensor(cuda, 4096)
        cuda._record_memory_history(None)
        assert cuda._snapshot()["device_traces"][0] == []
    finally:
        cuda._record_memory_history(None)


def test_host_memory_stats_count_what_the_pool_reserved_and_handed_out():
    """test/test_cuda.py::TestCuda::test_host_memory_stats, run on unimem's
    pinned pool. PyTorch rounds 40,960 and 81,920 bytes up to 65,536 and
    131,072, one block and one cudaHostAlloc each; unimem's pool keeps its
    best-fit policy (documented in unimem.host) and counts what it reserved
    and handed out: both requests (512-byte multiples already) from one
    2 MiB segment, one pinning call. The sequence's other expectations are
    PyTorch's: empty_cache changes nothing while both live, and the resets."""
    import json
    import os
    import subprocess
    import sys
    script = (
        "import gc, json, unimem\n"
        "from unimem import host\n"
        "gc.collect(); host.empty_host_cache()\n"
        "seen = [dict(unimem.host_memory_stats())]\n"
        "t1 = host.caching_host_alloc(10 * 1024 * 4)\n"
        "seen.append(dict(unimem.host_memory_stats()))\n"
        "t2 = host.caching_host_alloc(20 * 1024 * 4)\n"
        "seen.append(dict(unimem.host_memory_stats()))\n"
        "host.empty_host_cache()\n"
        "seen.append(dict(unimem.host_memory_stats()))\n"
        "t3 = host.caching_host_alloc(40_000)\n"
        "seen.append(dict(unimem.host_memory_stats()))\n"
        "for ptr in (t1, t2, t3): host.caching_host_delete(ptr)\n"
        "host.empty_host_cache()\n"
        "unimem.reset_peak_host_memory_stats(); unimem.reset_accumulated_host_memory_stats()\n"
        "seen.append(dict(unimem.host_memory_stats()))\n"
        "print(json.dumps(seen))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    empty, first, second, emptied, third, reset = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(value == 0 for value in empty.values())

    def figures(stats):
        return {key: stats[f"{key}.current"] for key in (
            "active_requests", "active_bytes", "allocated_bytes", "allocations", "reserved_bytes")} | {
            "num_host_alloc": stats["num_host_alloc"], "host_alloc_time.count": stats["host_alloc_time.count"]}

    MiB = 1 << 20
    assert figures(first) == {"active_requests": 1, "active_bytes": 40_960, "allocated_bytes": 40_960,
                              "allocations": 1, "reserved_bytes": 2 * MiB,
                              "num_host_alloc": 1, "host_alloc_time.count": 1}
    assert figures(second) == {"active_requests": 2, "active_bytes": 122_880, "allocated_bytes": 122_880,
                               "allocations": 1, "reserved_bytes": 2 * MiB,
                               "num_host_alloc": 1, "host_alloc_time.count": 1}
    assert emptied == second                      # PyTorch: empty_cache frees no live block
    # counted after the pool's own rounding (512 bytes), not as requested
    assert third["active_bytes.current"] - second["active_bytes.current"] == 40_448
    assert third["allocated_bytes.allocated"] == 40_960 + 81_920 + 40_448
    assert all(reset[f"{key}.{metric}"] == 0 for key in ("active_requests", "active_bytes", "allocations")
               for metric in ("current", "peak", "allocated", "freed"))
    assert reset["num_host_alloc"] == reset["num_host_free"] == 0
