"""Interpreter exit while a daemon thread is inside an allocator, its lock
held: the Allocations finalized at exit must not wait for that lock forever.
In a subprocess under a timeout: a hang fails the test, not the suite."""
from tests.helpers.fresh import run_within_timeout


def test_shutdown_with_a_daemon_thread_inside_a_backend_call_does_not_hang():
    """A daemon thread frozen at exit while holding the allocator lock
    (inside a Python backend's malloc); Allocations held by a module are
    finalized at exit and waited for the lock forever.

    The Allocations live in a module of ``sys.modules`` that ``__main__``
    refers to: at shutdown Python clears the dicts of the modules still
    alive, and so finalizes them. (``__main__``'s own dict would never be
    cleared here: the daemon thread's frame holds it through its function's
    globals.) ``LastOut``, first in the list, is finalized after them (a list
    lets go of its items last to first): its line proves the finalizers ran.
    """
    result = run_within_timeout("""
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
