"""``unimem.capi``: unimem's pools from C and C++, and as PyTorch's allocator.

A shared library with a C ABI (the header ``unimem.h`` in :func:`get_include`)
allocates from the same caching pools as unimem's Python side, so that PyTorch
(through its pluggable allocators), CuPy (``unimem.cuda.allocator``), dpnp
(``unimem.xpu.set_allocator()``) and C code share one cache and one set of
statistics::

    cc -shared -fPIC mylib.c -I"$(python -c 'import unimem.capi as c; print(c.get_include())')" \\
        -L<dir of library_path()> -l:<its file name> -Wl,-rpath,<that dir>

The library is unimem's extension module ``unimem._integrations.capi``: it works in a
process whose Python imported unimem (``import unimem`` sets it up); called
before that, its functions return ``NULL`` and ``unimem_last_error()`` says
why. :func:`pluggable_allocator` builds PyTorch's ``CUDAPluggableAllocator`` /
``XPUPluggableAllocator`` over it (``unimem.cuda.pluggable_allocator()``,
``unimem.xpu.pluggable_allocator()``); ``unimem.install_allocators(torch=True)``
installs them.
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import Any, Callable, Dict

from ._integrations import capi as _capi
from ._runtime import devices as _devices

__all__ = ["ABI_VERSION", "library_path", "get_include", "pluggable_allocator"]

#: The version of the C ABI: ``UNIMEM_ABI_VERSION`` of ``unimem.h``, and what
#: the library's ``unimem_abi_version()`` returns.
ABI_VERSION: int = _capi.ABI_VERSION

# PyTorch's pluggable allocator class and the hook of its C extension it needs, by device type.
_TORCH_ALLOCATORS = {"cuda": ("CUDAPluggableAllocator", "_cuda_customAllocator"),
                     "xpu": ("XPUPluggableAllocator", "_xpu_customAllocator")}
_made: Dict[str, Any] = {}
_lock = threading.Lock()


def library_path() -> str:
    """The path of the shared library that exports ``unimem.h``'s functions."""
    return os.path.abspath(_capi.__file__)


def get_include() -> str:
    """The folder that holds ``unimem.h`` (pass it to the compiler with ``-I``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def pluggable_allocator(device_type: str) -> Any:
    """PyTorch's pluggable allocator over unimem's pool of ``device_type``
    (``"cuda"``: ``torch.cuda.memory.CUDAPluggableAllocator``; ``"xpu"``:
    ``torch.xpu.memory.XPUPluggableAllocator``), over ``unimem_<type>_malloc``
    and ``unimem_<type>_free``. One object per device type and process: pass it
    to ``torch.<type>.memory.change_current_allocator`` (before PyTorch's
    first allocation on the device) or to ``torch.<type>.MemPool``.

    Raises ``ValueError`` for another device type, ``RuntimeError`` when unimem
    has no such device here (saying why) or when PyTorch is missing or built
    without that device (a CPU build has neither hook)."""
    if device_type not in _TORCH_ALLOCATORS:
        raise ValueError(f"PyTorch's pluggable allocators are for 'cuda' and 'xpu', not {device_type!r}")
    with _lock:
        made = _made.get(device_type)
        if made is not None:
            return made
        _devices.get_type(device_type)       # raises, saying why, when unimem has no such device
        class_name, hook = _TORCH_ALLOCATORS[device_type]
        try:
            import torch
        except ImportError as exc:
            raise RuntimeError(f"PyTorch is not installed ({exc}): there is no {class_name} to build") from None
        if not hasattr(torch._C, hook):
            raise RuntimeError(f"this PyTorch ({torch.__version__}) is built without {device_type.upper()}: it "
                               f"has no torch._C.{hook}, which {class_name} needs")
        memory = importlib.import_module(f"torch.{device_type}.memory")
        made = getattr(memory, class_name)(library_path(), f"unimem_{device_type}_malloc",
                                           f"unimem_{device_type}_free")
        _made[device_type] = made
        return made


_ARRAYS_BESIDE = {"cuda": "CuPy's arrays", "xpu": "dpnp's arrays"}


def namespace_pluggable_allocator(device_type: str) -> Callable[[], Any]:
    """``pluggable_allocator()`` of the namespace ``unimem.<device_type>``."""
    torch_class = _TORCH_ALLOCATORS[device_type][0]

    def pluggable_allocator() -> Any:
        return globals()["pluggable_allocator"](device_type)
    pluggable_allocator.__module__ = f"unimem.{device_type}"
    pluggable_allocator.__qualname__ = "pluggable_allocator"
    pluggable_allocator.__doc__ = (
        f"PyTorch's ``torch.{device_type}.memory.{torch_class}`` over unimem's {device_type.upper()} pools "
        f"(:func:`unimem.capi.pluggable_allocator`): set as PyTorch's allocator, its tensors and "
        f"{_ARRAYS_BESIDE[device_type]} come from one cache. The other way round from "
        f":class:`{torch_class}`, which puts a library's functions under unimem.")
    return pluggable_allocator
