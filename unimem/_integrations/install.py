"""Installing unimem as the allocator of the array libraries in this process.

* CuPy (with a GPU): ``cupy.cuda.set_allocator(unimem.cuda.allocator)`` and
  ``cupy.cuda.set_pinned_memory_allocator(unimem.host.pinned_allocator)`` -
  every CuPy array, including the results of CuPy's operations, comes from
  unimem.
* dpnp (with a SYCL device): dpnp has no allocator hook, so its creation
  functions (``empty``, ``zeros``, ``ones``, ``full`` and their ``*_like``)
  are routed to :mod:`unimem.xpu`. The results of dpnp's own operations are
  still allocated by dpnp; pass pool arrays as ``out=`` to keep them in the pool.

:func:`uninstall_allocators` puts everything back as it was.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy

from .._runtime import devices as _devices

# What install_allocators can route to unimem, and the device type whose pool
# serves each: a library's arrays live on its own devices, whatever the current
# accelerator (UNIMEM_DEVICE=cpu still routes dpnp to the XPU pool).
ARRAY_LIBRARIES = ("cupy", "dpnp")
POOL_OF_LIBRARY = {"cupy": "cuda", "dpnp": "xpu"}
DPNP_CREATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like")

_lock = threading.Lock()
_undo: List[Tuple[str, Callable[[], None]]] = []


# What the pool arrays can be laid out as; dpnp also takes "K" and "A".
POOL_ORDERS = ("C", "F", "c", "f")


def _for_the_pool(pooled: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a dpnp creation call is one the pool serves: arguments its
    function takes, a layout it makes, a scalar fill value. Anything else
    (``order="K"``, an array as ``fill_value``, a keyword only dpnp knows) is
    dpnp's to serve, or to refuse with its own error."""
    try:
        bound = inspect.signature(pooled).bind(*args, **kwargs)
    except TypeError:
        return False
    arguments = dict(bound.arguments)
    arguments.update(arguments.pop("kwargs", {}))
    if arguments.get("order", "C") not in POOL_ORDERS:
        return False
    fill_value = arguments.get("fill_value", 0)
    return isinstance(fill_value, (numbers.Number, numpy.generic)) and not isinstance(fill_value, numpy.void)


def _route(original: Callable[..., Any], pooled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("like") is not None:
            return original(*args, **kwargs)
        kwargs.pop("like", None)
        if not _for_the_pool(pooled, args, kwargs):
            return original(*args, **kwargs)
        # A request for the pool: its errors (a device it lacks, a data type
        # the device cannot hold, ...) are the caller's to see, not hidden
        # behind a silent fallback to dpnp's own allocation.
        return pooled(*args, **kwargs)
    create.__unimem_original__ = original  # type: ignore[attr-defined]
    return create


def _install_dpnp() -> bool:
    import dpnp

    import unimem.xpu as pooled
    if getattr(dpnp.empty, "__unimem_original__", None) is not None:
        return False
    originals: Dict[str, Any] = {name: getattr(dpnp, name) for name in DPNP_CREATORS}
    for name, original in originals.items():
        setattr(dpnp, name, _route(original, getattr(pooled, name)))

    def undo() -> None:
        for name, original in originals.items():
            setattr(dpnp, name, original)
    _undo.append(("dpnp", undo))
    return True


def _install_cupy() -> bool:
    import cupy

    import unimem.cuda as pooled
    from .. import host
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pooled.allocator)
    cupy.cuda.set_pinned_memory_allocator(host.pinned_allocator)

    def undo() -> None:
        cupy.cuda.set_allocator(previous)
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    _undo.append(("cupy", undo))
    return True


def install_allocators() -> List[str]:
    """Make unimem the allocator of every array library it can serve here;
    returns their names (``["cupy"]``, ``["dpnp"]``, or ``[]`` when neither
    has a device).

    Each library is served by the pool of its own device type
    (:data:`POOL_OF_LIBRARY`), not by the current accelerator's: with
    ``UNIMEM_DEVICE=cpu`` dpnp's arrays still come from the XPU pool, and
    its statistics are ``unimem.xpu``'s."""
    installed: List[str] = []
    with _lock:
        done = {name for name, _ in _undo}
        if "cupy" not in done and _devices.is_available("cuda") and _install_cupy():
            installed.append("cupy")
        if "dpnp" not in done and _devices.is_available("xpu"):
            try:
                import dpnp  # noqa: F401
            except ImportError:
                pass
            else:
                if _install_dpnp():
                    installed.append("dpnp")
        return installed + [name for name in done]


def installed_allocators() -> List[str]:
    """The libraries :func:`install_allocators` has routed to unimem."""
    return [name for name, _ in _undo]


def uninstall_allocators(names: Optional[Iterable[str]] = None) -> None:
    """Undo :func:`install_allocators`: for the libraries in ``names`` (as it
    returned them), or for all of them."""
    with _lock:
        if names is None:
            chosen = {name for name, _ in _undo}
        else:
            chosen = set(names)
            unknown = chosen - set(ARRAY_LIBRARIES)
            if unknown:
                raise ValueError(f"unknown array libraries {sorted(unknown)} (known: {', '.join(ARRAY_LIBRARIES)})")
        # Newest first, as each undo restores what was there before it.
        for entry in reversed(list(_undo)):
            if entry[0] in chosen:
                _undo.remove(entry)
                entry[1]()
