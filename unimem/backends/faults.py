"""A backend that fails on purpose: for tests, and for debugging a backend.

:class:`FaultInjectingBackend` wraps any backend and, on request, refuses
allocations (as a full device does), fails frees (as a broken driver does), or
answers slowly. The caching core must cope: retry after releasing its cache,
raise ``OutOfMemoryError`` only then, keep a segment it could not give back,
and never lose or double-hand a block::

    backend = FaultInjectingBackend(SimulatedBackend(), refuse_malloc={3, 4})
    unimem.change_current_allocator(backend)      # or CachingAllocator(backend)
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Union

from .base import Backend, forward_to_inner

CallRule = Union[None, Iterable[int], Callable[..., bool]]


class InjectedFault(RuntimeError):
    """The error a failing free raises (unless another one is given)."""


def _rule(rule: CallRule) -> Callable[..., bool]:
    if rule is None:
        return lambda *args: False
    if callable(rule):
        return rule
    calls = frozenset(rule)
    return lambda number, *args: number in calls


@forward_to_inner(intercepted={"malloc", "free", "map_pages", "_raw_api", "_raw_owner"})
class FaultInjectingBackend(Backend):
    """Wrap ``inner`` and fail some of its calls.

    Args:
        inner: the backend that does the real work.
        refuse_malloc: which malloc calls run out of memory: call numbers
            (1-based, counting every call) or ``f(number, size) -> bool``.
        refuse_map: which map_pages calls (expandable segments) run out of
            memory: numbers or ``f(number, address, size) -> bool``.
        fail_free: which free calls fail: numbers or ``f(number, ptr, size) -> bool``.
        malloc_delay, free_delay: seconds every call waits first.
        free_error: the exception a failing free raises (InjectedFault by default).

    :meth:`refuse_next` and :meth:`fail_frees_of` change the plan on the way.
    ``malloc_calls``, ``map_calls``, ``free_calls``, ``refused`` and
    ``failed_frees`` count.

    Every other capability of :class:`Backend` is ``inner``'s (an absent one
    stays absent), but its C entry points (``_raw_api``): the core then calls
    :meth:`malloc` and :meth:`free` here, where the faults are injected.
    """

    def __init__(self, inner: Backend, *, refuse_malloc: CallRule = None, refuse_map: CallRule = None,
                 fail_free: CallRule = None,
                 malloc_delay: float = 0.0, free_delay: float = 0.0,
                 free_error: Optional[BaseException] = None) -> None:
        self.inner = inner
        self._refuse = _rule(refuse_malloc)
        self._refuse_map = _rule(refuse_map)
        self._fail = _rule(fail_free)
        self.malloc_delay = malloc_delay
        self.free_delay = free_delay
        self.free_error = free_error
        self._lock = threading.Lock()
        self._refuse_next = 0
        self._unfreeable: set = set()
        self.malloc_calls = self.map_calls = self.free_calls = self.refused = self.failed_frees = 0

    def refuse_next(self, count: int = 1) -> None:
        """Refuse the next ``count`` device allocations (malloc or map_pages
        calls), whatever the plan says."""
        with self._lock:
            self._refuse_next += count

    def fail_frees_of(self, addresses: Iterable[int]) -> None:
        """Fail every free of these addresses (until :meth:`allow_frees`)."""
        with self._lock:
            self._unfreeable |= set(addresses)

    def allow_frees(self) -> None:
        with self._lock:
            self._unfreeable.clear()

    def malloc(self, size: int, device: int, stream: int) -> int:
        if self.malloc_delay:
            time.sleep(self.malloc_delay)
        if self._refuses("malloc_calls", self._refuse, size):
            return 0
        return self.inner.malloc(size, device, stream)

    def _refuses(self, counter: str, rule: Callable[..., bool], *args: int) -> bool:
        """Count a device allocation in ``counter`` and say whether it is
        refused: by :meth:`refuse_next` first, then by ``rule``."""
        with self._lock:
            number = getattr(self, counter) + 1
            setattr(self, counter, number)
            refuse = self._refuse_next > 0
            if refuse:
                self._refuse_next -= 1
        if refuse or rule(number, *args):
            with self._lock:
                self.refused += 1
            return True
        return False

    def map_pages(self, address: int, size: int, device: int) -> None:
        """The inner backend's map_pages, or a MemoryError (the device is
        full, nothing mapped) where the plan says so."""
        if self.malloc_delay:
            time.sleep(self.malloc_delay)
        if self._refuses("map_calls", self._refuse_map, address, size):
            raise MemoryError(f"injected: no memory to map {size} bytes at {address:#x}")
        self.inner.map_pages(address, size, device)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        if self.free_delay:
            time.sleep(self.free_delay)
        with self._lock:
            self.free_calls += 1
            number = self.free_calls
            fail = ptr in self._unfreeable
        if fail or self._fail(number, ptr, size):
            with self._lock:
                self.failed_frees += 1
            raise self.free_error if self.free_error is not None else InjectedFault(
                f"injected failure freeing {ptr:#x} ({size} bytes)")
        self.inner.free(ptr, size, device, stream)

    def __repr__(self) -> str:
        return f"<FaultInjectingBackend over {self.inner!r}>"
