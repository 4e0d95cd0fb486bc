"""Whether this machine can run the tests that need an NVIDIA GPU, and their marks.

Tests that need a GPU skip cleanly without one (CI has none); ``.ci/gpu``
runs them where there is one."""
from typing import Any, Callable, List

import pytest


def cuda_gpu_available() -> bool:
    """CuPy imports and sees at least one GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_driver_bindings_available() -> bool:
    """A GPU, and cuda-bindings for the driver's virtual memory calls."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except Exception:
        return False
    return cuda_gpu_available()


#: The marks of a module (``pytestmark``) whose tests need a GPU; the ``gpu``
#: marker selects them (``-m gpu``).
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not cuda_gpu_available(), reason="needs an NVIDIA GPU")]
needs_gpu_and_driver_bindings = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_driver_bindings_available(), reason="needs an NVIDIA GPU and cuda-bindings")]


def requires_gpu(test: Callable[..., Any]) -> Callable[..., Any]:
    """The marks of :data:`needs_gpu` on one test."""
    return _marked(test, needs_gpu)


def requires_gpu_and_driver_bindings(test: Callable[..., Any]) -> Callable[..., Any]:
    """The marks of :data:`needs_gpu_and_driver_bindings` on one test."""
    return _marked(test, needs_gpu_and_driver_bindings)


def _marked(test: Callable[..., Any], marks: List[Any]) -> Callable[..., Any]:
    for mark in marks:
        test = mark(test)
    return test
