"""Fixtures of the XPU front tests (test_xpu.py, test_dpnp_allocator.py):
the real SYCL device (the OpenCL CPU device in CI), which they need to run,
not skip."""
import pytest

from unimem._runtime import devices as _devices


@pytest.fixture(scope="module")
def xpu():
    """``unimem.xpu``; a failure, not a skip, without a SYCL device."""
    if not _devices.is_available("xpu"):
        pytest.fail(f"no SYCL device: {_devices.unavailable_reason('xpu')} -- the XPU tests must run "
                    f"(pip install -e '.[xpu,test]' installs dpctl, dpnp and intel-opencl-rt)")
    import unimem.xpu
    return unimem.xpu


@pytest.fixture(scope="module")
def dpnp():
    import dpnp
    return dpnp


@pytest.fixture
def hooked(xpu):
    """``unimem.xpu`` with the dpnp allocator installed for one test, and
    uninstalled after it."""
    xpu.set_allocator()
    yield xpu
    xpu.reset_allocator()
    xpu.synchronize()
