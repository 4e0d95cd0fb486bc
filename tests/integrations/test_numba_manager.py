"""unimem as Numba's CUDA memory manager (``unimem._integrations.numba``,
``unimem.install_allocators(numba=True)``): an EMM plugin Numba accepts,
whose device allocations are blocks of unimem.cuda's pool (over the
simulated CUDA runtime here, with a stand-in for Numba's context; real
device arrays are the ``gpu`` test at the end)."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba.cuda")

from numba import cuda  # noqa: E402
from numba.cuda.cudadrv import driver  # noqa: E402

import unimem  # noqa: E402
from unimem._integrations import install as _install  # noqa: E402
from unimem._integrations import numba as numba_glue  # noqa: E402
from unimem._integrations.numba import UnimemNumbaManager  # noqa: E402

from tests.helpers import REPO_ROOT  # noqa: E402
from tests.helpers.fake_cuda import fake  # noqa: E402,F401  (fixture)
from tests.helpers.gpu import requires_gpu  # noqa: E402

MiB = 1 << 20


class Device:
    def __init__(self, index):
        self.id = index


class Context:
    """What the plugin reads of Numba's Context."""

    def __init__(self, index=0):
        self.device = Device(index)


@pytest.fixture(autouse=True)
def cupy_and_dpnp_left_alone(monkeypatch):
    """install_allocators installs only Numba here (CuPy's and dpnp's, while
    the simulated GPU is served, would make it the pinned host pool's for the
    rest of the process)."""
    monkeypatch.setattr(_install, "_install_cupy", lambda: None)
    monkeypatch.setattr(_install, "_install_dpnp", lambda: None)


@pytest.fixture
def numba_manager_restored():
    saved = driver._memory_manager
    yield
    driver._memory_manager = saved


def test_numba_accepts_the_plugin(numba_manager_restored):
    cuda.set_memory_manager(UnimemNumbaManager)
    assert driver._memory_manager is UnimemNumbaManager and numba_glue.installed()
    assert UnimemNumbaManager(context=None).interface_version == numba_glue.INTERFACE_VERSION == 1


def test_device_allocations_are_unimem_blocks(fake):
    import unimem.cuda
    manager = UnimemNumbaManager(context=Context(1))
    manager.initialize()
    pointer = manager.memalloc(3 * MiB)
    address = pointer.device_ctypes_pointer.value
    assert isinstance(pointer, cuda.MemoryPointer) and pointer.size == 3 * MiB
    assert unimem.cuda.caching_allocator(1).owns(address) and fake.live[address][0] == 1
    assert unimem.cuda.memory_stats(1)["requested_bytes.all.current"] == 3 * MiB
    assert unimem.cuda.memory_allocated_by_client(1) == {"numba": 3 * MiB}       # Numba's, not unimem's
    pointer.free()                              # what Numba does when the array dies
    assert unimem.cuda.memory_allocated(1) == 0
    again = manager.memalloc(3 * MiB)
    assert again.device_ctypes_pointer.value == address and unimem.cuda.memory_stats(1)["num_device_alloc"] == 1
    del again
    gc.collect()
    assert unimem.cuda.memory_allocated(1) == 0
    assert manager.memalloc(0).size == 0 and unimem.cuda.memory_allocated(1) == 0


def test_a_context_reset_gives_every_block_back(fake):
    import unimem.cuda
    manager = UnimemNumbaManager(context=Context(0))
    pointers = [manager.memalloc(4096) for _ in range(5)]
    assert unimem.cuda.memory_stats(0)["allocation.all.current"] == 5
    manager.reset()
    assert unimem.cuda.memory_allocated(0) == 0
    for pointer in pointers:
        pointer.free()                          # the finalizers after the reset: nothing left to do
    assert unimem.cuda.memory_allocated(0) == 0


def test_memory_info_is_the_devices(fake):
    info = UnimemNumbaManager(context=Context(0)).get_memory_info()
    assert (info.free, info.total) == fake.memGetInfo()


def test_install_allocators_sets_and_unsets_numbas_manager(fake, numba_manager_restored):
    previous = driver._memory_manager
    assert "numba" in unimem.install_allocators(numba=True)
    assert driver._memory_manager is UnimemNumbaManager and "numba" in unimem.installed_allocators()
    unimem.uninstall_allocators(["numba"])
    assert driver._memory_manager is previous and "numba" not in unimem.installed_allocators()


def test_after_numbas_first_context_it_is_refused(fake, monkeypatch, numba_manager_restored):
    class MadeDevice:
        primary_context = object()
    monkeypatch.setitem(driver.driver.devices, 0, MadeDevice())
    previous = driver._memory_manager
    with pytest.raises(RuntimeError, match="Numba has made its CUDA context already"):
        unimem.install_allocators(numba=True)
    assert driver._memory_manager is previous


@requires_gpu
def test_numba_arrays_come_from_the_pool_on_a_gpu():
    code = textwrap.dedent("""
        import numpy, cupy, unimem
        assert "numba" in unimem.install_allocators(numba=True)
        from numba import cuda
        d = cuda.to_device(numpy.arange(1 << 20, dtype=numpy.float32))
        a = cupy.empty(1 << 20, dtype=cupy.float32)
        stats = unimem.cuda.memory_stats()
        assert stats["allocation.all.current"] == 2, stats
        assert unimem.cuda.caching_allocator(0).owns(d.device_ctypes_pointer.value)
        assert float(d.copy_to_host().sum()) == float(numpy.arange(1 << 20, dtype=numpy.float32).sum())
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=str(REPO_ROOT), capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
