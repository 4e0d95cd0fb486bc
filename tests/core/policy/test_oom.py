"""Out of memory through a user-supplied backend that refuses memory; the
observers of each OOM; the error itself, as PyTorch's (a RuntimeError that
pickles whole, its message word for word)."""
import pickle

import pytest

from unimem import OutOfMemoryError, _core
from unimem.backends.pluggable import PluggableAllocator
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
GiB = 1 << 30


class Refusing:
    """A device of ``capacity`` bytes that answers like a real driver."""

    def __init__(self, capacity, refuse_with="zero"):
        self.capacity, self.used, self.next = capacity, 0, 1 << 40
        self.refuse_with = refuse_with
        self.calls = []

    def malloc(self, size, device, stream):
        self.calls.append(("malloc", size))
        if self.used + size > self.capacity:
            if self.refuse_with == "raise":
                raise MemoryError("device is full")
            return 0
        self.used += size
        ptr, self.next = self.next, self.next + size
        return ptr

    def free(self, ptr, size, device, stream):
        self.calls.append(("free", size))
        self.used -= size


@pytest.mark.parametrize("refuse_with", ["zero", "raise"])
def test_retry_then_out_of_memory(refuse_with):
    device = Refusing(100 * MiB, refuse_with)
    a = _core.CachingAllocator(PluggableAllocator(device.malloc, device.free), 0)
    keep = a.malloc(50 * MiB)
    cached = a.malloc(30 * MiB)
    a.free(cached)                           # 30 MiB cached
    device.calls.clear()
    # 40 MiB fits only once the cache is released: one retry, no OOM
    got = a.malloc(40 * MiB)
    assert device.calls == [("malloc", 40 * MiB), ("free", 30 * MiB), ("malloc", 40 * MiB)]
    s = a.memory_stats()
    assert (s["num_alloc_retries"], s["num_ooms"], s["num_sync_all_streams"]) == (1, 0, 1)
    # 20 MiB can never fit: retry, then OutOfMemoryError, counted once
    device.calls.clear()
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(20 * MiB)
    assert device.calls == [("malloc", 20 * MiB), ("malloc", 20 * MiB)]
    s = a.memory_stats()
    assert (s["num_alloc_retries"], s["num_ooms"]) == (2, 1)
    assert s["allocated_bytes.all.current"] == 90 * MiB
    assert "unknown capacity" in str(info.value)      # no memory_info_fn was given
    a._check_invariants()
    a.free(keep)
    a.free(got)
    a.empty_cache()
    assert device.used == 0


def test_observers_see_each_oom():
    device = Refusing(10 * MiB)
    backend = PluggableAllocator(device.malloc, device.free,
                                 memory_info_fn=lambda d: (device.capacity - device.used, device.capacity))
    a = _core.CachingAllocator(backend, 0)
    seen = []
    a.add_oom_observer(lambda *args: seen.append(args))
    with pytest.raises(OutOfMemoryError, match="total capacity of 10.00 MiB"):
        a.malloc(12 * MiB)
    assert seen == [(0, 12 * MiB, 0, 0, 10 * MiB)]


def test_a_failing_observer_is_reported_and_does_not_hide_the_oom(monkeypatch):
    import sys
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reported.append(args.exc_type))
    device = Refusing(MiB)
    a = _core.CachingAllocator(PluggableAllocator(device.malloc, device.free), 0)
    a.add_oom_observer(lambda *args: 1 / 0)
    with pytest.raises(OutOfMemoryError):
        a.malloc(4 * MiB)
    assert reported == [ZeroDivisionError]


def test_beyond_the_largest_single_allocation_fails_at_once_keeping_the_cache():
    """SYCL devices cap one allocation (an OpenCL CPU device: half its memory).
    A request above the cap can never succeed: it is an OutOfMemoryError that
    says so, without releasing the cache or asking the device."""
    device = Refusing(8 << 30)
    a = _core.CachingAllocator(PluggableAllocator(device.malloc, device.free), 0)
    a.set_max_allocation_size(1 << 30)
    assert a.max_allocation_size == 1 << 30
    a.free(a.malloc(100 * MiB))                           # 100 MiB cached
    before = a.memory_stats()
    device.calls.clear()
    with pytest.raises(OutOfMemoryError, match="at most 1024.00 MiB in one allocation"):
        a.malloc((1 << 30) + 1)
    assert device.calls == []
    after = a.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert {k: v for k, v in after.items() if k != "num_ooms"} == \
        {k: v for k, v in before.items() if k != "num_ooms"}
    a.free(a.malloc(1 << 30))                             # the cap itself is allowed
    a.set_max_allocation_size(0)                          # 0: no limit known
    a.free(a.malloc(2 << 30))
    a.empty_cache()
    assert device.used == 0


def test_a_request_larger_than_the_device_keeps_the_cache():
    """A documented difference from PyTorch (docs/guide/differences.md, "Differences from PyTorch
    and CuPy"): a request no release can make fit fails at once, without
    releasing the cache or counting a retry; one that may fit once the cache
    is released does release it, and counts the retry, as PyTorch's."""
    device = Refusing(64 * MiB)
    a = _core.CachingAllocator(PluggableAllocator(device.malloc, device.free), 0)
    a.set_capacity(device.capacity)                 # as new_allocator tells it the device's
    a.free(a.malloc(30 * MiB))                      # a cached 30 MiB segment
    before = a.memory_stats()
    for huge in (800_000_000 << 30, 65 * MiB):
        with pytest.raises(OutOfMemoryError):
            a.malloc(huge)
    after = a.memory_stats()
    assert after["num_ooms"] == 2 and after.get("num_alloc_retries", 0) == 0
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] == 30 * MiB
    p = a.malloc(40 * MiB)                          # fits the device once the cache is let go
    after = a.memory_stats()
    assert after["num_alloc_retries"] == 1 and after["reserved_bytes.all.current"] == 40 * MiB
    a.free(p)
    a._check_invariants()


def test_a_keyboard_interrupt_in_an_oom_observer_reaches_the_caller():
    a = _core.CachingAllocator(SimulatedBackend(capacity=64 * MiB), 0)
    a.set_capacity(64 * MiB)

    def observer(*args):
        raise KeyboardInterrupt

    a.add_oom_observer(observer)
    with pytest.raises(KeyboardInterrupt):
        a.malloc(100 * MiB)
    assert a.memory_stats()["num_ooms"] == 1


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
