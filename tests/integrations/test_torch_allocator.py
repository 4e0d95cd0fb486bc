"""unimem as PyTorch's allocator (``unimem.install_allocators(torch=True)``,
``unimem.cuda.pluggable_allocator()``, ``unimem.xpu.pluggable_allocator()``).

This machine's PyTorch is a CPU build: it has neither ``torch._C._cuda_customAllocator``
nor ``torch._C._xpu_customAllocator``. The glue is tested here for its checks
and errors, and for its wiring with those two hooks stood in for: PyTorch's
own ``CUDAPluggableAllocator``/``XPUPluggableAllocator`` code finds the C
functions, and calling them with PyTorch's signatures allocates from unimem's
pools (the CUDA one over the simulated runtime, the XPU one on the SYCL
device). Tensors on a GPU are the ``gpu`` tests at the end.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import unimem  # noqa: E402
import unimem.capi  # noqa: E402
from unimem._integrations import install as _install  # noqa: E402
from unimem._integrations import torch as torch_glue  # noqa: E402
from unimem._runtime import devices as _devices  # noqa: E402

from tests.helpers import REPO_ROOT  # noqa: E402
from tests.helpers.fake_cuda import fake  # noqa: E402,F401  (fixture)
from tests.helpers.gpu import requires_gpu  # noqa: E402

CUDA_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
CUDA_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
XPU_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
XPU_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


@pytest.fixture(autouse=True)
def fresh_glue(monkeypatch):
    """Each test starts with no PyTorch allocator made or installed, and
    install_allocators leaves CuPy and dpnp alone (installing them while the
    simulated GPU is served would make it the pinned host pool's for the
    rest of the process)."""
    monkeypatch.setattr(torch_glue, "_made", {})
    monkeypatch.setattr(torch_glue, "_installed", set())
    monkeypatch.setattr(_install, "_install_cupy", lambda: None)
    monkeypatch.setattr(_install, "_install_dpnp", lambda: None)


class StandInHooks:
    """``torch._C``'s pluggable-allocator hooks of a GPU build, recording."""

    def __init__(self, monkeypatch, device_type):
        self.made, self.swapped = [], []
        monkeypatch.setattr(torch._C, f"_{device_type}_customAllocator", self.custom_allocator, raising=False)
        monkeypatch.setattr(torch._C, f"_{device_type}_changeCurrentAllocator", self.swapped.append,
                            raising=False)

    def custom_allocator(self, alloc_address, free_address):
        handle = ("allocator", alloc_address, free_address)
        self.made.append(handle)
        return handle


def exported(name):
    return ctypes.cast(getattr(ctypes.CDLL(unimem.capi.library_path()), name), ctypes.c_void_p).value


# ---------------------------------------------------------------------------
# what a CPU build of PyTorch (or a machine without the device) is told
# ---------------------------------------------------------------------------
def test_a_pytorch_without_cuda_is_named(fake):
    import unimem.cuda
    with pytest.raises(RuntimeError, match=r"built without CUDA: it has no torch._C._cuda_customAllocator"):
        unimem.cuda.pluggable_allocator()


def test_a_pytorch_without_xpu_is_named(xpu_type):
    import unimem.xpu
    with pytest.raises(RuntimeError, match=r"built without XPU: it has no torch._C._xpu_customAllocator"):
        unimem.xpu.pluggable_allocator()


@pytest.fixture
def xpu_type():
    if not _devices.is_available("xpu"):
        pytest.skip(f"no SYCL device: {_devices.unavailable_reason('xpu')}")


def test_no_unimem_device_is_said_first(monkeypatch):
    monkeypatch.setitem(_devices._unavailable, "cuda", "CUDA sees no GPU")
    monkeypatch.delitem(_devices._types, "cuda", raising=False)
    with pytest.raises(RuntimeError, match="no cuda device is available: CUDA sees no GPU"):
        unimem.capi.pluggable_allocator("cuda")
    with pytest.raises(ValueError, match="'cuda' and 'xpu', not 'cpu'"):
        unimem.capi.pluggable_allocator("cpu")
    with pytest.raises(ValueError, match="not 'mps'"):
        torch_glue.install("mps")


def test_install_allocators_serves_pytorch_only_where_it_has_the_device(fake):
    assert not torch.cuda.is_available()
    assert "torch" not in unimem.install_allocators(torch=True)
    assert torch_glue.installed() == []


# ---------------------------------------------------------------------------
# the wiring, with a GPU build's hooks stood in for
# ---------------------------------------------------------------------------
def test_pytorchs_cuda_allocator_calls_unimems_functions(fake, monkeypatch):
    hooks = StandInHooks(monkeypatch, "cuda")
    import unimem.cuda
    made = unimem.cuda.pluggable_allocator()
    assert isinstance(made, torch.cuda.memory.CUDAPluggableAllocator)
    assert unimem.cuda.pluggable_allocator() is made                      # one per process
    (_, alloc_address, free_address), = hooks.made
    assert alloc_address == exported("unimem_torch_cuda_malloc") and free_address == exported("unimem_torch_cuda_free")
    # what PyTorch's C++ does with them: alloc(size, device, stream), free(ptr, size, device, stream)
    alloc, free = CUDA_ALLOC(alloc_address), CUDA_FREE(free_address)
    ptr = alloc(1 << 20, 1, ctypes.c_void_p(0x7000))
    assert fake.live[ptr][0] == 1
    stats = unimem.cuda.memory_stats(1)
    assert stats["allocated_bytes.all.current"] == 1 << 20 and stats["requested_bytes.all.current"] == 1 << 20
    assert unimem.cuda.caching_allocator(1).live_allocations()[ptr][2] == 0x7000
    assert unimem.cuda.memory_allocated_by_client(1) == {"torch": 1 << 20}  # PyTorch's, not plain C's
    free(ptr, 1 << 20, 1, ctypes.c_void_p(0x7000))
    assert unimem.cuda.memory_allocated(1) == 0
    assert alloc(1 << 40, 0, None) is None                                # out of memory: NULL for PyTorch


def test_install_makes_it_pytorchs_current_allocator_once(fake, monkeypatch):
    hooks = StandInHooks(monkeypatch, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert unimem.install_allocators(torch=True)[-1:] == ["torch"]
    assert hooks.swapped == [hooks.made[0]]
    assert "torch" in unimem.installed_allocators() and torch_glue.installed() == ["cuda"]
    assert torch_glue.install("cuda") is False                           # once
    assert len(hooks.swapped) == 1
    with pytest.raises(RuntimeError, match="PyTorch swaps it once"):
        unimem.uninstall_allocators(["torch"])
    unimem.uninstall_allocators()                                         # the rest; PyTorch's stays
    assert torch_glue.installed() == ["cuda"]


def test_the_rule_is_checked_before_pytorch_is_touched(fake, monkeypatch):
    """PyTorch takes another allocator only before its own is initialized."""
    hooks = StandInHooks(monkeypatch, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"already initialized .*install_allocators\(torch=True\).* before "
                                           r"the first tensor on the device"):
        unimem.install_allocators(torch=True)
    assert hooks.swapped == [] and torch_glue.installed() == []


def test_pytorchs_own_refusal_gets_the_same_explanation(fake, monkeypatch):
    StandInHooks(monkeypatch, "cuda")

    def refuse(allocator):
        raise RuntimeError("Can't swap an already initialized allocator")
    monkeypatch.setattr(torch._C, "_cuda_changeCurrentAllocator", refuse)
    with pytest.raises(RuntimeError, match="already initialized") as raised:
        torch_glue.install("cuda")
    assert "Can't swap" in str(raised.value.__cause__)
    assert torch_glue.installed() == []


def test_pytorchs_xpu_allocator_gives_usm_a_dpnp_array_uses(xpu_type, monkeypatch):
    """PyTorch's XPU signature with a real sycl::queue*: device USM from
    unimem.xpu's pool, written and read by dpnp."""
    import numpy as np
    import dpctl
    import dpnp
    import unimem.xpu
    hooks = StandInHooks(monkeypatch, "xpu")
    made = unimem.xpu.pluggable_allocator()
    assert isinstance(made, torch.xpu.memory.XPUPluggableAllocator)
    (_, alloc_address, free_address), = hooks.made
    assert (alloc_address, free_address) == (exported("unimem_torch_xpu_malloc"), exported("unimem_torch_xpu_free"))
    alloc, free = XPU_ALLOC(alloc_address), XPU_FREE(free_address)
    queue = unimem.xpu.default_queue(0)
    ptr = alloc(4096, 0, ctypes.c_void_p(queue.addressof_ref()))
    assert unimem.xpu.caching_allocator(0).owns(ptr)
    assert unimem.xpu.memory_allocated_by_client(0) == {"torch": 4096}      # PyTorch's, not plain C's

    class View:
        __sycl_usm_array_interface__ = {"data": (ptr, False), "shape": (1024,), "strides": None,
                                        "typestr": "<f4", "version": 1, "syclobj": queue}
    array = dpnp.ndarray((1024,), dtype="f4", buffer=dpctl.memory.as_usm_memory(View()))
    array[:] = 1.5
    assert float(dpnp.sum(array)) == 1536.0 and np.all(dpnp.asnumpy(array) == 1.5)
    del array
    queue.wait()
    free(ptr, 4096, 0, ctypes.c_void_p(queue.addressof_ref()))
    assert not unimem.xpu.caching_allocator(0).owns(ptr)


# ---------------------------------------------------------------------------
# on a GPU: PyTorch's tensors and CuPy's arrays from one pool
# ---------------------------------------------------------------------------
def run_fresh(code):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(REPO_ROOT), capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@requires_gpu
def test_torch_and_cupy_share_the_pool_on_a_gpu():
    out = run_fresh("""
        import torch, cupy, unimem
        assert "torch" in unimem.install_allocators(torch=True)
        t = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
        a = cupy.empty(1 << 20, dtype=cupy.float32)
        stats = unimem.cuda.memory_stats()
        assert stats["allocation.all.current"] == 2, stats["allocation.all.current"]
        assert stats["allocated_bytes.all.current"] == 8 << 20
        assert unimem.cuda.memory_allocated_by_client() == {"torch": 4 << 20, "cupy": 4 << 20}
        t.fill_(2); a.fill(3)
        assert float(t.sum()) == 2 * (1 << 20) and float(a.sum()) == 3 * (1 << 20)
        address = t.data_ptr()
        del t
        torch.cuda.synchronize()
        b = cupy.empty(1 << 20, dtype=cupy.float32)     # the tensor's block, reused by CuPy
        assert b.data.ptr == address, (hex(b.data.ptr), hex(address))
        assert unimem.cuda.memory_allocated_by_client() == {"cupy": 8 << 20}   # the block says who holds it now
        u = torch.ones(10, device="cuda", dtype=torch.float64)
        assert unimem.cuda.caching_allocator(0).owns(u.data_ptr())
        print("ok")
    """)
    assert out.strip().endswith("ok")


@requires_gpu
def test_after_pytorchs_first_allocation_the_rule_is_said():
    out = run_fresh("""
        import torch, unimem
        torch.zeros(1, device="cuda")
        try:
            unimem.install_allocators(torch=True)
        except RuntimeError as exc:
            assert "already initialized" in str(exc), exc
            print("refused")
    """)
    assert out.strip() == "refused"


@requires_gpu
def test_a_mempool_over_unimem_on_a_gpu():
    """Inside ``torch.cuda.MemPool(allocator)`` PyTorch's cache asks unimem for segments."""
    out = run_fresh("""
        import torch, unimem
        pool = torch.cuda.MemPool(unimem.cuda.pluggable_allocator().allocator())
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(1 << 20, device="cuda")
        assert unimem.cuda.memory_allocated() >= 4 << 20
        del t, pool
        print("ok")
    """)
    assert out.strip().endswith("ok")
