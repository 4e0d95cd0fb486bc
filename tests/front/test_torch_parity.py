"""PyTorch's own expectations on memory history, snapshots, OOM observers and
the memory fraction, ported (in our own code) from ``test/test_cuda.py`` (and
``test/test_xpu.py`` where it is the same test) to run without a GPU:
``unimem.cuda`` over the simulated CUDA runtime (tests/helpers/fake_cuda.py).
Each test names the upstream test it comes from.
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
