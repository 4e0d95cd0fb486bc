"""Faults: a device that refuses memory and fails frees, against the model.

After every step the core gave the same answer as the model (the same
address, the same OutOfMemoryError, the same failure to give memory back),
every statistic equals the model's, live blocks do not overlap, and the
device holds exactly the core's segments: nothing lost, nothing handed out
twice. At the end, with frees allowed again, everything goes back.
"""
import threading
import time

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tests.helpers.model import ModelAllocator, ModelFreeFailure, ModelOOM
from unimem import OutOfMemoryError, _core
from unimem.backends.faults import FaultInjectingBackend, InjectedFault
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
CAPACITY = 256 * MiB

sizes = st.one_of(st.integers(1, 4096), st.integers(1, 2 * MiB), st.integers(2 * MiB, 40 * MiB),
                  st.integers(100 * MiB, 260 * MiB))


def outcome(call):
    try:
        return ("ok", call())
    except (OutOfMemoryError, ModelOOM):
        return ("oom", None)
    except (InjectedFault, ModelFreeFailure):
        return ("free failed", None)


class FaultsMatchModel(RuleBasedStateMachine):
    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.device = SimulatedBackend(capacity=CAPACITY)
        self.backend = FaultInjectingBackend(self.device)
        self.core = _core.CachingAllocator(self.backend, 0)
        self.core.set_capacity(CAPACITY)
        self.model = ModelAllocator(CAPACITY)
        self.live = {}

    @rule(target=blocks, size=sizes)
    def malloc(self, size):
        expected = outcome(lambda: self.model.malloc(size))
        got = outcome(lambda: self.core.malloc(size))
        assert got == expected, f"malloc({size}): core {got}, model {expected}"
        if got[0] == "ok":
            self.live[got[1]] = self.core.round_size(size)
            return got[1]
        return None

    @rule(ptr=consumes(blocks))
    def free(self, ptr):
        if ptr is not None:
            self.core.free(ptr)
            self.model.free(ptr)
            del self.live[ptr]

    @rule()
    def empty_cache(self):
        assert outcome(self.core.empty_cache)[0] == outcome(self.model.empty_cache)[0]

    @rule(count=st.integers(1, 3))
    def device_refuses_next_mallocs(self, count):
        self.backend.refuse_next(count)
        self.model.refuse_next += count

    @rule(data=st.data())
    def device_will_not_take_a_segment_back(self, data):
        segments = sorted(s["address"] for s in self.core.snapshot())
        if segments:
            base = data.draw(st.sampled_from(segments))
            self.backend.fail_frees_of([base])
            self.model.unfreeable.add(base)

    @rule()
    def device_takes_memory_back_again(self):
        self.backend.allow_frees()
        self.model.unfreeable.clear()

    @invariant()
    def statistics_match(self):
        assert dict(self.core.memory_stats()) == self.model.memory_stats()

    @invariant()
    def nothing_lost_nothing_handed_out_twice(self):
        segments = {s["address"]: s["total_size"] for s in self.core.snapshot()}
        on_device = dict(self.device.live[0])
        lost = {base: on_device.pop(base) for base in self.model.lost}
        assert segments == on_device, "the device holds other memory than the core's segments"
        assert self.core.lost_segments() == {"count": len(lost), "bytes": sum(lost.values())}
        assert not set(lost) & set(segments), "a segment whose free failed was cached again"
        spans = sorted(self.live.items())
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b
        self.core._check_invariants()

    def teardown(self):
        self.backend.allow_frees()
        for ptr in list(self.live):
            self.core.free(ptr)
        self.core.empty_cache()
        lost_bytes = self.core.lost_segments()["bytes"]
        assert self.device.held() == lost_bytes and self.core.memory_reserved() == 0


FaultsMatchModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestFaultsMatchModel = FaultsMatchModel.TestCase


def test_out_of_memory_only_after_the_cache_was_released():
    device = SimulatedBackend(capacity=100 * MiB)
    backend = FaultInjectingBackend(device)
    a = _core.CachingAllocator(backend, 0)
    a.free(a.malloc(5 * MiB))                   # a 20 MiB segment cached
    backend.refuse_next(2)                      # the first try and the retry both fail
    with pytest.raises(OutOfMemoryError):
        a.malloc(30 * MiB)                      # more than the cache holds
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0, "raised without releasing the cache"
    assert (s["num_alloc_retries"], s["num_ooms"], s["num_device_free"]) == (1, 1, 1)
    assert device.held() == 0


def test_a_refused_malloc_is_retried_after_releasing_the_cache():
    device = SimulatedBackend(capacity=100 * MiB)
    backend = FaultInjectingBackend(device, refuse_malloc={2})   # the second device call fails
    a = _core.CachingAllocator(backend, 0)
    a.free(a.malloc(5 * MiB))                   # a 20 MiB segment cached
    p = a.malloc(30 * MiB)                      # call 2 refused, cache released, call 3 succeeds
    s = a.memory_stats()
    assert p != 0 and s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert backend.malloc_calls == 3 and backend.refused == 1


def test_slow_memory_does_not_stall_other_threads_for_long():
    """A device slow to give memory: cache hits on other threads go on."""
    device = SimulatedBackend(capacity=8 << 30)
    a = _core.CachingAllocator(FaultInjectingBackend(device, malloc_delay=0.2), 0)
    a.free(a.malloc(512))                        # the small pool is warm
    slow = threading.Thread(target=lambda: a.malloc(3 * MiB))   # a miss: 0.2 s in the device
    slow.start()
    time.sleep(0.05)
    start = time.monotonic()
    for _ in range(1000):
        a.free(a.malloc(512))
    waited = time.monotonic() - start
    slow.join()
    # The slow call holds the allocator lock while the backend runs (as
    # PyTorch's does), so hits wait for it at most once, not per call.
    assert waited < 1.0
    a._check_invariants()
