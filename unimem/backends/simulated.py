"""A simulated device: an address space with a capacity and no memory behind it.

For tests and trace replays: the caching core runs exactly as on a real
device, but a terabyte-sized workload costs nothing. Addresses never overlap
(each device gets its own range), and the backend checks every free against
what it handed out, so a core that frees twice or the wrong size is caught.

Streams are simulated too: an event recorded on a stream stays pending until
the test says the stream's work is done (:meth:`SimulatedBackend.complete`)
or someone waits for it (:meth:`event_synchronize`, or :meth:`synchronize`
for the whole device), as work on a real GPU queue would.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Set, Tuple

from .base import Backend

GiB = 1 << 30


class SimulatedEvent:
    """A point in a simulated stream's queue."""

    __slots__ = ("stream", "device", "sequence")

    def __init__(self, stream: int, device: int, sequence: int) -> None:
        self.stream = stream
        self.device = device
        self.sequence = sequence

    def __repr__(self) -> str:
        return f"<SimulatedEvent stream={self.stream} #{self.sequence}>"


class SimulatedBackend(Backend):
    """Simulated device memory.

    Args:
        capacity: bytes each device holds (segments and mapped pages together).
        devices: how many devices.
        name: what the device is called in messages.
        alignment: every address is a multiple of this.
        granularity: the virtual-memory page (a power of two): address
            ranges are reserved and pages mapped by it, as CUDA's
            ``cuMemAddressReserve``/``cuMemMap`` do (2 MiB there). 0: the
            device has no virtual memory (expandable segments refused).

    Virtual memory is tracked exactly: reserved ranges and the pages mapped
    in them. A misaligned call, a span outside a reserved range, mapping a
    mapped page, unmapping an unmapped one or releasing a range with pages
    mapped raises RuntimeError (a core bug, caught); mapping past the
    capacity raises MemoryError with nothing mapped.
    """

    def __init__(self, capacity: int = 16 * GiB, devices: int = 1, name: str = "SIM",
                 alignment: int = 512, granularity: int = 2 << 20) -> None:
        if capacity <= 0 or devices <= 0 or alignment <= 0:
            raise ValueError("capacity, devices and alignment must be positive")
        if granularity < 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two or 0, got {granularity}")
        self.granularity = int(granularity)
        # per device: range base -> size; mapped page addresses
        self.ranges: List[Dict[int, int]] = [dict() for _ in range(devices)]
        self.mapped_pages: List[Set[int]] = [set() for _ in range(devices)]
        self.n_map = self.n_unmap = 0
        self.name = name
        self.capacity = int(capacity)
        self.devices = int(devices)
        self.alignment = int(alignment)
        self._lock = threading.Lock()
        self._next: List[int] = [self._base(d) for d in range(self.devices)]
        self.live: List[Dict[int, int]] = [dict() for _ in range(self.devices)]
        self.used: List[int] = [0] * self.devices
        self.n_malloc = 0
        self.n_free = 0
        # stream -> (sequence recorded so far, sequence completed so far)
        self._recorded: Dict[Tuple[int, int], int] = {}
        self._completed: Dict[Tuple[int, int], int] = {}

    @staticmethod
    def _base(device: int) -> int:
        # Disjoint, recognisable ranges: device d lives at (d + 1) * 2**44.
        return (device + 1) << 44

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise ValueError(f"simulated device {device} does not exist ({self.devices} devices)")

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        self._check_device(device)
        with self._lock:
            if self.used[device] + size > self.capacity:
                return 0
            ptr = self._next[device]
            step = -(-size // self.alignment) * self.alignment
            self._next[device] = ptr + step
            self.live[device][ptr] = size
            self.used[device] += size
            self.n_malloc += 1
            return ptr

    def free(self, ptr: int, size: int, device: int = 0, stream: int = 0) -> None:
        self._check_device(device)
        with self._lock:
            held = self.live[device].pop(ptr, None)
            if held is None:
                raise RuntimeError(f"simulated device {device}: free of {ptr:#x}, which is not allocated")
            if held != size:
                self.live[device][ptr] = held
                raise RuntimeError(f"simulated device {device}: free of {ptr:#x} with size {size}, "
                                   f"allocated with {held}")
            self.used[device] -= size
            self.n_free += 1

    def device_count(self) -> int:
        return self.devices

    def memory_info(self, device: int = 0) -> Tuple[int, int]:
        self._check_device(device)
        return self.capacity - self.used[device], self.capacity

    def held(self, device: int = 0) -> int:
        """Bytes currently allocated from the simulated device."""
        return self.used[device]

    # virtual memory (expandable segments) ---------------------------------
    def virtual_memory_granularity(self, device: int) -> int:
        self._check_device(device)
        return self.granularity

    def _pages(self, address: int, size: int, device: int) -> range:
        """The pages of ``[address, address+size)``, checked to lie inside
        one reserved range and on page boundaries."""
        self._check_device(device)
        g = self.granularity
        if not g:
            raise RuntimeError(f"simulated device {device} has no virtual memory")
        if size <= 0 or address % g or size % g:
            raise RuntimeError(f"simulated device {device}: span {address:#x}+{size} is not "
                               f"aligned to the granularity ({g})")
        for base, length in self.ranges[device].items():
            if base <= address and address + size <= base + length:
                return range(address, address + size, g)
        raise RuntimeError(f"simulated device {device}: span {address:#x}+{size} is not inside a reserved range")

    def reserve_address_range(self, size: int, device: int) -> int:
        self._check_device(device)
        g = self.granularity
        if not g or size <= 0 or size % g:
            raise RuntimeError(f"simulated device {device}: cannot reserve {size} bytes "
                               f"(granularity {g})")
        with self._lock:
            base = -(-self._next[device] // g) * g
            self._next[device] = base + size
            self.ranges[device][base] = size
            return base

    def map_pages(self, address: int, size: int, device: int) -> None:
        with self._lock:
            pages = self._pages(address, size, device)
            if any(p in self.mapped_pages[device] for p in pages):
                raise RuntimeError(f"simulated device {device}: {address:#x}+{size} is already mapped")
            if self.used[device] + size > self.capacity:
                raise MemoryError(f"simulated device {device} is full")
            self.mapped_pages[device].update(pages)
            self.used[device] += size
            self.n_map += 1

    def unmap_pages(self, address: int, size: int, device: int) -> None:
        with self._lock:
            pages = self._pages(address, size, device)
            if not all(p in self.mapped_pages[device] for p in pages):
                raise RuntimeError(f"simulated device {device}: {address:#x}+{size} is not all mapped")
            self.mapped_pages[device].difference_update(pages)
            self.used[device] -= size
            self.n_unmap += 1

    def release_address_range(self, address: int, size: int, device: int) -> None:
        self._check_device(device)
        with self._lock:
            if self.ranges[device].get(address) != size:
                raise RuntimeError(f"simulated device {device}: {address:#x}+{size} is not a reserved range")
            if any(address <= p < address + size for p in self.mapped_pages[device]):
                raise RuntimeError(f"simulated device {device}: range {address:#x} still has pages mapped")
            del self.ranges[device][address]

    def reserved(self, device: int = 0) -> int:
        """Bytes of address space currently reserved on the simulated device."""
        return sum(self.ranges[device].values())

    # streams -------------------------------------------------------------
    def record_event(self, stream: int, device: int) -> SimulatedEvent:
        with self._lock:
            key = (device, stream)
            seq = self._recorded.get(key, 0) + 1
            self._recorded[key] = seq
            return SimulatedEvent(stream, device, seq)

    def event_done(self, event: SimulatedEvent) -> bool:
        return self._completed.get((event.device, event.stream), 0) >= event.sequence

    def event_synchronize(self, event: SimulatedEvent) -> None:
        key = (event.device, event.stream)
        with self._lock:
            if self._completed.get(key, 0) < event.sequence:
                self._completed[key] = event.sequence

    def synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device``: every stream completes."""
        self._check_device(device)
        with self._lock:
            for dev, stream in list(self._recorded):
                if dev == device:
                    self._completed[(dev, stream)] = self._recorded[(dev, stream)]

    def complete(self, stream: int, device: int = 0) -> None:
        """Declare all work queued so far on ``stream`` finished."""
        key = (device, stream)
        with self._lock:
            self._completed[key] = self._recorded.get(key, 0)

    def __repr__(self) -> str:
        return f"<SimulatedBackend {self.name} {self.devices}x{self.capacity} bytes>"


class SimulatedGPU(SimulatedBackend):
    """A :class:`SimulatedBackend` whose queued work uses memory, as kernels
    on a GPU do, for the paths that must not wait for the device.

    :meth:`launch` queues work on a stream that uses a span until the stream
    completes (:meth:`complete`, an :meth:`event_synchronize` after it, or
    :meth:`synchronize`). As on CUDA, where ``cuMemUnmap`` does not wait for
    kernels still using the memory, :meth:`unmap_pages` waits for the whole
    device first (counted in :attr:`device_waits`), and
    :meth:`unmap_idle_pages` does not: it refuses (RuntimeError, a core bug)
    a span that queued work still uses.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_waits = 0
        # (device, stream) -> [(sequence, address, size)] of the work queued there
        self._work: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}

    def launch(self, stream: int, address: int, size: int, device: int = 0) -> None:
        """Queue work on ``stream`` that uses ``[address, address+size)``."""
        self._check_device(device)
        key = (device, stream)
        with self._lock:
            seq = self._recorded.get(key, 0) + 1
            self._recorded[key] = seq
            self._work.setdefault(key, []).append((seq, address, size))

    def record_event(self, stream: int, device: int) -> SimulatedEvent:
        """An event after the work queued on ``stream``: complete at once
        when none is pending, as on a GPU."""
        key = (device, stream)
        with self._lock:
            done = self._completed.get(key, 0)
            if self._recorded.get(key, 0) == done:
                return SimulatedEvent(stream, device, done)
        return super().record_event(stream, device)

    def busy(self, address: int, size: int, device: int = 0) -> bool:
        """Whether work not yet completed uses some of ``[address, address+size)``."""
        for (dev, stream), work in self._work.items():
            done = self._completed.get((dev, stream), 0)
            if dev == device and any(seq > done and at < address + size and address < at + n
                                     for seq, at, n in work):
                return True
        return False

    def unmap_pages(self, address: int, size: int, device: int) -> None:
        """Wait for the device, then unmap (CUDABackend.unmap_pages)."""
        self.device_waits += 1
        self.synchronize(device)
        super().unmap_pages(address, size, device)

    def unmap_idle_pages(self, address: int, size: int, device: int) -> None:  # type: ignore[override]
        if self.busy(address, size, device):
            raise RuntimeError(f"simulated device {device}: {address:#x}+{size} is unmapped while "
                               f"queued work still uses it")
        super().unmap_pages(address, size, device)

    def __repr__(self) -> str:
        return f"<SimulatedGPU {self.name} {self.devices}x{self.capacity} bytes>"

