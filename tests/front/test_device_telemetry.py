"""What the driver says about a whole device: ``device_memory_used`` and
``memory_usage`` of ``unimem.cuda`` (NVML, as PyTorch 2.13's ``torch.cuda``)
and of ``unimem.xpu`` (what dpctl reports), and the free memory XPU devices
report in ``mem_get_info``.

CUDA runs on the simulated runtime and a stand-in ``pynvml``; XPU on the real
SYCL device (the OpenCL CPU device, which reports no free memory) and on a
``dpctl.utils.intel_device_info`` that reports some, as a Level Zero GPU does.
"""
import sys

import pytest

import unimem
import unimem.cuda

from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)
from tests.helpers.fake_nvml import fake_pynvml

MiB = 1 << 20


# ---------------------------------------------------------------------------
# CUDA: NVML
# ---------------------------------------------------------------------------
def test_device_memory_used_and_memory_usage_are_nvmls(monkeypatch, fake):
    nvml = fake_pynvml(used=[5 * MiB, 7 * MiB], memory_busy=[12, 34])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert unimem.cuda.device_memory_used() == 5 * MiB          # the current device, 0
    assert unimem.cuda.device_memory_used(1) == unimem.cuda.device_memory_used("cuda:1") == 7 * MiB
    assert unimem.cuda.memory_usage(1) == 34 and unimem.cuda.memory_usage() == 12
    fake.setDevice(1)
    try:
        assert unimem.cuda.device_memory_used() == 7 * MiB
    finally:
        fake.setDevice(0)


def test_nvml_counts_every_gpu_cuda_counts_the_visible_ones(monkeypatch, fake):
    nvml = fake_pynvml(used=[0, 1, 2, 3 * MiB], memory_busy=[0, 0, 0, 9])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert unimem.cuda.device_memory_used(0) == 3 * MiB and unimem.cuda.memory_usage(0) == 9
    assert nvml.handles == [3, 3]


def test_without_nvidia_ml_py_the_error_is_pytorchs(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "pynvml", None)           # import pynvml fails
    for function in (unimem.cuda.device_memory_used, unimem.cuda.memory_usage):
        with pytest.raises(ModuleNotFoundError, match="nvidia-ml-py does not seem to be installed"):
            function()


@pytest.mark.parametrize("driver, message", [("not loaded", "cuda driver can't be loaded, is cuda enabled"),
                                             ("missing", "no NVIDIA driver was found")])
def test_without_a_driver_nvml_telemetry_is_a_runtime_error(monkeypatch, driver, message):
    nvml = fake_pynvml(driver=driver)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    for function in (unimem.cuda.device_memory_used, unimem.cuda.memory_usage):
        with pytest.raises(RuntimeError, match=message) as raised:
            function()
        assert isinstance(raised.value.__cause__, nvml.NVMLError)     # NVML's own error, kept


def test_a_device_that_is_not_there_is_refused(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(used=[0, 0], memory_busy=[0, 0]))
    with pytest.raises(unimem.InvalidDeviceError):
        unimem.cuda.device_memory_used(2)
    with pytest.raises(TypeError):
        unimem.cuda.memory_usage(1.5)


# ---------------------------------------------------------------------------
# XPU: what dpctl reports
# ---------------------------------------------------------------------------
@pytest.fixture
def reported_free(monkeypatch, xpu):
    """Have device 0 report ``free`` bytes free, as a Level Zero GPU does
    through ``dpctl.utils.intel_device_info`` (with ZES_ENABLE_SYSMAN=1)."""
    import dpctl.utils
    device = xpu.default_queue(0).sycl_device
    real = dpctl.utils.intel_device_info

    def report(free):
        monkeypatch.setattr(dpctl.utils, "intel_device_info",
                            lambda asked: {**real(asked), "free_memory": free} if asked == device else real(asked))
    return report


def test_xpu_device_memory_used_is_the_global_memory_less_the_free_the_device_reports(xpu, reported_free):
    total = xpu.default_queue(0).sycl_device.global_mem_size
    reported_free(total - 300 * MiB)
    assert xpu.device_memory_used() == xpu.device_memory_used(0) == xpu.device_memory_used("xpu:0") == 300 * MiB


def test_xpu_mem_get_info_gives_the_free_memory_the_device_reports(xpu, reported_free):
    """The backend looked for a ``SyclDevice.free_memory`` that dpctl does not
    have: the free memory was always its estimate (the total less what
    unimem holds)."""
    total = xpu.default_queue(0).sycl_device.global_mem_size
    reported_free(1234 * MiB)
    assert xpu.mem_get_info(0) == (1234 * MiB, total)


def test_xpu_device_memory_used_where_the_device_reports_no_free_memory(xpu):
    """dpctl's OpenCL CPU device reports none: PyTorch's RuntimeError where
    its Level Zero query is not available."""
    import dpctl.utils
    assert "free_memory" not in dpctl.utils.intel_device_info(xpu.default_queue(0).sycl_device)
    with pytest.raises(RuntimeError, match="GPU memory usage querying is not available"):
        xpu.device_memory_used()


def test_xpu_memory_usage_is_pytorchs_error_after_the_device_is_checked(xpu):
    with pytest.raises(RuntimeError, match="GPU memory bandwidth usage querying is not available"):
        xpu.memory_usage()
    with pytest.raises(unimem.InvalidDeviceError):
        xpu.memory_usage(xpu.device_count())
    with pytest.raises(TypeError):
        xpu.device_memory_used(1.5)
