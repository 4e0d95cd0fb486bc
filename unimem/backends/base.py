"""The raw-memory backend interface: what the caching core asks of a provider.

A backend hands out and takes back whole segments of device memory. It knows
nothing of caching or statistics (the core does that); it only allocates,
frees, reports capacity, and - for devices with asynchronous queues - records
and queries events so that memory used on a stream is not reused too early.

Contract for ``malloc``: return the address of at least ``size`` bytes as a
positive ``int``; signal "the device is full" by returning 0 or raising
``MemoryError`` (the core then releases its cache and retries); any other
exception is a real error and propagates to the caller unchanged.

:class:`Backend` is a :class:`typing.Protocol`: only ``malloc`` and ``free``
are required. Every other member is an optional capability: the core and the
runtime look it up on the backend and, where it is absent, behave as the
default written here says. Subclassing :class:`Backend` inherits those
defaults. A backend that wraps another (``self.inner``) uses
:func:`forward_to_inner`, so that it forwards every capability declared here,
including those added later.
"""
from __future__ import annotations

from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Protocol, Tuple, TypeVar, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """A source of raw memory, with the defaults of a backend without
    asynchronous work.

    Subclasses implement :meth:`malloc` and :meth:`free`, and usually
    :meth:`memory_info` and :meth:`device_count`.
    """

    #: What the device is called in messages and summaries ("CPU", "XPU",
    #: "GPU"). Read by the core when an allocator is made; absent: the class name.
    name: str = "device"
    #: What PyTorch calls the device's runtime in out-of-memory messages
    #: ("CUDA", "XPU"). Read by the core; absent or None: :attr:`name` is used.
    api_name: Optional[str] = None
    #: Whether the host can read and write the memory directly. Read by the
    #: observability layer when an allocator is made (debug mode fills and
    #: checks free memory only then); absent: False.
    host_accessible: bool = False
    #: Whether memory and handles stay valid in a child after ``os.fork()``.
    #: Read by the fork handler in the child (allocators of a backend that
    #: does not survive refuse to work there); absent: True. GPU runtimes do not.
    survives_fork: bool = True
    #: A ``PyCapsule`` holding the C functions of the provider ABI
    #: (``unimem/_native/provider.pxd``): read by the core when an allocator is
    #: made, which then allocates and frees through C on a miss instead of
    #: calling :meth:`malloc` and :meth:`free`. Absent or None: the Python methods.
    _raw_api: Any = None
    #: The object that keeps the capsule's C context alive; the core holds it
    #: as long as the allocator. Absent: the backend itself (so no default here).
    _raw_owner: Any

    # -- raw memory (required) -------------------------------------------
    def malloc(self, size: int, device: int, stream: int) -> int:
        """Return the address of at least ``size`` bytes on ``device``, or 0
        when the device is full. Called by the core on a cache miss, without
        its lock (for the device's own pools): other threads' calls, this
        method's among them, go on meanwhile, so it must be thread-safe, as
        :meth:`free` must."""
        raise NotImplementedError

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        """Give back a segment :meth:`malloc` returned. Called by the core
        when it releases cached memory (``empty_cache``, an out-of-memory retry)."""
        raise NotImplementedError

    # -- capacity ---------------------------------------------------------
    def device_count(self) -> int:
        """How many devices the backend serves. Called by the runtime when a
        device type or pool is set up; absent: 1."""
        return 1

    def memory_info(self, device: int) -> Tuple[int, int]:
        """``(free, total)`` bytes of the device. Called when an allocator is
        made (its capacity), by ``mem_get_info`` and for out-of-memory
        messages; absent or raising ``NotImplementedError``: not known."""
        raise NotImplementedError(f"the {self.name} backend does not report its memory")

    def max_allocation_size(self, device: int) -> int:
        """The largest single allocation the device allows. Called by the
        runtime when an allocator is made; absent or 0: no limit known."""
        return 0

    # -- streams and their events -----------------------------------------
    # Without asynchronous work, memory is reusable at once: the defaults.
    def check_stream(self, stream: int, device: int) -> None:
        """Raise ``ValueError`` if ``stream`` names no stream of ``device``.
        Called by ``record_stream`` before the record, so that a bad handle
        is refused there and not at the free, which could then never happen;
        a backend may begin holding what it keeps for the stream here, until
        :meth:`release_stream`. Called without the allocator's lock, and
        again for a stream that is still in use after a release told at the
        same time (so it must be idempotent, and must not wait); absent:
        every handle is taken."""

    def release_stream(self, stream: int, device: int) -> None:
        """The allocator keeps nothing for ``stream`` any more (no segment, no
        pending event): the backend may let go of what it holds for it.
        Called without the allocator's lock; a stream named again while its
        release is told is named once more (:meth:`check_stream`) after it,
        so that what the backend holds ends as the allocator's table says.
        It must not wait: let go in :meth:`sweep_released_streams`; absent:
        nothing to do."""

    def abandoned_streams(self, streams: List[int], device: int) -> List[int]:
        """Of ``streams`` (those the allocator keeps cached memory for), the
        ones nobody can allocate on any more and whose work is done: their
        free segments are given back. Called by the core, without its lock,
        once per new stream it sees (must not wait); absent: none."""
        return []

    def sweep_released_streams(self) -> None:
        """Let go of what was held for the streams released so far. Called by
        the core after its lock, following one or more ``release_stream``;
        absent: nothing to do."""

    def record_event(self, stream: int, device: int) -> Any:
        """Mark the current end of the work queued on ``stream``. Called by
        the core when a block used on other streams (``record_stream``) is
        freed; absent: None (no asynchronous work). An event's life ends at
        the first of :meth:`event_done` answering True,
        :meth:`event_synchronize` or :meth:`release_event`: the core never
        passes it again, so the backend may free it there (CUDA's does)."""
        return None

    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` has completed (never blocks).
        Called by the core before reusing a block; absent: True."""
        return True

    def event_synchronize(self, event: Any) -> None:
        """Block until the work before ``event`` has completed. Called by the
        core when it must have the memory (``empty_cache``, an out-of-memory
        retry); absent: nothing to wait for."""

    def release_event(self, event: Any) -> None:
        """Give back an event the allocator recorded but will not wait for
        (recording a later one failed). Called by the core; absent: nothing to do."""

    def synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device`` (``torch.accelerator.synchronize``).
        Called by the front; absent: nothing to wait for."""

    # -- virtual memory (expandable segments) -------------------------------
    # Used by ``expandable_segments:True`` only, called by the core on a miss
    # and by ``empty_cache``/``empty_virt_addr_cache`` (with the GIL, never
    # through the provider ABI), without its lock: calls about different spans
    # and ranges, on several threads, may run at once, so they must be
    # thread-safe. A backend offers all of them or none: the core reads the
    # granularity first and calls the rest only when it is not 0.
    def virtual_memory_granularity(self, device: int) -> int:
        """Bytes by which memory is mapped and unmapped in a reserved range
        (a power of two); 0 when the backend cannot reserve address space and
        map memory into it (default). Called when an allocator is made with
        ``expandable_segments:True``, which a backend answering 0 refuses. A
        backend that knows why it cannot (no such aspect on this device) may
        raise ``NotImplementedError`` saying so instead: the refusal quotes it."""
        return 0

    def reserve_address_range(self, size: int, device: int) -> int:
        """Reserve ``size`` bytes of address space (a multiple of the
        granularity) with no memory behind it; return its address. Raise
        ``MemoryError`` when no address space is left."""
        raise NotImplementedError

    def map_pages(self, address: int, size: int, device: int) -> None:
        """Back ``[address, address+size)`` (granularity-aligned, inside a
        reserved range, unmapped) with memory, readable and writable. Raise
        ``MemoryError`` when the device is full; nothing stays mapped then."""
        raise NotImplementedError

    def unmap_pages(self, address: int, size: int, device: int) -> None:
        """Give back the memory behind a mapped, granularity-aligned span;
        the addresses stay reserved. Work still queued that uses the span
        must not fault: wait for it where unmapping does not (CUDA)."""
        raise NotImplementedError

    #: ``unmap_idle_pages(address, size, device)``: as :meth:`unmap_pages`,
    #: for a span no queued work uses any more, without waiting for the
    #: device. Called by the core (with ``max_reserved_ratio``) once an event
    #: recorded on the span's stream after its last use has completed, so
    #: that an allocation that unmaps a hole waits for no kernel. Absent or
    #: None: :meth:`unmap_pages` is called at once, and may wait.
    unmap_idle_pages: Optional[Callable[[int, int, int], None]] = None

    def release_address_range(self, address: int, size: int, device: int) -> None:
        """Give back a range from :meth:`reserve_address_range` that has no
        page mapped."""
        raise NotImplementedError

    # -- sleep mode -----------------------------------------------------------
    # Used by ``sleep()``/``wake_up()`` (with the GIL and the allocator's lock,
    # never through the provider ABI). With expandable segments the allocator
    # sleeps through the virtual memory calls above; otherwise it needs the
    # three below. The copies are asked for with ``offload=True`` only, and
    # only of a backend whose memory the host cannot read (``host_accessible``
    # False): the core copies host-readable memory itself.
    def page_release_unavailable_reason(self, device: int) -> str:
        """Why the memory of a segment from :meth:`malloc` cannot be given
        back while its addresses stay reserved; "" when it can (then
        :meth:`release_pages` and :meth:`restore_pages` work). Called by
        ``sleep()`` without expandable segments, which quotes the reason in
        its ``NotImplementedError``. Default: it cannot."""
        return "it cannot give a segment's memory back and keep its addresses"

    def release_pages(self, address: int, size: int, device: int) -> None:
        """Give back the memory of a whole segment from :meth:`malloc`
        (``address`` and ``size`` as malloc had them), keeping its addresses
        reserved: nothing else may be placed there, and :meth:`free` still
        takes the segment back. Raise only with the memory left as it was."""
        raise NotImplementedError(self.page_release_unavailable_reason(device))

    def restore_pages(self, address: int, size: int, device: int) -> None:
        """Back a segment :meth:`release_pages` gave back with memory again,
        at the same addresses, readable and writable (contents undefined).
        Raise ``MemoryError`` when the device is full; the segment then stays
        as it was."""
        raise NotImplementedError(self.page_release_unavailable_reason(device))

    def copy_to_host(self, host_address: int, address: int, size: int, device: int) -> None:
        """Copy ``size`` bytes of device memory at ``address`` to host memory
        at ``host_address`` (``sleep(offload=True)``), once the copy is done.
        Default: cannot (``NotImplementedError``; ``sleep`` then says to use
        ``offload=False``)."""
        raise NotImplementedError(f"the {self.name} backend cannot copy its memory to the host")

    def copy_from_host(self, address: int, host_address: int, size: int, device: int) -> None:
        """Copy ``size`` bytes of host memory at ``host_address`` to device
        memory at ``address`` (``wake_up()`` after an offload), once the copy is done."""
        raise NotImplementedError(f"the {self.name} backend cannot copy host memory to the device")

    # -- what the runtime and the front ask of some backends ---------------
    #: The device count the user gave (``PluggableAllocator(device_count=...)``),
    #: kept by ``change_current_allocator`` over the replaced backend's; absent
    #: or None: the replaced backend's count.
    explicit_device_count: Optional[int] = None
    #: Where pinned memory comes from, for ``unimem.host.backend_name()``
    #: ("cuda", "sycl"); absent: "page-aligned".
    pinning: str = "page-aligned"
    #: ``pinned_host_backend()``: a backend of pinned host memory for
    #: ``unimem.host``, from this device's runtime. Called by ``unimem.host``
    #: when the pinned pool is first used; absent (no default here): plain
    #: page-aligned memory.
    pinned_host_backend: Callable[[], "Backend"]


# Names typing.Protocol puts in the class body for itself.
_PROTOCOL_MACHINERY = frozenset({"_is_protocol", "_is_runtime_protocol", "_abc_impl"})


def backend_members() -> FrozenSet[str]:
    """Every member :class:`Backend` declares: required and optional."""
    names = set(Backend.__annotations__) | set(vars(Backend))
    return frozenset(n for n in names if not n.startswith("__") and n not in _PROTOCOL_MACHINERY)


#: What every backend has; everything else in :func:`backend_members` is optional.
REQUIRED_MEMBERS = frozenset({"malloc", "free"})

WrapperClass = TypeVar("WrapperClass", bound=type)


def forward_to_inner(intercepted: Iterable[str]) -> Callable[[WrapperClass], WrapperClass]:
    """A class decorator for a backend wrapping another, ``self.inner``.

    Every member of :class:`Backend` that the wrapper does not name in
    ``intercepted`` is read from ``self.inner`` at each access, so the
    wrapper has a capability exactly when the inner backend has it (an absent
    one stays absent, and the core then uses its default). A capability added
    to :class:`Backend` is forwarded without touching the wrapper.
    ``intercepted`` must list what the wrapper defines itself (or withholds:
    a wrapper that intercepts ``malloc`` must withhold ``_raw_api``, through
    which the core would bypass it)."""
    intercepted = frozenset(intercepted)
    unknown = intercepted - backend_members()
    if unknown:
        raise ValueError(f"not members of Backend: {sorted(unknown)}")

    def forwarded(name: str) -> property:
        def read(self: Any) -> Any:
            return getattr(self.inner, name)
        return property(read, doc=f"The inner backend's ``{name}``.")

    def decorate(cls: WrapperClass) -> WrapperClass:
        for name in backend_members() - intercepted:
            setattr(cls, name, forwarded(name))
        cls.__forwarded_members__ = backend_members() - intercepted
        cls.__intercepted_members__ = intercepted
        return cls
    return decorate
