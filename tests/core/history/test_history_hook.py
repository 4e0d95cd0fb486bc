"""The history hook's errors: a KeyboardInterrupt raised in it reaches the
caller (and the block the caller never saw goes back to the pool); any
other error is reported (sys.unraisablehook), not raised, and the
allocation stands."""
import sys

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend


def test_a_keyboard_interrupt_in_the_history_hook_reaches_the_caller():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    calls = []

    def hook(events):
        calls.append(events)
        if len(calls) == 1:
            raise KeyboardInterrupt

    a.set_trace_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        a.malloc(1000)
    # The block the caller never saw went back to the pool.
    assert a.memory_stats()["allocation.all.current"] == 0
    a._check_invariants()
    p = a.malloc(1000)
    a.free(p)


def test_an_ordinary_error_in_the_history_hook_is_reported_not_raised():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    seen = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(info.exc_value)
    try:
        a.set_trace_hook(lambda events: 1 / 0)
        p = a.malloc(1000)
    finally:
        sys.unraisablehook = old_hook
    assert a.owns(p) and isinstance(seen[0], ZeroDivisionError)
