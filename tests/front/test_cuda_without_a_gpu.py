"""``unimem.cuda`` on a machine without a usable NVIDIA GPU.

The module imports, ``device_count()`` is 0, and code that measures memory
runs: the statistics of the device a program names by default read as
``torch.cuda``'s before CUDA is initialised (an empty ``memory_stats``, zeros,
a summary table of zeros, resets that do nothing). What needs a device
(``mem_get_info``, ``synchronize``, allocating) raises ``RuntimeError`` saying
why, with the runtime's error as its cause; bad device arguments raise as
where there are GPUs.

The tests make the machine one without a driver (CuPy's runtime replaced by
one that fails as CuPy's does there), so they run on GPU machines too; those
at the end check this machine as it is, where it has no driver.
"""
import gc
import warnings
import weakref

import pytest

import unimem
from unimem._observe.summary import memory_summary_table
from unimem._runtime import devices as _devices
from unimem.backends import cuda as cuda_backend

from tests.helpers.fake_cuda import CUDARuntimeError
from tests.helpers.gpu import cuda_gpu_available

cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
import unimem.cuda as ucuda  # noqa: E402

CUDA_ERROR_INSUFFICIENT_DRIVER = 35


class RuntimeWithoutADriver:
    """CuPy's runtime where the driver is missing (``driver_version`` 0) or
    older than CuPy's CUDA: every call fails with cudaErrorInsufficientDriver,
    the version queries answer."""

    def __init__(self, driver_version=0, runtime_version=12090):
        self.driver_version, self.runtime_version = driver_version, runtime_version

    def getDeviceCount(self):
        raise CUDARuntimeError(CUDA_ERROR_INSUFFICIENT_DRIVER)

    def driverGetVersion(self):
        return self.driver_version

    def runtimeGetVersion(self):
        return self.runtime_version


@pytest.fixture
def no_driver(monkeypatch):
    """unimem as on a machine without an NVIDIA driver: the cuda device type
    probed again, over a runtime that fails as CuPy's does there."""
    runtime = RuntimeWithoutADriver()
    monkeypatch.setattr(cuda_backend, "_default_runtime", lambda: runtime)
    monkeypatch.setattr(_devices, "_unavailable", {})
    monkeypatch.setattr(_devices, "_unavailable_causes", {}, raising=False)
    saved = _devices._types.get("cuda")
    _devices.install_type("cuda", None)
    try:
        yield runtime
    finally:
        _devices.install_type("cuda", saved)


# ---------------------------------------------------------------------------
# the statistics of the device never used
# ---------------------------------------------------------------------------
DEFAULT_DEVICES = [None, 0, "cuda", "cuda:0", unimem.device("cuda", 0)]


@pytest.mark.parametrize("device", DEFAULT_DEVICES)
def test_the_statistics_read_as_pytorchs_before_cuda_is_initialised(no_driver, device):
    assert ucuda.memory_stats(device) == {} and ucuda.memory_stats_as_nested_dict(device) == {}
    assert (ucuda.memory_allocated(device), ucuda.max_memory_allocated(device),
            ucuda.memory_reserved(device), ucuda.max_memory_reserved(device)) == (0, 0, 0, 0)
    assert ucuda.memory_allocated_by_client(device) == {}
    with pytest.warns(FutureWarning):
        assert ucuda.memory_cached(device) == ucuda.max_memory_cached(device) == 0


@pytest.mark.parametrize("device", DEFAULT_DEVICES)
def test_the_resets_do_nothing(no_driver, device):
    """They raised RuntimeError: a script that resets the peak before
    measuring stopped there on a CPU machine."""
    ucuda.reset_peak_memory_stats(device)
    ucuda.reset_accumulated_memory_stats(device)
    with pytest.warns(FutureWarning):
        ucuda.reset_max_memory_allocated(device)
    with pytest.warns(FutureWarning):
        ucuda.reset_max_memory_cached(device)
    assert ucuda.memory_stats(device) == {}


@pytest.mark.parametrize("abbreviated", [False, True])
def test_memory_summary_is_the_table_of_zeros(no_driver, abbreviated):
    zeros = memory_summary_table({}, "GPU", 0, abbreviated)
    assert ucuda.memory_summary(abbreviated=abbreviated) == ucuda.memory_summary(0, abbreviated) == zeros
    assert "device ID 0" in zeros and " 0 B " in zeros


STATISTICS = ["memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "memory_allocated_by_client",
              "max_memory_allocated",
              "memory_reserved", "max_memory_reserved", "memory_summary", "reset_peak_memory_stats",
              "reset_accumulated_memory_stats"]


@pytest.mark.parametrize("name", STATISTICS)
@pytest.mark.parametrize("device, error", [(5, unimem.InvalidDeviceError), ("cuda:1", unimem.InvalidDeviceError),
                                           (-1, unimem.InvalidDeviceError), (1.5, TypeError), (True, TypeError),
                                           ("xpu:0", ValueError), ("gpu", ValueError)])
def test_a_device_argument_that_names_no_device_is_refused(no_driver, name, device, error):
    """As on a machine with GPUs: only the default device reads as never used."""
    with pytest.raises(error):
        getattr(ucuda, name)(device)


# ---------------------------------------------------------------------------
# what needs a device
# ---------------------------------------------------------------------------
NEEDS_A_DEVICE = {
    "mem_get_info": lambda: ucuda.mem_get_info(),
    "get_memory_info": lambda: ucuda.get_memory_info(0),
    "synchronize": lambda: ucuda.synchronize(),
    "ipc_collect": lambda: ucuda.ipc_collect(),
    "allocator": lambda: ucuda.allocator(100),
    "caching_allocator_alloc": lambda: ucuda.caching_allocator_alloc(100),
    "MemoryPool": lambda: ucuda.MemoryPool(),
    "MemPool": lambda: ucuda.MemPool(),
}


@pytest.mark.parametrize("name", NEEDS_A_DEVICE)
def test_what_needs_a_device_says_no_driver_was_found(no_driver, name):
    """CuPy's cudaErrorInsufficientDriver says the driver "is insufficient"
    where there is none at all: unimem says so, CuPy's error kept as the cause."""
    with pytest.raises(RuntimeError, match="no cuda device is available: no NVIDIA driver was found") as raised:
        NEEDS_A_DEVICE[name]()
    assert "insufficient" not in str(raised.value)
    assert isinstance(raised.value.__cause__, CUDARuntimeError)
    assert raised.value.__cause__.status == CUDA_ERROR_INSUFFICIENT_DRIVER


def test_the_cause_kept_for_later_errors_keeps_nothing_of_the_first_caller_alive(no_driver):
    """The runtime's error is kept, to chain it to every later error; its
    traceback reached up the stack of the first call, whose objects then
    lived until the interpreter exited (pool blocks freed at exit, when
    dpctl was gone)."""
    class Held:
        pass

    def first_call():
        held = Held()
        with pytest.raises(RuntimeError):
            ucuda.mem_get_info()
        return weakref.ref(held)
    held = first_call()
    gc.collect()
    assert held() is None


def test_the_rest_carries_on(no_driver):
    assert ucuda.device_count() == 0 and not ucuda.is_available()
    ucuda.empty_cache()                          # a no-op, as torch.cuda.empty_cache without CUDA
    assert ucuda.memory_snapshot() == []


def test_a_driver_older_than_cupys_cuda_is_told_apart_from_none(no_driver):
    no_driver.driver_version = 11080
    with pytest.raises(RuntimeError, match=r"the NVIDIA driver supports CUDA 11\.8, older than CuPy's CUDA "
                                           r"runtime 12\.9: update the driver") as raised:
        ucuda.mem_get_info()
    assert isinstance(raised.value.__cause__, CUDARuntimeError)


def test_another_runtime_error_is_passed_on_as_it_is(no_driver):
    def fails():
        raise CUDARuntimeError(999)
    no_driver.getDeviceCount = fails
    with pytest.raises(RuntimeError, match="CUDA cannot be used here: cudaError 999"):
        ucuda.synchronize()


# ---------------------------------------------------------------------------
# this machine, as it is
# ---------------------------------------------------------------------------
def _has_no_driver():
    try:
        return cupy.cuda.runtime.driverGetVersion() == 0
    except Exception:
        return False


@pytest.mark.skipif(not _has_no_driver(), reason="this machine has an NVIDIA driver")
def test_on_this_machine_without_a_driver():
    assert not cuda_gpu_available()
    with pytest.raises(RuntimeError, match="no NVIDIA driver was found") as raised:
        ucuda.mem_get_info()
    assert isinstance(raised.value.__cause__, cupy.cuda.runtime.CUDARuntimeError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no warning either
        ucuda.reset_peak_memory_stats()
        assert ucuda.memory_allocated() == ucuda.max_memory_allocated() == 0
    assert ucuda.memory_summary() == memory_summary_table({}, "GPU", 0, False)
