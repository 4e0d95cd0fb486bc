"""unimem as PyTorch's allocator: ``torch.cuda`` / ``torch.xpu`` tensors from
unimem's pools, through PyTorch's pluggable allocators over unimem's C ABI
(:func:`unimem.capi.pluggable_allocator`).

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

import threading
from typing import Any, List, Set

from .. import capi
from .._runtime import devices as _devices

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
        allocator = capi.pluggable_allocator(device_type)     # what PyTorch lacks, said first
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
