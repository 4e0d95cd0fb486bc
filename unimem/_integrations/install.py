"""Installing unimem as the allocator of the array libraries in this process.

* CuPy (with a GPU): ``cupy.cuda.set_allocator(unimem.cuda.allocator)`` and
  ``cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)`` -
  every CuPy array, including the results of CuPy's operations, comes from
  unimem.
* dpnp (with a SYCL device): ``unimem.xpu.set_allocator()`` - every dpnp
  array allocated through Python, including the results of dpnp's
  operations, comes from unimem.
* dpnp's C++ scratch buffers, opt-in (``sycl_interpose=True``): the SYCL
  interposer (:mod:`unimem._integrations.sycl_interposer`), installed before dpnp is
  imported, serves the USM requests of dpnp's compiled extensions too.
* PyTorch, opt-in (``torch=True``, before PyTorch's first allocation on the
  device): unimem's pluggable allocator (:mod:`unimem._integrations.torch`)
  becomes ``torch.cuda``'s and ``torch.xpu``'s, so tensors and CuPy's or dpnp's
  arrays share one cache.
* Numba, opt-in (``numba=True``, before Numba's first use of the GPU):
  ``numba.cuda`` device arrays (:mod:`unimem._integrations.numba`).

:func:`uninstall_allocators` puts everything back as it was, except the
interposer (dpnp's extensions stay bound to it for the life of the process)
and PyTorch's allocator (PyTorch swaps it once).
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, List, Optional, Tuple

from .._runtime import devices as _devices

# What install_allocators can route to unimem, and the device type whose pool
# serves each: a library's arrays live on its own devices, whatever the current
# accelerator (UNIMEM_DEVICE=cpu still routes dpnp to the XPU pool).
# (PyTorch's tensors come from the pool of each device type it is served on.)
ARRAY_LIBRARIES = ("cupy", "dpnp", "torch", "numba")
POOL_OF_LIBRARY = {"cupy": "cuda", "dpnp": "xpu", "numba": "cuda"}

_lock = threading.Lock()
_undo: List[Tuple[str, Callable[[], None]]] = []


def _install_dpnp() -> None:
    """unimem.xpu.set_allocator(), unless it is in effect; the undo is noted
    once (and only if install_allocators was first to install it)."""
    import unimem.xpu as pooled
    if pooled.allocator_installed():
        return
    pooled.set_allocator()
    if not _noted("dpnp"):
        _undo.append(("dpnp", pooled.reset_allocator))


def _install_cupy() -> None:
    import cupy

    import unimem.cuda as pooled
    from .. import host
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pooled.allocator)
    cupy.cuda.set_pinned_memory_allocator(host.pinned_allocator)
    if _noted("cupy"):
        return

    def undo() -> None:
        cupy.cuda.set_allocator(previous)
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    _undo.append(("cupy", undo))


def _install_torch() -> None:
    """unimem as PyTorch's allocator on each device type both have here."""
    from . import torch as pooled
    for device_type in pooled.available_device_types():
        pooled.install(device_type)


def _install_numba() -> None:
    from . import numba as pooled
    if pooled.installed():
        return
    undo = pooled.install()
    if not _noted("numba"):
        _undo.append(("numba", undo))


def _noted(name: str) -> bool:
    return any(noted == name for noted, _ in _undo)


def _served(name: str) -> bool:
    """Whether ``name``'s arrays come from unimem now (whoever installed it)."""
    import sys
    if name == "torch":
        torch = sys.modules.get("unimem._integrations.torch")
        return torch is not None and bool(torch.installed())
    if name == "numba":
        numba = sys.modules.get("unimem._integrations.numba")
        return numba is not None and numba.installed()
    if name == "dpnp":
        xpu = sys.modules.get("unimem.xpu")
        return xpu is not None and xpu.allocator_installed()
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    import unimem.cuda as pooled
    return cupy.cuda.get_allocator() is pooled.allocator


def install_sycl_interposer() -> bool:
    """Serve the SYCL USM requests of dpnp's compiled extensions (their C++
    scratch buffers) from unimem's pools, for the rest of the process;
    returns False when it was already installed.

    Must run before dpnp is imported: raises ``RuntimeError``, changing
    nothing, when dpnp's extensions are already loaded, when there is no
    SYCL device, or when the installed dpnp imports SYCL functions the
    interposer does not know (see :mod:`unimem._integrations.sycl_interposer`)."""
    try:
        from . import sycl_interposer as _sycl_interposer
    except ImportError as exc:          # built on Linux only (ELF symbol binding)
        raise RuntimeError(f"the SYCL interposer is not available here: {exc}") from None
    if _sycl_interposer.installed():
        return False
    import unimem.xpu as pooled             # imports neither dpctl nor dpnp: the interposer's checks come first
    _sycl_interposer.install(pooled._pool_for)
    return True


def sycl_interposer_installed() -> bool:
    """Whether :func:`install_sycl_interposer` is in effect."""
    try:
        from . import sycl_interposer as _sycl_interposer
    except ImportError:
        return False
    return _sycl_interposer.installed()


def install_allocators(sycl_interpose: bool = False, torch: bool = False, numba: bool = False) -> List[str]:
    """Make unimem the allocator of every array library it can serve here
    (again, where it was taken out since); returns the names of those it
    serves now (``["cupy"]``, ``["dpnp"]``, or ``[]`` when neither has a device;
    ``"torch"`` and ``"numba"`` when asked for and served).

    Each library is served by the pool of its own device type
    (:data:`POOL_OF_LIBRARY`), not by the current accelerator's: with
    ``UNIMEM_DEVICE=cpu`` dpnp's arrays still come from the XPU pool, and
    its statistics are ``unimem.xpu``'s.

    ``sycl_interpose``: first install the SYCL interposer
    (:func:`install_sycl_interposer`), so that dpnp's C++ scratch buffers
    come from the pools too; this must happen before dpnp is imported, and
    raises ``RuntimeError`` (installing nothing) when it cannot.

    ``torch``: also make unimem PyTorch's allocator (``torch.cuda``'s where
    PyTorch and unimem both have a GPU, ``torch.xpu``'s where both have an
    XPU), through PyTorch's pluggable allocators over unimem's C ABI; this
    must happen before PyTorch's first allocation on the device, and raises
    ``RuntimeError`` saying so after it. ``numba``: also make unimem the
    memory manager of ``numba.cuda`` (with a GPU), before Numba's first use
    of it (``RuntimeError`` after)."""
    with _lock:
        if sycl_interpose:
            install_sycl_interposer()   # before the import of dpnp below
        if torch:
            _install_torch()
        if numba and _devices.is_available("cuda"):
            _install_numba()
        if _devices.is_available("cuda"):
            _install_cupy()
        if _devices.is_available("xpu"):
            try:
                import dpnp  # noqa: F401
            except ImportError:
                pass
            else:
                _install_dpnp()
        return installed_allocators()


def installed_allocators() -> List[str]:
    """The array libraries whose arrays come from unimem now (installed by
    :func:`install_allocators` or by hand, as ``unimem.xpu.set_allocator()``)."""
    return [name for name in ARRAY_LIBRARIES if _served(name)]


def uninstall_allocators(names: Optional[Iterable[str]] = None) -> None:
    """Undo :func:`install_allocators`: for the libraries in ``names`` (as it
    returned them), or for all of them. PyTorch keeps unimem as its allocator
    (it swaps its allocator once, before its first allocation): naming
    ``"torch"`` while it is served raises ``RuntimeError``."""
    with _lock:
        if names is None:
            chosen = {name for name, _ in _undo}
        else:
            chosen = set(names)
            unknown = chosen - set(ARRAY_LIBRARIES)
            if unknown:
                raise ValueError(f"unknown array libraries {sorted(unknown)} (known: {', '.join(ARRAY_LIBRARIES)})")
            if "torch" in chosen and _served("torch"):
                raise RuntimeError("PyTorch's allocator cannot be put back: PyTorch swaps it once, before its "
                                   "first allocation, and unimem's stays for the life of the process")
        # Newest first, as each undo restores what was there before it.
        for entry in reversed(list(_undo)):
            if entry[0] in chosen:
                _undo.remove(entry)
                entry[1]()
