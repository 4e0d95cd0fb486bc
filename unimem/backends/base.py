"""The raw-memory backend interface: what the caching core asks of a provider.

A backend hands out and takes back whole segments of device memory. It knows
nothing of caching or statistics (the core does that); it only allocates,
frees, reports capacity, and - for devices with asynchronous queues - records
and queries events so that memory used on a stream is not reused too early.

Contract for ``malloc``: return the address of at least ``size`` bytes as a
positive ``int``; signal "the device is full" by returning 0 or raising
``MemoryError`` (the core then releases its cache and retries); any other
exception is a real error and propagates to the caller unchanged.
"""
from __future__ import annotations

from typing import Any, Tuple


class Backend:
    """Base class with the defaults of a backend without asynchronous work.

    Subclasses implement :meth:`malloc` and :meth:`free`, and usually
    :meth:`memory_info` and :meth:`device_count`.
    """

    #: What the device is called in messages and summaries ("CPU", "XPU", "GPU").
    name: str = "device"
    #: Whether the host can read and write the memory directly (debug mode
    #: fills and checks free memory only then).
    host_accessible: bool = False
    #: Whether memory and handles stay valid in a child after ``os.fork()``
    #: (GPU runtimes do not survive a fork).
    survives_fork: bool = True

    def malloc(self, size: int, device: int, stream: int) -> int:
        raise NotImplementedError

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        raise NotImplementedError

    def device_count(self) -> int:
        return 1

    def memory_info(self, device: int) -> Tuple[int, int]:
        """``(free, total)`` bytes of the device."""
        raise NotImplementedError(f"the {self.name} backend does not report its memory")

    def max_allocation_size(self, device: int) -> int:
        """The largest single allocation the device allows (0: no limit known)."""
        return 0

    #: What PyTorch calls the device's runtime in messages ("CUDA", "XPU");
    #: None: :attr:`name` is used.
    api_name = None

    # Streams and their events. Without asynchronous work, memory is reusable at once.
    def check_stream(self, stream: int, device: int) -> None:
        """Raise ``ValueError`` if ``stream`` names no stream of ``device``
        (called by ``record_stream``, so that a bad handle is refused there and
        not at the free, which could then never happen)."""

    def release_stream(self, stream: int, device: int) -> None:
        """The allocator keeps nothing for ``stream`` any more (no segment, no
        pending event): the backend may let go of what it holds for it."""

    def release_event(self, event: Any) -> None:
        """Give back an event the allocator recorded but will not wait for
        (recording a later one failed)."""

    def record_event(self, stream: int, device: int) -> Any:
        """Mark the current end of the work queued on ``stream``."""
        return None

    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` has completed (never blocks)."""
        return True

    def event_synchronize(self, event: Any) -> None:
        """Block until the work before ``event`` has completed."""

    def synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device`` (``torch.accelerator.synchronize``)."""
