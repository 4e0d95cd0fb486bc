"""unimem as PyTorch's allocator: ``torch.cuda`` / ``torch.xpu`` tensors from
unimem's pools, through PyTorch's pluggable allocators over unimem's C ABI
(:func:`pluggable_allocator`, exported as :func:`unimem.capi.pluggable_allocator`).

PyTorch takes a pluggable allocator as its current one only before its first
allocation on the device (``change_current_allocator`` refuses once its own
allocator is initialized, which happens when PyTorch sets the device up). The
rule is checked here first, with an error that says what to do. Once
installed, PyTorch asks unimem for every tensor with no cache of its own
above: ``unimem.cuda.memory_stats()`` (or ``unimem.xpu``'s) counts PyTorch's
tensors beside CuPy's (dpnp's) arrays, and ``torch.cuda.memory_stats()``
reports nothing (PyTorch's pluggable allocators keep no statistics). It
cannot be undone in the process: PyTorch swaps its allocator once.
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import Any, Callable, Dict, List, Set

from .._runtime import devices as _devices
from . import capi as _c_abi          # the C ABI's library, which PyTorch's allocator loads

#: The device types whose PyTorch allocator unimem can be.
DEVICE_TYPES = ("cuda", "xpu")

_lock = threading.Lock()
_installed: Set[str] = set()


def _torch_namespace(device_type: str) -> Any:
    import torch
    return getattr(torch, device_type)


def available_device_types() -> List[str]:
    """The device types on which both PyTorch and unimem have a device here."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return []
    found = []
    for device_type in DEVICE_TYPES:
        namespace = getattr(torch, device_type, None)
        if namespace is not None and namespace.is_available() and _devices.is_available(device_type):
            found.append(device_type)
    return found


def _already_initialized(device_type: str) -> RuntimeError:
    return RuntimeError(
        f"PyTorch's {device_type} allocator is already initialized (torch.{device_type}.is_initialized(): "
        f"PyTorch set the device up, or allocated on it), and PyTorch swaps its allocator only before that. "
        f"Install unimem first: unimem.install_allocators(torch=True) (or torch.{device_type}.memory."
        f"change_current_allocator(unimem.{device_type}.pluggable_allocator())) right after importing torch, "
        f"before the first tensor on the device")


def install(device_type: str) -> bool:
    """Make unimem PyTorch's current allocator on ``device_type``; returns
    False when it already is. ``RuntimeError`` (changing nothing) when PyTorch
    already initialized its allocator there, when PyTorch is built without the
    device, or when unimem has no such device."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"unimem can be PyTorch's allocator on {' and '.join(DEVICE_TYPES)}, "
                         f"not {device_type!r}")
    with _lock:
        if device_type in _installed:
            return False
        allocator = pluggable_allocator(device_type)     # what PyTorch lacks, said first
        namespace = _torch_namespace(device_type)
        if namespace.is_initialized():
            raise _already_initialized(device_type)
        try:
            namespace.memory.change_current_allocator(allocator)
        except RuntimeError as exc:           # "Can't swap an already initialized allocator"
            raise _already_initialized(device_type) from exc
        _installed.add(device_type)
        return True


def installed() -> List[str]:
    """The device types on which unimem is PyTorch's allocator (installed here)."""
    return [device_type for device_type in DEVICE_TYPES if device_type in _installed]


# PyTorch's pluggable allocator class and the hook of its C extension it needs, by device type.
_TORCH_ALLOCATORS = {"cuda": ("CUDAPluggableAllocator", "_cuda_customAllocator"),
                     "xpu": ("XPUPluggableAllocator", "_xpu_customAllocator")}
_made: Dict[str, Any] = {}
_made_lock = threading.Lock()


def pluggable_allocator(device_type: str) -> Any:
    """PyTorch's pluggable allocator over unimem's pool of ``device_type``
    (``"cuda"``: ``torch.cuda.memory.CUDAPluggableAllocator``; ``"xpu"``:
    ``torch.xpu.memory.XPUPluggableAllocator``), over ``unimem_torch_<type>_malloc``
    and ``unimem_torch_<type>_free`` (``unimem_<type>_*`` whose blocks' client
    is ``"torch"``). One object per device type and process: pass it
    to ``torch.<type>.memory.change_current_allocator`` (before PyTorch's
    first allocation on the device) or to ``torch.<type>.MemPool``.

    Raises ``ValueError`` for another device type, ``RuntimeError`` when unimem
    has no such device here (saying why) or when PyTorch is missing or built
    without that device (a CPU build has neither hook)."""
    if device_type not in _TORCH_ALLOCATORS:
        raise ValueError(f"PyTorch's pluggable allocators are for 'cuda' and 'xpu', not {device_type!r}")
    with _made_lock:
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
        library = os.path.abspath(_c_abi.__file__)     # unimem.capi.library_path()
        made = getattr(memory, class_name)(library, f"unimem_torch_{device_type}_malloc",
                                           f"unimem_torch_{device_type}_free")
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
