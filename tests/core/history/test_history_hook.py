"""The history hook's errors: a KeyboardInterrupt raised in it reaches the
caller (and the block the caller never saw goes back to the pool); any
other error is reported (sys.unraisablehook), not raised, and the
allocation stands."""
import sys
import threading

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


# The hook runs on the thread whose operations made the events; a commit it
# returns runs in the order the batches were taken, by whichever thread finds
# it in turn. No thread waits for another's hook.

def two_thread_allocator():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    a.free(a.malloc(512))                   # a cached block: the other thread's hit
    return a


def test_a_batch_taken_later_is_committed_after_the_earlier_one_whose_hook_is_still_running():
    a = two_thread_allocator()
    history = []
    second_done = threading.Event()
    first_running = threading.Event()

    def hook(events):
        if threading.current_thread().name == "first" and not first_running.is_set():
            first_running.set()
            assert second_done.wait(5), "the second thread waited for the first one's hook"
        return lambda: history.append((threading.current_thread().name, [e[0] for e in events]))

    a.set_trace_hook(hook)

    def second():
        first_running.wait(5)
        a.free(a.malloc(4096))              # its own batches, prepared while the first hook runs
        second_done.set()

    threads = [threading.Thread(target=lambda: a.free(a.malloc(1 << 20)), name="first"),
               threading.Thread(target=second, name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert second_done.is_set() and not any(t.is_alive() for t in threads)
    # The first thread's malloc batch came first; the second thread's batches
    # were committed by the first thread, after it, in their order.
    actions = [action for _, batch in history for action in batch]
    assert actions[0] == "alloc" and history[0][0] == "first"
    assert history[1] == ("first", ["alloc"]) and history[2] == ("first", ["free_requested", "free_completed"])
    assert [action for _, batch in history[3:] for action in batch] == [
        "free_requested", "free_completed"]
    a._check_invariants()


def test_a_keyboard_interrupt_in_one_batch_does_not_hold_up_the_later_ones():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    committed = []

    def hook(events):
        if not committed:
            committed.append("interrupted")
            raise KeyboardInterrupt
        return lambda: committed.append([e[0] for e in events])

    a.set_trace_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        a.malloc(1000)
    p = a.malloc(1000)
    a.free(p)
    # the block the caller never saw went back (its free comes with the next
    # batch); the interrupted batch counts as committed
    assert committed == ["interrupted", ["free_requested", "free_completed", "alloc"],
                         ["free_requested", "free_completed"]]


def test_an_error_in_a_commit_is_reported_and_the_next_commit_runs():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    commits = []
    seen = []

    def hook(events):
        def commit():
            commits.append(events[-1][0])
            if events[-1][0] == "alloc":
                raise ValueError("a broken commit")
        return commit

    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(info.exc_value)
    try:
        a.set_trace_hook(hook)
        a.free(a.malloc(1000))
    finally:
        sys.unraisablehook = old_hook
    assert commits == ["alloc", "free_completed"]
    assert len(seen) == 1 and isinstance(seen[0], ValueError)


def test_a_hook_that_is_not_callable_is_refused_and_the_old_one_stays():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    got = []
    a.set_trace_hook(got.extend)
    with pytest.raises(TypeError, match="callable"):
        a.set_trace_hook(42)
    a.free(a.malloc(1000))
    assert [e[0] for e in got] == ["segment_alloc", "alloc", "free_requested", "free_completed"]
