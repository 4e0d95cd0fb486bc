"""unimem: PyTorch-grade caching allocation and memory statistics for CuPy,
dpctl/dpnp and host memory.

Layers, as the package is laid out::

    unimem.backends.*     raw memory: host, simulated, pluggable, xpu (SYCL USM), cuda
    unimem._core          the caching allocator and its statistics (Cython)
    unimem.accelerator    the torch.accelerator-shaped facade, by device index
    unimem.cpu/xpu/cuda   per-device-type namespaces;  unimem.host: the pinned pool
    unimem.capi           the pools from C, and as PyTorch's allocator (unimem.h)

Quick start::

    import unimem
    p = unimem.accelerator.caching_allocator_alloc(1000)
    unimem.accelerator.memory_stats(0)["allocated_bytes.all.current"]   # 1024
    unimem.accelerator.caching_allocator_delete(p)
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

from .backends.opencl_env import ensure_opencl_cpu_runtime

# Before anything asks dpctl for devices: let it find the pip-installed SYCL
# CPU runtime (a no-op where intel-opencl-rt is not installed). unimem's .pth
# hook has done it at interpreter start; this is for setups without the hook
# (python -S, a checkout on PYTHONPATH), and notes when dpctl came first.
ensure_opencl_cpu_runtime()

from . import accelerator, capi, cpu, host  # noqa: E402  (capi: sets up the C ABI's library)
from ._runtime import devices as _devices  # noqa: E402
from ._runtime import fork as _fork  # noqa: E402,F401  (the package's one fork handler)
from ._core import (Allocation, CachingAllocator, InvalidDeviceError, InvalidPointerError,  # noqa: E402
                    OutOfMemoryError, WriteAfterFreeWarning)
from ._observe.history import (attach_out_of_memory_observer, attach_out_of_memory_stats_observer,  # noqa: E402
                               detach_out_of_memory_observer, detach_out_of_memory_stats_observer)
from ._integrations.install import install_allocators, installed_allocators, uninstall_allocators  # noqa: E402
from ._runtime.devices import device  # noqa: E402
from .backends.base import Backend  # noqa: E402
from .backends.pluggable import PluggableAllocator  # noqa: E402
from .host import (host_memory_stats, reset_accumulated_host_memory_stats,  # noqa: E402
                   reset_peak_host_memory_stats)

__version__ = "0.1.0"

__all__ = [
    "accelerator", "capi", "cpu", "host", "xpu", "cuda", "device",
    "InvalidDeviceError", "InvalidPointerError", "OutOfMemoryError", "WriteAfterFreeWarning",
    "CachingAllocator", "Allocation", "Backend", "PluggableAllocator",
    "change_current_allocator", "attach_out_of_memory_observer", "detach_out_of_memory_observer",
    "attach_out_of_memory_stats_observer", "detach_out_of_memory_stats_observer",
    "install_allocators", "installed_allocators", "uninstall_allocators",
    "host_memory_stats", "reset_peak_host_memory_stats",
    "reset_accumulated_host_memory_stats",
]


def change_current_allocator(allocator: Backend) -> None:
    r"""Change the raw memory source of the current accelerator.

    ``allocator`` (usually a :class:`PluggableAllocator`) becomes the backend
    under the caching allocator: it is asked for memory only on a cache miss,
    and gets caching, statistics and the out-of-memory retry on top.

    .. note::
        Call it before the first allocation on the current accelerator:
        swapping an initialized allocator raises ``RuntimeError``, as in PyTorch.
    """
    if not callable(getattr(allocator, "malloc", None)) or not callable(getattr(allocator, "free", None)):
        raise TypeError("change_current_allocator expects a backend such as unimem.PluggableAllocator, "
                        f"got {type(allocator).__name__}")
    _devices.replace_backend(_devices.current_type_name(), allocator)


# Submodules imported on first use, so that ``import unimem`` imports neither
# CuPy, dpctl, prometheus_client nor dask: unimem.xpu / unimem.cuda need their
# array library, unimem.prometheus / unimem.dask their extra.
_LAZY_SUBMODULES = ("xpu", "cuda", "prometheus", "dask")

if TYPE_CHECKING:          # what __getattr__ imports, seen by type checkers and IDEs
    from . import cuda, dask, prometheus, xpu  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'unimem' has no attribute '{name}'")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
