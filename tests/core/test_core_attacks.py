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
from unimem._runtime.registry import DeviceRegistry
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
    registry = DeviceRegistry("cpu", 1, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
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
    registries = [DeviceRegistry(f"pool{i}", 2, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
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
    lock (inside a Python backend's malloc); Allocations held by a module are
    finalized at exit and waited for the lock forever.

    The Allocations live in a module of ``sys.modules`` that ``__main__``
    refers to: at shutdown Python clears the dicts of the modules still
    alive, and so finalizes them. (``__main__``'s own dict would never be
    cleared here: the daemon thread's frame holds it through its function's
    globals.) ``LastOut``, first in the list, is finalized after them (a list
    lets go of its items last to first): its line proves the finalizers ran.
    """
    result = run_python("""
        import os, sys, threading, time, types
        from unimem import _core
        from unimem.backends.pluggable import PluggableAllocator
        from unimem.backends.simulated import SimulatedBackend
        device = SimulatedBackend()
        slow_now = threading.Event()
        inside = threading.Event()
        def malloc(size, d, s):
            if slow_now.is_set():
                inside.set()
                time.sleep(60)            # still in here, lock held, when the interpreter exits
            return device.malloc(size, d, s)
        class LastOut:
            def __del__(self, write=os.write):
                write(1, b"all finalized\\n")
        slow = _core.CachingAllocator(PluggableAllocator(malloc, device.free), 0)
        holder = types.ModuleType("unimem_test_holder")
        sys.modules[holder.__name__] = holder
        holder.HELD = [LastOut()] + [slow.allocate(1000) for _ in range(10)]   # finalized at exit
        slow_now.set()
        threading.Thread(target=slow.malloc, args=(3 << 20,), daemon=True).start()
        inside.wait()
        print("exiting", flush=True)
    """, timeout=20)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
    assert "all finalized" in result.stdout, "the held Allocations were not finalized at exit: the test tests nothing"


def test_fork_while_another_thread_waits_on_stream_events_in_empty_cache():
    """Item 10: fork() while another thread is in empty_cache(), waiting for
    the second of two stream events. The old code freed each block as its
    event completed but updated the pending list only at the end, all under
    the lock: the child took the first event (already handled) for pending,
    handled it again, and left a block in the free index with a count of -1
    outstanding events. Blocks live between the freed ones keep them from
    merging, so that the damage stays visible to _check_invariants."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_python("""
        import os, threading
        from unimem import _core
        from unimem.backends.simulated import SimulatedBackend

        parent = os.getpid()
        second_wait, gate = threading.Event(), threading.Event()

        class GatedEvents(SimulatedBackend):
            calls = 0
            def event_synchronize(self, event):
                super().event_synchronize(event)
                if os.getpid() == parent:
                    self.calls += 1
                    if self.calls == 2:           # the first event is waited for
                        second_wait.set()
                        gate.wait()

        a = _core.CachingAllocator(GatedEvents(), 0)
        ptrs = [a.malloc(4096) for _ in range(4)]
        for p in ptrs[0::2]:                      # live blocks between them: no merging
            a.record_stream(p, 3)
            a.free(p)
        t = threading.Thread(target=a.empty_cache)
        t.start()
        second_wait.wait()
        pid = os.fork()
        if pid == 0:
            try:
                a.empty_cache()
                a._check_invariants()
                assert a.memory_stats()["active.all.current"] == 2
                for p in ptrs[1::2]:
                    a.free(p)
                a.empty_cache()
                a._check_invariants()
                assert a.memory_reserved() == 0, a.memory_reserved()
            except BaseException as e:
                print("child:", repr(e), flush=True)
                os._exit(1)
            os._exit(0)
        gate.set()
        t.join()
        _, status = os.waitpid(pid, 0)
        a._check_invariants()
        print("child exit", os.waitstatus_to_exitcode(status))
    """, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "child exit 0" in result.stdout, result.stdout


def test_a_fork_while_another_thread_holds_an_allocator_lock_leaves_a_usable_child():
    """fork() while one thread holds an allocator's lock half-way through an
    update (processing stream events at the start of a malloc, inside the
    backend's ``event_done``) and another holds a registry's creation lock
    (inside the factory). The old code only reset the allocator locks in
    the child: the child found the first event, already handled, still
    pending, handled it again and broke the free index; and its first
    ``registry.get`` of the device being created hung. Now fork() takes the
    allocator locks first (their holders get to finish) and the child gets a
    fresh creation lock.

    The holders wait on ``gate``, which a fork handler (run before the
    core's, which takes the locks) opens: the situation of a holder that
    is merely slow, made deterministic."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_python("""
        import os, signal, threading
        from unimem import _core
        from unimem._runtime.registry import DeviceRegistry
        from unimem.backends.simulated import SimulatedBackend

        parent = os.getpid()
        in_query, in_factory, gate = threading.Event(), threading.Event(), threading.Event()

        class GatedQueries(SimulatedBackend):
            calls = 0
            def event_done(self, event):
                done = super().event_done(event)
                if os.getpid() == parent:
                    self.calls += 1
                    if self.calls == 2:           # the first block is back in the pool
                        in_query.set()
                        gate.wait()
                return done

        def make(index):
            if index == 1 and os.getpid() == parent:
                in_factory.set()
                gate.wait()
            return _core.CachingAllocator(SimulatedBackend(devices=2), index)

        backend = GatedQueries()
        a = _core.CachingAllocator(backend, 0)
        registry = DeviceRegistry("sim", 2, make)
        ptrs = [a.malloc(4096) for _ in range(4)]
        for p in ptrs[0::2]:                      # live blocks between them: no merging
            a.record_stream(p, 3)
            a.free(p)
        backend.complete(3)
        threads = [threading.Thread(target=a.malloc, args=(4096,)),   # processes the events first
                   threading.Thread(target=registry.get, args=(1,))]
        for t in threads:
            t.start()
        in_query.wait()
        in_factory.wait()
        os.register_at_fork(before=gate.set)
        pid = os.fork()
        if pid == 0:
            failed = False
            try:
                a.process_events()
                a._check_invariants()
                a.free(a.malloc(8192))
                a._check_invariants()
            except BaseException as e:
                print("child, allocator:", repr(e), flush=True)
                failed = True
            signal.alarm(10)                      # a lock left taken: SIGALRM ends the child
            registry.get(1).free(registry.get(1).malloc(10))
            os._exit(failed)
        for t in threads:
            t.join()
        _, status = os.waitpid(pid, 0)
        a._check_invariants()
        print("child exit", os.waitstatus_to_exitcode(status))
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "child exit 0" in result.stdout, result.stdout + " (-14: the child hung on the registry's lock)"


def test_a_fork_while_a_slow_event_query_holds_the_lock_past_the_wait_leaves_a_consistent_child():
    """The same fork, but the holder stays inside ``event_done`` past the
    0.2 s fork() waits for the lock: the child then resets the lock, and
    must not find an event handled but still pending (process_events asks
    about every event before it touches a block)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_python("""
        import os, threading
        from unimem import _core
        from unimem.backends.simulated import SimulatedBackend

        parent = os.getpid()
        in_query, gate = threading.Event(), threading.Event()

        class GatedQueries(SimulatedBackend):
            calls = 0
            def event_done(self, event):
                done = super().event_done(event)
                if os.getpid() == parent:
                    self.calls += 1
                    if self.calls == 2:
                        in_query.set()
                        gate.wait()
                return done

        backend = GatedQueries()
        a = _core.CachingAllocator(backend, 0)
        ptrs = [a.malloc(4096) for _ in range(4)]
        for p in ptrs[0::2]:
            a.record_stream(p, 3)
            a.free(p)
        backend.complete(3)
        thread = threading.Thread(target=a.malloc, args=(4096,))
        thread.start()
        in_query.wait()
        pid = os.fork()                           # the gate is still closed
        if pid == 0:
            try:
                a.process_events()
                a._check_invariants()
                a.free(a.malloc(8192))
                os._exit(0)
            except BaseException as e:
                print("child:", repr(e), flush=True)
                os._exit(1)
        gate.set()
        thread.join()
        _, status = os.waitpid(pid, 0)
        a._check_invariants()
        print("child exit", os.waitstatus_to_exitcode(status))
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "child exit 0" in result.stdout, result.stdout


def test_xpu_empty_cache_does_not_wait_on_the_queue_holding_the_lock():
    """Item 6: a dpctl keep-alive host task, queued before the barrier that
    empty_cache waits on, frees a pool array and needs the allocator lock.

    Kernels queued on queue B keep it busy for a while; then a kernel reads
    pool array ``y`` and dpctl's host task that keeps ``y`` alive until that
    kernel is done holds its last reference. ``x``, used on queue B, is freed
    with an event on B after all of it, and empty_cache waits for that
    event: the host task runs meanwhile and frees ``y``. The old code waited
    with the pool's lock held, and hung. ``before == 2`` says that ``y`` was
    still live when empty_cache was called (the scenario happened)."""
    pytest.importorskip("dpnp")
    result = run_python("""
        import unimem, dpctl
        import dpnp.tensor as dpt
        xpu = unimem.xpu
        queue_b = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
        work = dpt.ones(1 << 24, dtype="f4", sycl_queue=queue_b)
        dpt.sin(work); queue_b.wait()                  # the kernels are built
        caught = 0
        for round in range(3):
            x = xpu.empty(1 << 20, dtype="f4")
            xpu.record_stream(x, queue_b)
            y = xpu.empty(1 << 20, dtype="f4", sycl_queue=queue_b)
            busy = [dpt.sin(work) for _ in range(3)]   # queue B is busy for a while
            z = dpt.sin(y.get_array())  # after them; a keep-alive host task holds y's memory ...
            del y                       # ... and so the last reference: a pool free from its thread
            del x                       # an event on queue B, after all of that
            before = xpu.memory_stats()["active.all.current"]
            xpu.empty_cache()           # waits for it
            after = xpu.memory_stats()["active.all.current"]
            assert after == 0, after
            caught += before == 2
            del z, busy
        print("caught", caught)
    """, timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "caught 0" not in result.stdout and "caught" in result.stdout, result.stdout


def test_a_second_init_is_refused_and_leaves_the_allocator_working():
    """``__init__`` called again on a live allocator used to reset its
    statistics and replace its address table while segments and blocks
    existed (leaking the table and losing every live block)."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    with pytest.raises(RuntimeError, match="already initialized"):
        a.__init__(SimulatedBackend(), 0)
    assert a.memory_stats() == before
    assert a.owns(p)
    a.free(p)
    a._check_invariants()


def test_record_stream_of_an_address_not_handed_out_is_torchs_invalid_pointer_error():
    """A plain ValueError, where freeing the same address raises
    InvalidPointerError (PyTorch: RuntimeError, "No allocated block can be found")."""
    a = _core.CachingAllocator(SimulatedBackend(), 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    for bad in (p + 512, p + (1 << 30)):
        with pytest.raises(_core.InvalidPointerError, match="not a live allocation"):
            a.record_stream(bad, 7)
    assert a.memory_stats() == before
    a.free(p)


@pytest.mark.parametrize("ratio", [float("inf"), float("nan"), 0.5, -1.0])
def test_the_core_refuses_the_max_reserved_ratios_the_configuration_refuses(ratio):
    """The core took inf, which UNIMEM_ALLOC_CONF refuses: one rule in both places."""
    with pytest.raises(ValueError, match="max_reserved_ratio"):
        _core.CachingAllocator(SimulatedBackend(), 0, max_reserved_ratio=ratio)
