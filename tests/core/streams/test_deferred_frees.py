"""A block used on other streams (record_stream), freed on a runtime's thread
without the GIL (c_free_detached, as dpctl's keep-alive host tasks do):
recording its events submits work, which such a thread must not do, so the
free is kept and done from Python's side (_free_deferred in
_core_streams.pxi). The SYCL case itself: tests/front/test_xpu_deferred_frees.py."""
import sys

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend


def allocator():
    backend = SimulatedBackend()
    return backend, _core.CachingAllocator(backend, 0)


def test_a_kept_free_is_done_at_the_next_allocation_and_by_process_events():
    backend, a = allocator()
    p = a.malloc(4096)
    a.record_stream(p, 7)
    a._free_as_runtime_thread(p)
    assert a.owns(p) and a.memory_allocated() == 4096        # kept: no event recorded yet
    q = a.malloc(100)                                       # the free is done first
    assert not a.owns(p) and a.memory_allocated() == 512
    a.free(q)
    r = a.malloc(4096)
    assert r != p                                           # p waits for stream 7's event
    backend.complete(7)
    a.free(r)
    p2 = a.malloc(4096)
    a.record_stream(p2, 7)
    a._free_as_runtime_thread(p2)
    a.process_events()
    assert not a.owns(p2) and a.memory_allocated() == 0
    a._check_invariants()


def test_a_free_without_stream_uses_is_done_at_once():
    _, a = allocator()
    p = a.malloc(4096)
    a._free_as_runtime_thread(p)
    assert not a.owns(p) and a.memory_allocated() == 0
    a._check_invariants()


def test_an_event_that_cannot_be_recorded_keeps_the_block_for_the_next_call():
    backend, a = allocator()
    p = a.malloc(4096)
    a.record_stream(p, 7)
    a._free_as_runtime_thread(p)
    record = backend.record_event
    backend.record_event = lambda stream, device: (_ for _ in ()).throw(RuntimeError("no event"))
    reports = []
    hook, sys.unraisablehook = sys.unraisablehook, reports.append
    try:
        a.process_events()
    finally:
        sys.unraisablehook = hook
    assert [str(r.exc_value) for r in reports] == ["no event"]
    assert a.owns(p) and a.memory_allocated() == 4096
    backend.record_event = record
    a.process_events()
    assert not a.owns(p)
    a._check_invariants()


def test_a_ctrl_c_in_the_history_hook_after_a_kept_free_keeps_nothing_freed():
    """The hook ran after the block went back; a Ctrl-C in it put the freed
    address back among the kept ones, and once another thread had that
    address, the next call freed the new owner's live block."""
    backend, a = allocator()
    p = a.malloc(4096)
    a.record_stream(p, 7)
    a._free_as_runtime_thread(p)
    state = {"armed": True, "q": None}

    def hook(events):
        if state["armed"]:
            state["armed"] = False
            backend.complete(7)              # what another thread may do meanwhile
            a.process_events()
            state["q"] = a.malloc(4096)      # p handed out again
            raise KeyboardInterrupt

    a.set_trace_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        a.process_events()
    a.set_trace_hook(None)
    q = state["q"]
    assert q == p and a.owns(q)
    a.process_events()
    assert a.owns(q) and a.memory_allocated() == 4096
    a.free(q)
    a._check_invariants()


def test_an_allocation_re_entered_from_an_event_query_frees_no_block_twice():
    """A record_stream free waits for its event; a finalizer that allocates
    inside the query (process_events) used to run a nested pass that freed
    the block, then the outer pass freed it again (two free-index entries)."""
    from tests.helpers.stream_events import AllocatesInAQuery
    from unimem import _core

    MiB = 1 << 20
    gpu = AllocatesInAQuery(capacity=256 * MiB)
    a = _core.CachingAllocator(gpu, 0)
    used, keep = a.malloc(4 * MiB), a.malloc(4 * MiB)
    gpu.launch(1, used, 4 * MiB)                        # a kernel on stream 1 uses it
    a.record_stream(used, 1)
    a.free(used)                                        # its event waits for that kernel
    gpu.complete(1)
    gpu.hook = lambda: a.malloc(1 * MiB, 2)
    a.process_events()
    a._check_invariants()
    assert a.malloc(4 * MiB) == used
    assert a.malloc(4 * MiB) != used                    # not handed out twice
    a._check_invariants()

