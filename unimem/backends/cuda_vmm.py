"""CUDA virtual memory management (expandable segments) through the driver API.

CuPy 14 does not expose the driver's VMM calls; NVIDIA's ``cuda-bindings``
package (``cuda.bindings.driver``) does. Driven as PyTorch's
``ExpandableSegment`` (``c10/cuda/CUDACachingAllocator.cpp``) drives them:

- ``cuMemAddressReserve`` reserves address space, no memory behind it;
- every page of the granularity gets its own physical allocation
  (``cuMemCreate``, pinned device memory) mapped with ``cuMemMap``, so that
  any page-aligned span can be unmapped later (``cuMemUnmap`` can only undo
  a whole ``cuMemMap``); ``cuMemSetAccess`` then makes the span readable
  and writable from the device (mappings start with no access);
- unmapping is ``cuMemUnmap`` and ``cuMemRelease`` of each page's handle;
  ``cuMemAddressFree`` gives the address space back.

Every call is checked first against an exact record of the reserved ranges
and mapped pages (:class:`~unimem.backends.address_ranges.AddressRanges`):
the driver's behaviour on a bad handle is undefined, and a misuse must be a
``ValueError`` that changes nothing. The caller makes the device current
(the driver works on the current context); see ``CUDABackend``.

The driver module is a parameter, so the tests drive this code with a
simulated driver (``tests/helpers/fake_cuda.FakeCudaDriver``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .address_ranges import AddressRanges, as_int

#: PyTorch maps expandable segments by 2 MiB pages (its large-buffer size);
#: the driver's recommended granularity is used instead where it is larger.
PAGE_SIZE = 2 << 20

INSTALL_HINT = ("install NVIDIA's driver bindings: pip install cuda-bindings, or unimem's CUDA extra "
                "from the checkout: pip install -e \".[cuda]\"")


def load_driver() -> Any:
    """``cuda.bindings.driver``; ``ImportError`` saying what to install."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ImportError(f"CUDA virtual memory needs cuda.bindings ({exc}); {INSTALL_HINT}") from None
    return driver


class DriverError(RuntimeError):
    """A driver call failed for another reason than memory."""

    def __init__(self, status: Any, call: str, name: str) -> None:
        self.status = status
        super().__init__(f"{call} failed: {name} ({int(status)})")


class CudaVMM:
    """Reserve, map, unmap and release device memory through ``driver``."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._initialized = False
        self._granularity: Dict[int, int] = {}
        self._ranges: Dict[int, AddressRanges] = {}
        self._handles: Dict[int, Dict[int, Any]] = {}     # device -> page address -> its cuMemCreate handle

    # -- the driver's answers ---------------------------------------------
    def _call(self, call: str, *args: Any) -> Any:
        """Call ``driver.<call>``: its value (None, one value, or a tuple);
        ``MemoryError`` for ``CUDA_ERROR_OUT_OF_MEMORY``, :class:`DriverError`
        for any other failure."""
        result = getattr(self.driver, call)(*args)
        status, values = result[0], result[1:]
        if status != self.driver.CUresult.CUDA_SUCCESS:
            if status == self.driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise MemoryError(f"CUDA out of memory ({call})")
            raise DriverError(status, call, self._error_name(status))
        return values[0] if len(values) == 1 else (values or None)

    def _error_name(self, status: Any) -> str:
        try:
            name = self.driver.cuGetErrorName(status)[1]
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            return "CUDA error"

    def _properties(self, device: int) -> Any:
        """Pinned memory on ``device``: what ``cuMemCreate`` is asked for."""
        d = self.driver
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    def unsupported_reason(self, device: int) -> str:
        """Why ``device`` cannot map virtual memory, or "" when it can.
        Initialises the driver on the first call."""
        d = self.driver
        try:
            if not self._initialized:
                self._call("cuInit", 0)
                self._initialized = True
            handle = self._call("cuDeviceGet", device)
            supported = self._call("cuDeviceGetAttribute",
                                   d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   handle)
        except Exception as exc:      # no driver library, no device: the same answer, with the cause
            return f"the CUDA driver cannot be used ({type(exc).__name__}: {exc})"
        if not supported:
            return f"GPU {device} does not support virtual memory management (cuMemMap)"
        return ""

    def granularity(self, device: int) -> int:
        """Bytes per mapped page on ``device``: 2 MiB, or the driver's
        recommended granularity where larger (both powers of two)."""
        known = self._granularity.get(device)
        if known is None:
            reason = self.unsupported_reason(device)
            if reason:
                raise RuntimeError(reason)
            recommended = self._call("cuMemGetAllocationGranularity", self._properties(device),
                                     self.driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
            known = max(PAGE_SIZE, int(recommended))
            self._granularity[device] = known
            self._ranges[device] = AddressRanges(known)
            self._handles[device] = {}
        return known

    def ranges(self, device: int) -> AddressRanges:
        """The record of ``device`` (its granularity is asked first)."""
        device = as_int(device, "device")
        self.granularity(device)
        return self._ranges[device]

    # -- the four operations --------------------------------------------------
    def reserve(self, size: Any, device: int) -> int:
        ranges = self.ranges(device)
        size = ranges.check_size(size)
        with ranges.lock:
            # aligned to the granularity, so that every page is mappable
            address = int(self._call("cuMemAddressReserve", size, ranges.granularity, 0, 0))
            ranges.record_reserve(address, size)
        return address

    def map(self, address: Any, size: Any, device: int) -> None:
        """One ``cuMemCreate`` + ``cuMemMap`` per page, then one
        ``cuMemSetAccess`` over the span; on any failure every page mapped
        so far is unmapped and released before the error is raised."""
        ranges = self.ranges(device)
        d = self.driver
        with ranges.lock:
            address, size = ranges.check_map(address, size)
            page = ranges.granularity
            prop = self._properties(device)
            done: List[Tuple[int, Any]] = []
            try:
                for at in range(address, address + size, page):
                    handle = self._call("cuMemCreate", page, prop, 0)
                    try:
                        self._call("cuMemMap", at, page, 0, handle, 0)
                    except BaseException:
                        self._call("cuMemRelease", handle)
                        raise
                    done.append((at, handle))
                access = d.CUmemAccessDesc()
                access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = device
                access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                self._call("cuMemSetAccess", address, size, [access], 1)
            except BaseException:
                self._undo(done, page)
                raise
            handles = self._handles[device]
            for at, handle in done:
                handles[at] = handle
            ranges.record_map(address, size)

    def _undo(self, done: List[Tuple[int, Any]], page: int) -> None:
        """Unmap and release pages mapped by a map that then failed."""
        for at, handle in reversed(done):
            self._call("cuMemUnmap", at, page)
            self._call("cuMemRelease", handle)

    def unmap(self, address: Any, size: Any, device: int) -> None:
        """``cuMemUnmap`` and ``cuMemRelease`` page by page. Should the
        driver fail midway, the record keeps the pages still mapped."""
        ranges = self.ranges(device)
        with ranges.lock:
            address, size = ranges.check_unmap(address, size)
            page = ranges.granularity
            handles = self._handles[device]
            for at in range(address, address + size, page):
                self._call("cuMemUnmap", at, page)
                ranges.record_unmap(at, page)     # unmapped, whatever follows
                self._call("cuMemRelease", handles.pop(at))

    def release(self, address: Any, size: Any, device: int) -> None:
        ranges = self.ranges(device)
        with ranges.lock:
            address, size = ranges.check_release(address, size)
            self._call("cuMemAddressFree", address, size)
            ranges.record_release(address)

    def handles_held(self, device: int) -> int:
        """How many physical allocations (pages) are mapped on ``device``."""
        return len(self._handles.get(device, {}))
