"""What a caching allocator serves: a :class:`Pool`, not a string.

Every allocator made by :func:`unimem._runtime.devices.new_allocator` belongs
to one pool: a device type's own pools (``cpu``, ``xpu``, ``cuda``), the
pinned host pool (``unimem.host``), the SYCL shared USM pools, or the pools of
one ``unimem.cuda.MemoryPool(allocator=...)``. A pool knows which device type
its device indices count (``device_type``), what users read it as (``name``,
``display_name``) and where its allocators live (``registry()``).

The strings a user sees (a Prometheus ``device`` label, the ``pool`` of a
snapshot's ``allocator_settings``, the device of an out-of-memory observer)
are derived from these fields, never parsed back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:       # annotations only: the registry imports the core, a compiled module
    from .registry import DeviceRegistry

DEVICE_TYPES = ("cuda", "xpu", "cpu")


class PoolKind(enum.Enum):
    """What kind of memory a pool serves."""

    #: A device type's own pools: one allocator per device of ``cpu``, ``xpu`` or ``cuda``.
    DEVICE = "device"
    #: SYCL shared USM pools of ``unimem.xpu``, one per XPU device.
    SHARED_USM = "shared USM"
    #: The pinned (page-locked) host pool, ``unimem.host``: one allocator.
    PINNED_HOST = "pinned host"
    #: The pools of one CuPy-compatible ``unimem.cuda.MemoryPool(allocator=...)``
    #: (or ``backend=...``), with CuPy's segment policy.
    CUPY_POOL = "CuPy-compatible pool"


@dataclass(frozen=True)
class Pool:
    """A pool of caching allocators, one per device index.

    Two pools are equal when they have the same kind, device type and name
    (the history of ``unimem.cpu`` survives ``change_current_allocator``);
    ``registry`` and ``existing_registry`` do not take part.
    """

    kind: PoolKind
    #: The device type the pool's device indices count ("cpu", "xpu", "cuda").
    device_type: str
    #: How snapshots, metrics and messages name it: "xpu", "host", "xpu-shared", "cuda-pool".
    name: str
    #: How summaries and messages call its memory, as PyTorch does: "GPU", "XPU", "CPU", "host".
    display_name: str
    #: The pool's registry (a ``DeviceRegistry``), created if needed.
    registry: Callable[[], "DeviceRegistry"] = field(compare=False, repr=False)
    #: The pool's registry if it exists already, else None (nothing is created).
    existing_registry: Callable[[], Optional["DeviceRegistry"]] = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"unknown device type {self.device_type!r} (known: {', '.join(DEVICE_TYPES)})")

    def label(self, index: int) -> str:
        """The pool's device ``index`` as metrics name it: ``xpu:0``,
        ``xpu-shared:1``; the pinned host pool, which has one device, is ``host``."""
        return self.name if self.kind is PoolKind.PINNED_HOST else f"{self.name}:{index}"

    def fork_message(self) -> str:
        """Why the pool's memory cannot be used in a forked child."""
        return (f"unimem: the {self.name} memory of the parent process cannot be used after os.fork(): its "
                f"device runtime does not survive a fork. To use it with multiprocessing, use the "
                f"'spawn' start method (as PyTorch requires for CUDA).")


_named_pools: List[Pool] = []


def register_named_pool(pool: Pool) -> Pool:
    """Make ``pool`` one of the process-wide pools :func:`named_pools` lists
    (those that metrics report); returns it."""
    if pool not in _named_pools:
        _named_pools.append(pool)
    return pool


def named_pools() -> List[Pool]:
    """The process-wide pools registered so far: device types' pools first
    (``cuda``, ``xpu``, ``cpu``), then the shared USM pools, then the pinned
    host pool (the order of :class:`PoolKind`). A ``unimem.cuda.MemoryPool`` is the user's object, not listed."""
    order = list(PoolKind)
    return sorted(_named_pools, key=lambda p: (order.index(p.kind), DEVICE_TYPES.index(p.device_type)))
