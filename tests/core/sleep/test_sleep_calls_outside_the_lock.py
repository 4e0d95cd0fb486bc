"""sleep() and wake_up() make every call out with the core's lock let go
(_core_sleep.pxi): the copies of the live bytes, release_pages and
restore_pages. While a pool sleeps or wakes, another thread is served from
the device's cache, and a pool's memory being backed again counts against
the memory limit until its call returns."""
import ctypes
import threading
import time

import pytest

from unimem import _core

from tests.helpers.pool_allocators import PageAllocator, in_pool

MiB = 1 << 20
GiB = 1 << 30
POOL = (0, 1)


def allocator_with_a_pool_block(host_accessible):
    """The device's own memory is a PageAllocator's; a small block cached on
    the device (outside the pool), and a live 3 MiB block of the pool,
    its bytes a pattern."""
    backend = PageAllocator(host_accessible=host_accessible)
    a = _core.CachingAllocator(backend, 0)
    a.set_capacity(8 * GiB)
    a.free(a.malloc(512))
    a.create_pool(POOL)
    p = in_pool(a, POOL, 3 * MiB)
    ctypes.memset(p, 0x5A, 3 * MiB)
    return a, backend, p


@pytest.mark.parametrize("call, host_accessible", [
    ("copy_to_host", False),
    ("release", True),
    ("restore", True),
    ("copy_from_host", False),
])
def test_a_cache_hit_on_another_thread_is_served_while_a_pool_sleeps_or_wakes(call, host_accessible):
    a, backend, p = allocator_with_a_pool_block(host_accessible)
    served = []

    def hook(name):
        if name == call and not served:
            t = threading.Thread(target=lambda: a.free(a.malloc(512)))
            t.start()
            t.join(5.0)
            served.append(not t.is_alive())

    backend.hook = hook
    a.sleep_pool(POOL, offload=True)
    a.wake_up_pool(POOL)
    assert served == [True]
    assert ctypes.string_at(p, 3 * MiB) == b"\x5a" * (3 * MiB)
    a.free(p)
    a._check_invariants()


def test_memory_a_pools_wake_backs_again_counts_against_the_limit_while_its_call_runs():
    """While the pool's 20 MiB segment is restored, another thread's miss
    asks for 5 MiB more under a 24 MiB limit (2 MiB are the device's): with
    the restore's bytes counted meanwhile it is refused, as it would be
    after the wake (even with the device's free segment given back), and
    the wake and the miss never pass the limit together."""
    a, backend, p = allocator_with_a_pool_block(True)
    a.sleep_pool(POOL, offload=True)
    assert a.memory_reserved() == 2 * MiB
    a.set_memory_limit(24 * MiB)
    outcome = []

    def miss():
        try:
            outcome.append(a.malloc(5 * MiB))
        except _core.OutOfMemoryError as exc:
            outcome.append(exc)

    other = threading.Thread(target=miss)

    def hook(name):
        if name == "restore" and not other.is_alive() and not outcome:
            other.start()
            time.sleep(0.2)             # the miss, had the bytes not counted, took them meanwhile

    backend.hook = hook
    a.wake_up_pool(POOL)
    other.join(5.0)
    assert len(outcome) == 1 and isinstance(outcome[0], _core.OutOfMemoryError), outcome
    assert a.memory_reserved() <= 24 * MiB
    assert ctypes.string_at(p, 3 * MiB) == b"\x5a" * (3 * MiB)
    a.free(p)
    a._check_invariants()


def test_a_wake_up_on_another_thread_waits_for_the_sleep_under_way():
    """A second thread's wake_up() while sleep() gives memory back waits
    for it (with the lock let go) and then wakes the device: neither call
    is refused, and the device ends awake."""
    backend = PageAllocator()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(3 * MiB)
    reserved = a.memory_reserved()
    errors = []

    def wake():
        try:
            a.wake_up()
        except Exception as exc:
            errors.append(exc)

    waker = threading.Thread(target=wake)

    def hook(name):
        if name == "release" and not waker.is_alive():
            waker.start()
            waker.join(0.2)
            assert waker.is_alive()     # waiting for the sleep to end

    backend.hook = hook
    a.sleep(offload=True)
    waker.join(5.0)
    assert errors == [] and not waker.is_alive()
    assert not a.is_sleeping() and a.memory_reserved() == reserved
    a.free(p)
    a._check_invariants()


def test_sleep_re_entered_from_its_own_backend_call_is_refused():
    backend = PageAllocator()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(3 * MiB)
    refused = []

    def hook(name):
        if name == "release" and not refused:
            with pytest.raises(RuntimeError, match="already under way") as error:
                a.wake_up()
            refused.append(error.value)

    backend.hook = hook
    a.sleep()
    assert len(refused) == 1 and a.is_sleeping()
    a.wake_up()
    a.free(p)
    a._check_invariants()
