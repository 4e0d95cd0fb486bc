"""fork() while other threads are inside an allocator (_core_fork.pxi): the
child gets every allocator in a consistent state and usable, whether the
other thread waits on stream events in empty_cache, holds the lock half-way
through processing events, or holds it past the time fork() waits. Each in a
subprocess under a timeout: a hang fails the test, not the suite."""
import os

import pytest

from tests.helpers.fresh import run_within_timeout


def test_fork_while_another_thread_waits_on_stream_events_in_empty_cache():
    """fork() while another thread is in empty_cache(), waiting for the
    second of two stream events. The old code freed each block as its
    event completed but updated the pending list only at the end, all under
    the lock: the child took the first event (already handled) for pending,
    handled it again, and left a block in the free index with a count of -1
    outstanding events. Blocks live between the freed ones keep them from
    merging, so that the damage stays visible to _check_invariants."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_within_timeout("""
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
    result = run_within_timeout("""
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
    result = run_within_timeout("""
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
