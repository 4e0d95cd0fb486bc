"""What the memory functions take, checked: memory objects and their
addresses (``record_stream``), data types, memory fractions."""
from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Dict, Iterable, Optional, Protocol, SupportsIndex, Union

import numpy

from .. import _core


def numpy_dtype(dtype: Any) -> "numpy.dtype[Any]":
    """``numpy.dtype(dtype)``, failing only as the array functions document:
    NumPy parses some strings with ``ast.literal_eval`` and lets its
    SyntaxError (or others) out, for ``b","`` say; those become a TypeError."""
    try:
        return numpy.dtype(dtype)
    except (TypeError, ValueError):
        raise
    except Exception as exc:
        raise TypeError(f"data type {dtype!r} not understood") from exc



class HasPointer(Protocol):
    """A memory object with its address as ``ptr``: a CuPy ``Memory`` (such as
    :class:`unimem.cuda.PooledMemory`) or ``MemoryPointer``, an :class:`unimem.Allocation`."""

    @property
    def ptr(self) -> int: ...


class HasArrayInterface(Protocol):
    """A NumPy array (NumPy's ``__array_interface__``)."""

    @property
    def __array_interface__(self) -> Dict[str, Any]: ...


class HasCudaArrayInterface(Protocol):
    """A CUDA array such as a CuPy ndarray (``__cuda_array_interface__``)."""

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...


class HasSyclUsmArrayInterface(Protocol):
    """A SYCL USM array or memory object: a dpnp ndarray, a dpctl
    ``usm_ndarray`` or ``MemoryUSMDevice``/``Shared``/``Host``."""

    @property
    def __sycl_usm_array_interface__(self) -> Dict[str, Any]: ...


MemoryLike = Union[SupportsIndex, HasPointer, HasArrayInterface, HasCudaArrayInterface,
                   HasSyclUsmArrayInterface]
"""What ``record_stream`` takes: an array, a memory object, or an address."""

ADDRESS_LIMIT = 1 << 64


def block_address(memory: MemoryLike) -> int:
    """The address of the block behind ``memory``: where the whole buffer an
    array views starts (a view's first element may lie further in), a memory
    object's address, or an address as given. 0 when there is no memory (an
    empty array, a freed ``PooledMemory``), as for PyTorch's empty tensors.

    Raises ``TypeError`` for what is none of these (``bool``, ``float``,
    ``None``, an object with no address) and ``ValueError`` for an integer
    that is no address."""
    if isinstance(memory, bool):            # an int to Python, but no address
        raise _not_memory(memory)
    if isinstance(memory, numbers.Integral):    # an int or a NumPy integer (which has an array interface)
        address = operator.index(memory)
    else:
        start = _buffer_start(memory)
        if start is None:
            raise _not_memory(memory)
        address = start
    if not 0 <= address < ADDRESS_LIMIT:
        raise ValueError(f"invalid address {address!r}: not a pointer")
    return address


def _not_memory(memory: object) -> TypeError:
    return TypeError(f"expected an array, a memory object (MemoryPointer, Memory, MemoryUSM*, "
                     f"unimem.Allocation) or an address, got {type(memory).__name__}")


def _buffer_start(memory: Any) -> Optional[int]:
    """Where the buffer behind an array or memory object starts (0 for an
    empty array); None for what is neither. The array interfaces are looked
    up on the type: reading CuPy's would ask CUDA for the current stream."""
    kind = type(memory)
    if hasattr(kind, "__sycl_usm_array_interface__"):
        if getattr(memory, "size", None) == 0:
            return 0
        array = memory.get_array() if hasattr(memory, "get_array") else memory   # dpnp -> usm_ndarray
        buffer = getattr(array, "usm_data", array)       # a usm_ndarray's whole buffer, or MemoryUSM*
        return _integer_attribute(buffer, "_pointer")
    if hasattr(kind, "__cuda_array_interface__"):
        if memory.size == 0:
            return 0
        whole = getattr(getattr(memory, "data", None), "mem", None)
        if whole is not None:                             # CuPy: ndarray.data is a MemoryPointer
            return _integer_attribute(whole, "ptr")
        return _integer_attribute(memory.__cuda_array_interface__["data"], 0)
    if hasattr(memory, "mem"):                            # a CuPy MemoryPointer: its whole Memory
        return _integer_attribute(memory.mem, "ptr")
    if hasattr(kind, "__array_interface__"):
        if getattr(memory, "size", None) == 0:
            return 0
        # NumPy collapses a view's base to the object owning the buffer (for
        # unimem.cpu arrays, the pool block's exporter); its interface gives the start.
        owner = memory
        while getattr(owner, "base", None) is not None and hasattr(type(owner.base), "__array_interface__"):
            owner = owner.base
        return _integer_attribute(owner.__array_interface__["data"], 0)
    if hasattr(memory, "ptr"):                            # CuPy Memory, PooledMemory, an Allocation
        return _integer_attribute(memory, "ptr")
    return None


def _integer_attribute(holder: Any, key: Union[str, int]) -> int:
    value = holder[key] if isinstance(key, int) else getattr(holder, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the address of {type(holder).__name__} is not an int: {value!r}")
    return value


def record_stream_on_pools(memory: MemoryLike, stream: Any,
                           pools: Iterable[Callable[[int], Optional[_core.CachingAllocator]]],
                           stream_handle: Callable[[_core.CachingAllocator], int], pools_name: str) -> None:
    """``record_stream`` for every namespace: the block behind ``memory``,
    looked for with each of ``pools`` (``address -> its allocator or None``)
    in turn, is marked as used by ``stream_handle(owner)``.

    Nothing changes when ``memory`` is refused, its block is not in
    ``pools_name`` or the stream is: the errors come before the record."""
    address = block_address(memory)
    if address == 0:            # no memory, nothing to protect (as PyTorch does for empty tensors)
        return
    for find_owner in pools:
        owner = find_owner(address)
        if owner is not None:
            owner.record_stream(address, stream_handle(owner))
            return
    raise _core.InvalidPointerError(f"address {address:#x} is not a live block of {pools_name}")


def check_bool(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is a bool or a NumPy bool: what a
    pybind11 ``bool`` takes without implicit conversion (which would also
    take None, 0 or 1: see native_bool for the arguments that do)."""
    kind = type(value)
    if not isinstance(value, bool) and not (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        raise TypeError(f"{name} must be a bool, not {kind.__module__ + '.' if kind.__module__ != 'builtins' else ''}"
                        f"{kind.__name__}")


def native_bool(name: str, value: Any) -> bool:
    """``value`` as a C++ bool argument of PyTorch's (a pybind11 ``bool``,
    such as ``MemPool``'s flags) takes it: ``True``/``False``, ``None`` (false),
    or an object of a type with ``__bool__`` (a number, a NumPy bool).
    ``TypeError`` for the rest, such as a string or a list, whose truth is only
    their length."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if getattr(type(value), "__bool__", None) is None:
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    try:
        return bool(value)
    except Exception as exc:
        raise TypeError(f"{name} must be a bool; bool({value!r}) failed: {exc}") from exc


def check_fraction(fraction: Any) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:   # also refuses NaN
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    return fraction
