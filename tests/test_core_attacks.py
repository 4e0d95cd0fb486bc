"""What an adversarial tester found in the core (issue 12), one regression test each.

Each test names the item of the issue it reproduces; every one of them failed
on the code before the fix (hangs are run in a subprocess under a timeout).
"""
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from unimem import OutOfMemoryError, _core
from unimem.backends.base import Backend
from unimem.backends.pluggable import PluggableAllocator
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
GiB = 1 << 30


def run_python(code, timeout=60, env=None):
    """Run ``code`` in a fresh interpreter; a hang fails the test, not the suite."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung for {timeout} s:\n{expired.stdout}\n{expired.stderr}")


# --- item 3: an Allocation's block freed by address ----------------------------------
def test_the_block_of_an_allocation_cannot_be_freed_by_address():
    """free(allocation) went through __index__ and freed the block behind the
    handle's back; the handle's finalizer later freed the next owner's block."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    handle = a.allocate(4096)
    for by_address in (handle, int(handle)):
        with pytest.raises(ValueError, match="belongs to an unimem Allocation"):
            a.free(by_address)
    assert a.memory_stats()["allocation.all.current"] == 1
    ptr = handle.ptr
    handle.release()
    reused = a.malloc(4096)                       # the next owner gets the same block
    assert reused == ptr
    del handle
    gc.collect()
    assert a.owns(reused), "the old handle freed the next owner's block"
    a.free(reused)
    a._check_invariants()


def test_a_registry_refuses_to_free_an_allocation_by_address():
    registry = _core.DeviceRegistry("cpu", 1, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
    handle = registry.get(0).allocate(100)
    with pytest.raises(ValueError, match="belongs to an unimem Allocation"):
        registry.delete(handle.ptr)
    assert registry.get(0).owns(handle.ptr)


# --- item 4: a backend that hands out memory twice -----------------------------------
BASE = 0x10000000


class Repeating(Backend):
    """Hands out whatever address it is told to."""

    def __init__(self):
        self.next = [BASE, BASE, BASE + 4 * MiB, BASE - MiB]
        self.frees = []

    def malloc(self, size, device, stream):
        return self.next.pop(0)

    def free(self, ptr, size, device, stream):
        self.frees.append(ptr)


def test_memory_that_overlaps_a_live_segment_is_refused():
    a = _core.CachingAllocator(Repeating(), 0)
    first = a.malloc(512)                                  # a 2 MiB segment at BASE
    before = dict(a.memory_stats())
    with pytest.raises(RuntimeError, match="overlaps memory it already gave"):
        a.malloc(2 * MiB)                                   # the same address again
    assert dict(a.memory_stats()) == before
    second = a.malloc(2 * MiB)                              # 4 MiB above: no overlap, fine
    assert second == BASE + 4 * MiB
    with pytest.raises(RuntimeError, match="overlaps"):
        a.malloc(30 * MiB)                                  # a segment 1 MiB below the first, into it
    assert a.live_allocations().keys() == {first, second}
    a._check_invariants()


def test_memory_that_wraps_around_the_address_space_is_refused():
    a = _core.CachingAllocator(PluggableAllocator(lambda s, d, st: (1 << 64) - 4096, lambda *x: None), 0)
    with pytest.raises(RuntimeError, match="wraps around"):
        a.malloc(100)
    assert a.memory_reserved() == 0


# --- item 5: a double free from inside the backend's record_event --------------------
def test_a_free_reentered_from_record_event_is_refused_and_counts_stay_right():
    allocator_box = []

    class Reentrant(SimulatedBackend):
        def record_event(self, stream, device):
            allocator, ptr = allocator_box
            with pytest.raises(ValueError, match="already freed"):
                allocator.free(ptr)                   # as a finalizer would, mid-free
            return super().record_event(stream, device)

    backend = Reentrant()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 7)
    allocator_box[:] = [a, p]
    a.free(p)
    s = a.memory_stats()
    assert s["allocation.all.current"] == 0 and s["active.all.current"] == 1   # waits on stream 7
    backend.complete(7)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


def test_a_failed_event_recording_gives_back_the_events_already_recorded():
    """Item 15, in the core: the first stream's event leaked when the second failed."""
    released = []

    class SecondEventFails(SimulatedBackend):
        def record_event(self, stream, device):
            if stream == 9:
                raise RuntimeError("event failed")
            return super().record_event(stream, device)

        def release_event(self, event):
            released.append(event)

    a = _core.CachingAllocator(SecondEventFails(), 0)
    p = a.malloc(1000)
    a.record_stream(p, 8)
    a.record_stream(p, 9)
    with pytest.raises(RuntimeError, match="event failed"):
        a.free(p)
    assert len(released) == 1
    assert a.owns(p) and a.memory_stats()["allocation.all.current"] == 1
    a._check_invariants()


# --- item 9: Ctrl-C inside the history hook or an OOM observer ------------------------
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


def test_a_keyboard_interrupt_in_an_oom_observer_reaches_the_caller():
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 * MiB), 0)
    a.set_capacity(64 * MiB)

    def observer(*args):
        raise KeyboardInterrupt

    a.add_oom_observer(observer)
    with pytest.raises(KeyboardInterrupt):
        a.malloc(100 * MiB)
    assert a.memory_stats()["num_ooms"] == 1


# --- item 11: statistics that overflow ------------------------------------------------
def test_huge_blocks_from_a_backend_with_no_capacity_never_overflow_the_statistics():
    a = _core.CachingAllocator(SimulatedBackend(capacity=1 << 63), 0)   # no capacity told
    held = []
    for _ in range(40):
        try:
            held.append(a.malloc(_core.MAX_REQUEST_SIZE))
        except OutOfMemoryError:
            break
    s = a.memory_stats()
    assert 0 < s["reserved_bytes.all.current"] <= _core.MAX_RESERVED_SIZE
    assert all(v >= 0 for k, v in s.items() if k != "max_split_size")
    with pytest.raises(OutOfMemoryError):
        a.malloc(1 << 62)


# --- item 13: a stream handle that names no stream ------------------------------------
def test_record_stream_asks_the_backend_to_check_the_stream():
    class TwoStreams(SimulatedBackend):
        def check_stream(self, stream, device):
            if stream not in (0, 1):
                raise ValueError(f"no stream {stream}")

    a = _core.CachingAllocator(TwoStreams(), 0)
    p = a.malloc(100)
    with pytest.raises(ValueError, match="no stream 1000000"):
        a.record_stream(p, 1000000)
    a.free(p)                                          # still freeable
    assert a.memory_stats()["active.all.current"] == 0


# --- item 14: a pool per stream ever seen, found by a linear scan ---------------------
def test_pools_of_streams_without_memory_are_dropped_and_the_backend_told():
    released = []

    class Telling(SimulatedBackend):
        def release_stream(self, stream, device):
            released.append(stream)

    a = _core.CachingAllocator(Telling(), 0)
    a.free(a.malloc(4096))                             # the default stream (0)
    for stream in range(1, 2001):
        a.free(a.malloc(4096, stream))
    a.empty_cache()
    assert a._stream_count() == 1                      # the default stream's pools stay
    assert sorted(released) == list(range(1, 2001))
    a._check_invariants()
    p = a.malloc(4096, 5)                              # a dropped stream comes back fine
    a.free(p)
    a._check_invariants()


def test_a_failed_allocation_leaves_no_pool_behind_after_empty_cache():
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 * MiB), 0)
    a.set_capacity(64 * MiB)
    for stream in range(1, 50):
        with pytest.raises(OutOfMemoryError):
            a.malloc(100 * MiB, stream)
    a.empty_cache()
    assert a._stream_count() == 0


# --- item 18: integers that are not --------------------------------------------------
class FloatIndex:
    def __index__(self):
        return 4096.5


@pytest.mark.parametrize("call", [
    lambda a: a.malloc(FloatIndex()),
    lambda a: a.malloc(True),
    lambda a: a.malloc(100, FloatIndex()),
    lambda a: a.malloc(100, False),
    lambda a: a.set_memory_limit(FloatIndex()),
    lambda a: a.free(FloatIndex()),
])
def test_bools_and_index_methods_returning_floats_are_type_errors(call):
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    with pytest.raises(TypeError):
        call(a)
    assert a.memory_stats() == _core.CachingAllocator(SimulatedBackend(), 0).memory_stats()


def test_a_backend_returning_a_float_address_is_refused():
    a = _core.CachingAllocator(PluggableAllocator(lambda *x: 4096.5, lambda *x: None), 0)
    with pytest.raises(TypeError, match="as a positive int, got 4096.5"):
        a.malloc(100)
    assert a.memory_reserved() == 0


# --- item 19: more than 64 registries ------------------------------------------------
def test_more_registries_than_the_per_thread_table_holds_work():
    registries = [_core.DeviceRegistry(f"pool{i}", 2, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
                  for i in range(100)]
    for i, registry in enumerate(registries):
        registry.set_current_index(i % 2)
    assert [r.current_index() for r in registries] == [i % 2 for i in range(100)]
    seen = []
    thread = threading.Thread(target=lambda: seen.extend(r.current_index() for r in registries))
    thread.start()
    thread.join()
    assert seen == [0] * 100                           # the current device is per thread


# --- PyTorch parity of the error itself (issue 18) ------------------------------------
def test_out_of_memory_error_is_a_runtime_error_and_pickles_whole():
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 * MiB), 3)
    a.set_capacity(64 * MiB)
    with pytest.raises(RuntimeError) as caught:          # what PyTorch users write
        a.malloc(100 * MiB)
    error = caught.value
    assert isinstance(error, MemoryError) and isinstance(error, OutOfMemoryError)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is OutOfMemoryError and str(back) == str(error)
    assert (back.device, back.requested, back.capacity) == (3, 100 * MiB, 64 * MiB)


def test_out_of_memory_text_is_pytorchs():
    a = _core.CachingAllocator(SimulatedBackend(capacity=GiB), 0)
    a.set_capacity(GiB)
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 800000000\.00 GiB\. SIM 0 "):
        a.malloc(1024 * 1024 * 1024 * 800000000)
    with pytest.raises(OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        a.malloc(1024 * 1024 * 1024 * 8000000000)
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB\. SIM 0 has a total capacity of "
                                               r"1024\.00 MiB of which 1024\.00 MiB is free\. Of the allocated"):
        a.malloc(2 * GiB)
    pluggable = _core.CachingAllocator(PluggableAllocator(lambda *x: 0, lambda *x: None), 0)
    with pytest.raises(OutOfMemoryError) as caught:
        pluggable.malloc(100)
    assert "device device" not in str(caught.value) and "device 0 has an unknown capacity" in str(caught.value)


def test_the_snapshot_counts_requested_bytes_of_blocks_waiting_on_a_stream():
    """PyTorch's _check_memory_stat_consistency sums segment requested_size."""
    backend = SimulatedBackend()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 5)
    a.free(p)
    segments = a.snapshot()
    assert sum(s["requested_size"] for s in segments) == a.memory_stats()["requested_bytes.all.current"] == 1000
    backend.complete(5)
    a.process_events()
    assert sum(s["requested_size"] for s in a.snapshot()) == 0


# --- CuPy's pool policy and limit (issue 18) ------------------------------------------
def test_exact_segments_hold_no_more_than_asked():
    a = _core.CachingAllocator(SimulatedBackend(), 0, exact_segments=True)
    p = a.malloc(1024)
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 1024 and a.free_block_count() == 0
    a.free(p)
    assert a.free_block_count() == 1


def test_a_byte_limit_shrinks_the_segment_to_the_request_when_that_fits():
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    a.set_memory_limit(3072)
    p = a.malloc(2560)                                  # a 2 MiB segment would pass the limit
    assert a.memory_reserved() == 2560
    with pytest.raises(OutOfMemoryError, match="3.00 KiB allowed"):
        a.malloc(1024)
    a.free(p)
    b = _core.CachingAllocator(SimulatedBackend(), 0)
    b.set_memory_limit(10 * MiB)
    b.malloc(MiB + MiB // 2)                            # not a 20 MiB segment: 1.5 MiB
    assert b.memory_reserved() == MiB + MiB // 2


# --- items 6, 8, 10: hangs and forks (subprocesses) -----------------------------------
def test_shutdown_with_a_daemon_thread_inside_a_backend_call_does_not_hang():
    """Item 8: a daemon thread frozen at exit while holding the allocator
    lock; module-held Allocations are finalized at exit and must not wait."""
    result = run_python("""
        import threading, time
        from unimem import _core
        from unimem.backends.pluggable import PluggableAllocator
        from unimem.backends.simulated import SimulatedBackend
        device = SimulatedBackend()
        slow_now = threading.Event()
        inside = threading.Event()
        def malloc(size, d, s):
            if slow_now.is_set():
                inside.set()
                time.sleep(60)            # still in here when the interpreter exits
            return device.malloc(size, d, s)
        slow = _core.CachingAllocator(PluggableAllocator(malloc, device.free), 0)
        HELD = [slow.allocate(1000) for _ in range(10)]   # finalized at exit
        slow_now.set()
        threading.Thread(target=slow.malloc, args=(3 << 20,), daemon=True).start()
        inside.wait()
        print("exiting", flush=True)
    """, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout


def test_fork_while_another_thread_waits_on_stream_events_in_empty_cache():
    """Item 10: the child re-processed events the parent's thread had
    handled, and its invariants broke."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_python("""
        import os, threading, time
        from unimem import _core
        from unimem.backends.simulated import SimulatedBackend

        class SlowEvents(SimulatedBackend):
            def event_synchronize(self, event):
                time.sleep(0.05)
                super().event_synchronize(event)

        backend = SlowEvents()
        a = _core.CachingAllocator(backend, 0)
        failures = 0
        for round in range(20):
            ptrs = [a.malloc(4096) for _ in range(30)]
            for p in ptrs:
                a.record_stream(p, 3)
                a.free(p)
            t = threading.Thread(target=a.empty_cache)
            t.start()
            time.sleep(0.02 * (round % 5))
            pid = os.fork()
            if pid == 0:
                try:
                    a.empty_cache()
                    a._check_invariants()
                    s = a.memory_stats()
                    assert s["active.all.current"] == 0, s["active.all.current"]
                    os._exit(0)
                except BaseException as e:
                    print("child:", repr(e), flush=True)
                    os._exit(1)
            t.join()
            _, status = os.waitpid(pid, 0)
            failures += status != 0
            a._check_invariants()
        print("failures", failures)
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "failures 0" in result.stdout, result.stdout


def test_a_fork_while_another_thread_holds_an_allocator_lock_leaves_a_usable_child():
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_python("""
        import os, threading
        from unimem import _core
        from unimem.backends.simulated import SimulatedBackend
        a = _core.CachingAllocator(SimulatedBackend(), 0)
        registry = _core.DeviceRegistry("sim", 1, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
        stop = False
        def churn():
            while not stop:
                a.free(a.malloc(4096))
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads: t.start()
        bad = 0
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                a.free(a.malloc(8192)); a._check_invariants()
                registry.get(0).free(registry.get(0).malloc(10))
                os._exit(0)
            bad += os.waitpid(pid, 0)[1] != 0
        stop = True
        for t in threads: t.join()
        print("bad", bad)
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "bad 0" in result.stdout


def test_xpu_empty_cache_does_not_wait_on_the_queue_holding_the_lock():
    """Item 6: a dpctl keep-alive host task, queued before the barrier that
    empty_cache waits on, frees a pool array and needs the allocator lock."""
    result = run_python("""
        import unimem, dpctl
        xpu = unimem.xpu
        queue_b = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
        for round in range(20):
            x = xpu.empty(1 << 20, dtype="f4")
            xpu.record_stream(x, queue_b)
            y = xpu.empty(1 << 22, dtype="f4", sycl_queue=queue_b)
            z = y * 2 + 1         # dpnp's keep-alive host task on queue B holds y ...
            del y                 # ... and drops the last reference: a pool free
            del x                 # an event on queue B, after that work
            xpu.empty_cache()     # waits for it
            del z
        print("ok")
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok" in result.stdout
