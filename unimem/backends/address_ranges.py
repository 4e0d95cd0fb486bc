"""The exact record of reserved address ranges and of the spans mapped in
them, that a backend offering virtual memory (expandable segments) keeps.

Operating systems and drivers check little or nothing themselves: ``mmap``
with ``MAP_FIXED`` silently replaces whatever was there, ``madvise`` on memory
that is not ours throws away someone else's data, and the CUDA driver
documents undefined behaviour for a bad handle. So the backend checks every
call against this record first and refuses misuse with ``ValueError`` or
``TypeError`` before touching anything; it records the change only after
the system call succeeded. Used by the host backend (``_host.pyx``) and by
CUDA's (``cuda_vmm.py``), so both refuse the same misuse in the same words.

Mapped spans are kept merged per reserved range (sorted, disjoint, adjacent
spans joined), so the record stays small however many pages are mapped: a
map is refused if it touches any mapped byte, an unmap unless every byte of
it is mapped (it may split a span).
"""
from __future__ import annotations

import operator
import threading
from bisect import bisect_right
from typing import Any, Dict, List, Tuple


def as_int(value: Any, what: str) -> int:
    """``value`` as an int, as ``operator.index`` reads it (a bool is
    refused: ``True`` is not an address); ``TypeError`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


class AddressRanges:
    """Reserved ranges and the spans mapped in them, for one device.

    ``check_*`` methods validate a call and change nothing; ``record_*``
    methods apply a call that succeeded. ``lock`` is held by the backend
    around check, system call and record, so that two threads cannot both
    pass the check for the same span."""

    def __init__(self, granularity: int) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"the granularity must be a power of two, got {granularity}")
        self.granularity = granularity
        self.lock = threading.Lock()
        self._bases: List[int] = []                    # sorted starts of the reserved ranges
        self._sizes: Dict[int, int] = {}               # start -> size
        # per reserved range: starts and ends of its mapped spans, sorted, disjoint, merged
        self._starts: Dict[int, List[int]] = {}
        self._ends: Dict[int, List[int]] = {}

    # -- validation -------------------------------------------------------
    def check_size(self, size: Any) -> int:
        """A size to reserve: a positive multiple of the granularity."""
        checked = as_int(size, "size")
        if checked <= 0 or checked % self.granularity:
            raise ValueError(f"size {checked} is not a positive multiple of the granularity "
                             f"({self.granularity} bytes)")
        return checked

    def _span(self, address: Any, size: Any) -> Tuple[int, int, int]:
        """``(address, size, start of its reserved range)`` of a span that is
        aligned and lies inside one reserved range."""
        address = as_int(address, "address")
        size = self.check_size(size)
        if address % self.granularity:
            raise ValueError(f"address {address:#x} is not aligned to the granularity "
                             f"({self.granularity} bytes)")
        i = bisect_right(self._bases, address) - 1
        base = self._bases[i] if i >= 0 else None
        if base is None or address + size > base + self._sizes[base]:
            raise ValueError(f"[{address:#x}, {address + size:#x}) is not inside an address range "
                             f"this backend reserved")
        return address, size, base

    def check_map(self, address: Any, size: Any) -> Tuple[int, int]:
        """A span to map: aligned, inside a reserved range, no byte of it mapped."""
        address, size, base = self._span(address, size)
        starts, ends = self._starts[base], self._ends[base]
        i = bisect_right(starts, address) - 1
        if (i >= 0 and ends[i] > address) or (i + 1 < len(starts) and starts[i + 1] < address + size):
            raise ValueError(f"[{address:#x}, {address + size:#x}) is already mapped, in part or whole")
        return address, size

    def check_unmap(self, address: Any, size: Any) -> Tuple[int, int]:
        """A span to unmap: aligned, inside a reserved range, every byte mapped."""
        address, size, base = self._span(address, size)
        starts, ends = self._starts[base], self._ends[base]
        i = bisect_right(starts, address) - 1
        if i < 0 or ends[i] < address + size:
            raise ValueError(f"[{address:#x}, {address + size:#x}) is not mapped, in part or whole")
        return address, size

    def check_release(self, address: Any, size: Any) -> Tuple[int, int]:
        """A range to release: exactly one reserved range, nothing mapped in it."""
        address = as_int(address, "address")
        size = as_int(size, "size")
        if self._sizes.get(address) != size:
            raise ValueError(f"[{address:#x}, {address + size:#x}) is not an address range this "
                             f"backend reserved (give the address and size reserve_address_range had)")
        if self._starts[address]:
            raise ValueError(f"the address range at {address:#x} still has "
                             f"{self.mapped_bytes(address)} bytes mapped: unmap them first")
        return address, size

    # -- recording what succeeded -------------------------------------------
    def record_reserve(self, address: int, size: int) -> None:
        i = bisect_right(self._bases, address)
        self._bases.insert(i, address)
        self._sizes[address] = size
        self._starts[address] = []
        self._ends[address] = []

    def record_map(self, address: int, size: int) -> None:
        base = self._bases[bisect_right(self._bases, address) - 1]
        starts, ends = self._starts[base], self._ends[base]
        i = bisect_right(starts, address)         # the span goes before starts[i]
        start, end = address, address + size
        if i > 0 and ends[i - 1] == start:        # joins the span before
            i -= 1
            start = starts.pop(i)
            ends.pop(i)
        if i < len(starts) and starts[i] == end:  # joins the span after
            starts.pop(i)
            end = ends.pop(i)
        starts.insert(i, start)
        ends.insert(i, end)

    def record_unmap(self, address: int, size: int) -> None:
        base = self._bases[bisect_right(self._bases, address) - 1]
        starts, ends = self._starts[base], self._ends[base]
        i = bisect_right(starts, address) - 1
        start, end = starts.pop(i), ends.pop(i)
        if address + size < end:                  # what stays mapped after the span
            starts.insert(i, address + size)
            ends.insert(i, end)
        if start < address:                       # and before it
            starts.insert(i, start)
            ends.insert(i, address)

    def record_release(self, address: int) -> None:
        self._bases.remove(address)
        del self._sizes[address], self._starts[address], self._ends[address]

    # -- reading the record -------------------------------------------------
    def reserved(self) -> List[Tuple[int, int]]:
        """``(address, size)`` of every reserved range, by address."""
        return [(base, self._sizes[base]) for base in self._bases]

    def mapped(self, base: int) -> List[Tuple[int, int]]:
        """``(address, size)`` of the mapped spans of the range at ``base``
        (adjacent spans joined)."""
        return [(s, e - s) for s, e in zip(self._starts[base], self._ends[base])]

    def mapped_bytes(self, base: int = -1) -> int:
        """Bytes mapped in the range at ``base``, or in all ranges (-1)."""
        bases = self._bases if base == -1 else [base]
        return sum(e - s for b in bases for s, e in zip(self._starts[b], self._ends[b]))
