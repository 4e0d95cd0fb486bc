"""Sleep mode in the core: ``sleep(offload)`` gives a
device's memory back and keeps every live block at its address;
``wake_up()`` backs the addresses with memory again and copies the bytes back.

On real host memory (the cpu pool's backend, with and without expandable
segments), on the simulated CUDA driver, and over backends that fail or
re-enter the allocator half way."""
import ctypes
import os

import hypothesis
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from unimem import _core
from unimem.backends.base import Backend, forward_to_inner
from unimem.backends.cuda import CUDABackend
from unimem.backends.faults import FaultInjectingBackend
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fake_cuda import FakeCudaDriver, FakeCudaRuntime

MiB = 1 << 20
SIZES = (700, 300 << 10, 3 * MiB, 25 * MiB)          # small pool, large pool, an oversize segment
PAGE = os.sysconf("SC_PAGE_SIZE")


def host_allocator(expandable, backend=None):
    return _core.CachingAllocator(backend or PageAlignedBackend(), 0, expandable_segments=expandable)


def fill(ptr, size, seed):
    """A pattern that differs from block to block and from page to page."""
    pattern = bytes((seed * 31 + i * 7) & 0xFF for i in range(251))
    data = (pattern * (size // len(pattern) + 1))[:size]
    ctypes.memmove(ptr, data, size)
    return data


def read(ptr, size):
    return ctypes.string_at(ptr, size)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def live_blocks(allocator):
    blocks = {}
    for i, size in enumerate(SIZES):
        ptr = allocator.malloc(size)
        blocks[ptr] = fill(ptr, size, i)
    return blocks


@pytest.mark.parametrize("expandable", [False, True])
def test_every_live_block_keeps_its_address_and_bytes(expandable):
    allocator = host_allocator(expandable)
    blocks = live_blocks(allocator)
    cached = allocator.malloc(5 * MiB)              # free cached memory sleeps too
    allocator.free(cached)
    before = allocator.memory_stats()
    allocator.sleep()
    assert allocator.is_sleeping()
    allocator._check_invariants()
    allocator.wake_up()
    assert not allocator.is_sleeping()
    allocator._check_invariants()
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data
        assert allocator.owns(ptr)
    after = allocator.memory_stats()
    for key in ("reserved_bytes.all.current", "allocated_bytes.all.current", "active_bytes.all.current",
                "segment.all.current", "inactive_split_bytes.all.current"):
        assert after[key] == before[key], key
    # the cache is as it was: the freed block is handed out again, without a device call
    calls = after["num_device_alloc"]
    assert allocator.malloc(5 * MiB) == cached
    assert allocator.memory_stats()["num_device_alloc"] == calls


@pytest.mark.parametrize("expandable", [False, True])
def test_statistics_while_asleep(expandable):
    allocator = host_allocator(expandable)
    live_blocks(allocator)
    before = allocator.memory_stats()
    allocator.sleep(offload=False)
    asleep = allocator.memory_stats()
    assert asleep["reserved_bytes.all.current"] == 0 == allocator.memory_reserved()
    assert asleep["reserved_bytes.all.peak"] == before["reserved_bytes.all.peak"]
    for key in ("allocated_bytes.all.current", "active_bytes.all.current", "allocation.all.current",
                "requested_bytes.all.current", "segment.all.current"):
        assert asleep[key] == before[key], key
    released = asleep["num_device_free"] - before["num_device_free"]
    assert released >= 1 and asleep["num_device_alloc"] == before["num_device_alloc"]
    allocator.wake_up()
    woken = allocator.memory_stats()
    assert woken["num_device_alloc"] - before["num_device_alloc"] == released     # one map per release
    assert woken["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]


@pytest.mark.parametrize("expandable", [False, True])
def test_rss_falls_while_asleep_by_about_the_reserved_bytes(expandable):
    allocator = host_allocator(expandable)
    blocks = [allocator.malloc(16 * MiB) for _ in range(4)]
    for ptr in blocks:
        ctypes.memset(ptr, 1, 16 * MiB)                # every page resident
    reserved = allocator.memory_reserved()
    awake = rss()
    allocator.sleep(offload=False)
    assert awake - rss() >= 0.9 * 64 * MiB
    allocator.wake_up()
    for ptr in blocks:
        ctypes.memset(ptr, 2, 16 * MiB)                # mapped and writable again
    assert allocator.memory_reserved() == reserved


def test_offload_keeps_the_bytes_in_host_memory_while_asleep():
    """On the cpu pool an offload moves the live bytes: RSS falls by the
    reserved memory that held no live block."""
    allocator = host_allocator(False)
    ptr = allocator.malloc(40 * MiB)                   # a 40 MiB segment
    ctypes.memset(ptr, 3, 40 * MiB)
    cached = allocator.malloc(30 * MiB)                # and a free 30 MiB one
    ctypes.memset(cached, 4, 30 * MiB)
    allocator.free(cached)
    awake = rss()
    allocator.sleep()
    assert awake - rss() >= 25 * MiB
    allocator.wake_up()
    assert read(ptr, 40 * MiB) == b"\x03" * (40 * MiB)


@pytest.mark.parametrize("expandable", [False, True])
def test_without_offload_addresses_are_kept_and_usable(expandable):
    allocator = host_allocator(expandable)
    blocks = live_blocks(allocator)
    allocator.sleep(offload=False)
    allocator.wake_up()
    for i, (ptr, data) in enumerate(blocks.items()):
        assert allocator.owns(ptr)
        assert read(ptr, len(data)) != data or len(data) == 0        # new pages: zeros
        assert fill(ptr, len(data), i + 5) == read(ptr, len(data))
    allocator._check_invariants()


@pytest.mark.parametrize("expandable", [False, True])
def test_allocation_while_asleep_is_refused_and_changes_nothing(expandable):
    allocator = host_allocator(expandable)
    live_blocks(allocator)
    allocator.sleep(offload=False)
    before = allocator.memory_stats()
    for allocate in (lambda: allocator.malloc(100), lambda: allocator.allocate(100),
                     lambda: allocator.malloc(100 * MiB)):
        with pytest.raises(RuntimeError, match=r"asleep.*call wake_up\(\)"):
            allocate()
    assert allocator.memory_stats() == before
    allocator._check_invariants()
    allocator.wake_up()
    allocator.free(allocator.malloc(100))


@forward_to_inner(intercepted={"record_event", "event_done", "malloc", "_raw_api"})
class EventsDoneOnCue(Backend):
    """Host memory whose stream events complete when told to, and which
    notes each segment the core asks for while its allocator is asleep."""

    def __init__(self, inner):
        self.inner = inner
        self.done = False
        self.allocator = None
        self.segments_made_asleep = 0

    def record_event(self, stream, device):
        return object()

    def event_done(self, event):
        return self.done

    def malloc(self, size, device, stream):
        if self.allocator is not None and self.allocator.is_sleeping():
            self.segments_made_asleep += 1
        return self.inner.malloc(size, device, stream)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_sleep_between_mallocs_asleep_check_and_its_lock_is_seen_under_the_lock(expandable):
    """malloc checks "asleep" before taking the lock; a sleep() that comes
    in between (another thread's; here the history hook's, which runs
    there when malloc first processes completed stream events) must still
    refuse the request under the lock, not map a new segment while asleep."""
    backend = EventsDoneOnCue(PageAlignedBackend())
    allocator = host_allocator(expandable, backend)
    backend.allocator = allocator
    p = allocator.malloc(3 * MiB)
    allocator.record_stream(p, 1)
    allocator.free(p)                              # pending: its event is not done

    def hook(events):
        if any(action == "free_completed" for action, *_ in events) and not allocator.is_sleeping():
            allocator.sleep(offload=False)

    allocator.set_trace_hook(hook)
    backend.done = True                            # the next malloc's event processing frees p
    with pytest.raises(RuntimeError, match=r"asleep.*call wake_up\(\)"):
        allocator.malloc(5 * MiB)
    assert allocator.is_sleeping()
    assert backend.segments_made_asleep == 0
    assert allocator.memory_reserved() == 0
    allocator.set_trace_hook(None)
    allocator._check_invariants()
    allocator.wake_up()
    allocator.free(allocator.malloc(5 * MiB))
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0


@pytest.mark.parametrize("expandable", [False, True])
def test_a_block_freed_while_asleep_is_dropped_and_its_memory_reused_after(expandable):
    allocator = host_allocator(expandable)
    blocks = live_blocks(allocator)
    victim = next(p for p in blocks if len(blocks[p]) == 3 * MiB)
    allocator.sleep()
    allocated, active = allocator.memory_allocated(), allocator.memory_stats()["active_bytes.all.current"]
    allocator.free(victim)                     # bookkeeping only: its memory is gone already
    data = blocks.pop(victim)
    assert allocator.memory_allocated() == allocated - len(data)
    assert allocator.memory_stats()["active_bytes.all.current"] == active     # until wake_up, as a stream free
    allocator._check_invariants()
    with pytest.raises(ValueError):
        allocator.free(victim)                 # freed once only
    allocator.wake_up()
    allocator._check_invariants()
    assert allocator.memory_stats()["active_bytes.all.current"] == active - len(data)
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data
    assert allocator.malloc(3 * MiB) == victim     # its place is free again


@pytest.mark.parametrize("expandable", [False, True])
def test_empty_cache_while_asleep_gives_nothing_back_and_wake_up_maps_everything(expandable):
    allocator = host_allocator(expandable)
    blocks = live_blocks(allocator)
    reserved = allocator.memory_reserved()
    allocator.sleep()
    for ptr in list(blocks):
        allocator.free(ptr)                    # whole segments free now
    allocator.empty_cache()                    # nothing is mapped: nothing to give back
    allocator.empty_virt_addr_cache()
    allocator._check_invariants()
    assert allocator.memory_reserved() == 0 and allocator.is_sleeping()
    allocator.wake_up()
    assert allocator.memory_reserved() == reserved and allocator.memory_allocated() == 0
    allocator.empty_cache()                    # awake: the cache goes back
    allocator._check_invariants()
    assert allocator.memory_reserved() == 0


def test_sleeping_twice_and_waking_while_awake_do_nothing():
    allocator = host_allocator(False)
    blocks = live_blocks(allocator)
    allocator.wake_up()                        # awake: nothing to do
    allocator.sleep()
    frees = allocator.memory_stats()["num_device_free"]
    allocator.sleep(offload=False)             # asleep already: the first sleep's copies stay
    assert allocator.memory_stats()["num_device_free"] == frees
    allocator.wake_up()
    allocator.wake_up()
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data


def test_an_empty_allocator_sleeps_and_wakes():
    allocator = host_allocator(False)
    allocator.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        allocator.malloc(1)
    allocator.wake_up()
    allocator.free(allocator.malloc(1))


def test_debug_mode_sees_no_write_after_free_in_memory_that_slept(recwarn):
    allocator = host_allocator(False)
    allocator.enable_debug()
    keep = allocator.malloc(1000)
    allocator.free(allocator.malloc(5000))
    allocator.sleep()
    allocator.wake_up()
    allocator.free(allocator.malloc(5000))     # checked on reuse: the fill is back
    allocator.free(keep)
    assert allocator.debug_reports() == []


def test_history_records_the_frees_completed_at_wake_up():
    allocator = host_allocator(False)
    events = []
    allocator.set_trace_hook(events.extend)
    ptr = allocator.malloc(1000)
    allocator.sleep()
    allocator.free(ptr)
    assert [e[0] for e in events][-1] == "free_requested"
    allocator.wake_up()
    assert [e[0] for e in events][-1] == "free_completed"


# ---------------------------------------------------------------------------
# what cannot sleep
# ---------------------------------------------------------------------------
def cuda(expandable, monkeypatch=None):
    runtime = FakeCudaRuntime(devices=1, capacity=1 << 30)
    backend = CUDABackend(runtime, driver=FakeCudaDriver(runtime))
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=expandable)
    return allocator, backend, runtime


def test_cuda_without_expandable_segments_says_to_set_them():
    allocator, _, _ = cuda(False)
    ptr = allocator.malloc(MiB)
    with pytest.raises(NotImplementedError, match="expandable_segments:True"):
        allocator.sleep()
    assert not allocator.is_sleeping()
    allocator.free(ptr)
    allocator._check_invariants()


def test_a_backend_without_the_capability_cannot_sleep():
    allocator = _core.CachingAllocator(SimulatedBackend(), 0)
    with pytest.raises(NotImplementedError, match="cannot give a segment's memory back"):
        allocator.sleep()
    allocator.free(allocator.malloc(10))


def test_a_backend_the_host_cannot_read_offloads_only_through_its_copies():
    """The simulated device has virtual memory but no bytes: offload=True is
    refused before anything is given back, offload=False works."""
    allocator = _core.CachingAllocator(SimulatedBackend(), 0, expandable_segments=True)
    ptr = allocator.malloc(3 * MiB)
    before = allocator.memory_stats()
    with pytest.raises(NotImplementedError, match=r"offload=False"):
        allocator.sleep()
    after = allocator.memory_stats()
    assert after.pop("num_sync_all_streams") == before.pop("num_sync_all_streams") + 1   # sleep waited
    assert not allocator.is_sleeping() and after == before
    allocator._check_invariants()
    allocator.sleep(offload=False)
    assert allocator.memory_reserved() == 0
    allocator.wake_up()
    allocator.free(ptr)
    allocator._check_invariants()


def test_cuda_expandable_segments_sleep_through_the_driver_and_copy_through_the_runtime():
    allocator, backend, runtime = cuda(True)
    copies = []
    runtime.memcpy = lambda dst, src, size, kind: copies.append((dst, src, size, kind))
    ptrs = [allocator.malloc(n) for n in (1000, 3 * MiB)]
    vmm = backend._vmm
    assert vmm.handles_held(0) > 0
    allocator.sleep()
    assert vmm.handles_held(0) == 0 and allocator.memory_reserved() == 0
    to_host = [c for c in copies if c[3] == 2]
    assert sorted(src for _, src, _, _ in to_host) == sorted(ptrs)
    allocator.wake_up()
    assert vmm.handles_held(0) > 0 and allocator.memory_reserved() > 0
    to_device = [c for c in copies if c[3] == 1]
    assert sorted(dst for dst, _, _, _ in to_device) == sorted(ptrs)
    # each block comes back from where it went
    assert {(src, host) for host, src, _, _ in to_host} == {(dst, host) for dst, host, _, _ in to_device}
    allocator._check_invariants()


# ---------------------------------------------------------------------------
# failures and re-entry half way
# ---------------------------------------------------------------------------
@forward_to_inner(intercepted={"release_pages", "restore_pages", "unmap_pages", "map_pages"})
class Hooked(Backend):
    """Calls ``hook(call)`` before each release/restore/unmap/map; the hook
    may raise (the call then fails) or re-enter the allocator."""

    def __init__(self, inner, hook):
        self.inner = inner
        self.hook = hook

    def release_pages(self, address, size, device):
        self.hook("release")
        self.inner.release_pages(address, size, device)

    def restore_pages(self, address, size, device):
        self.hook("restore")
        self.inner.restore_pages(address, size, device)

    def unmap_pages(self, address, size, device):
        self.hook("release")
        self.inner.unmap_pages(address, size, device)

    def map_pages(self, address, size, device):
        self.hook("restore")
        self.inner.map_pages(address, size, device)


class Failing:
    """A hook that fails the given calls of kind ``call`` (1-based, counted
    from when it is armed: expandable segments map pages to allocate too)."""

    def __init__(self, call, numbers, error=MemoryError):
        self.call, self.numbers, self.error = call, numbers, error
        self.seen = {"release": 0, "restore": 0}
        self.armed = False

    def __call__(self, kind):
        if not self.armed:
            return
        self.seen[kind] += 1
        if kind == self.call and self.seen[kind] in self.numbers:
            raise self.error(f"injected: {kind} {self.seen[kind]}")


@pytest.mark.parametrize("expandable", [False, True])
def test_a_restore_that_fails_leaves_the_rest_asleep_and_wake_up_again_finishes(expandable):
    hook = Failing("restore", {2})
    allocator = host_allocator(expandable, Hooked(PageAlignedBackend(), hook))
    blocks = live_blocks(allocator)
    hook.armed = True
    reserved = allocator.memory_reserved()
    allocator.sleep()
    with pytest.raises(MemoryError, match=r"stays asleep.*call wake_up\(\) again"):
        allocator.wake_up()
    assert allocator.is_sleeping()
    assert 0 < allocator.memory_reserved() < reserved
    allocator._check_invariants()
    with pytest.raises(RuntimeError, match="asleep"):
        allocator.malloc(100)                  # nothing can be handed out twice
    allocator.wake_up()
    assert not allocator.is_sleeping() and allocator.memory_reserved() == reserved
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data
    allocator._check_invariants()


@pytest.mark.parametrize("expandable", [False, True])
def test_a_release_that_fails_keeps_that_memory_and_the_allocator_asleep(expandable):
    hook = Failing("release", {1}, OSError)
    allocator = host_allocator(expandable, Hooked(PageAlignedBackend(), hook))
    blocks = live_blocks(allocator)
    hook.armed = True
    reserved = allocator.memory_reserved()
    with pytest.raises(OSError, match="injected"):
        allocator.sleep()
    assert allocator.is_sleeping()
    assert 0 < allocator.memory_reserved() < reserved
    allocator._check_invariants()
    allocator.wake_up()
    assert allocator.memory_reserved() == reserved
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data
    allocator._check_invariants()


def test_the_host_backend_refuses_spans_that_are_not_its_segments():
    backend = PageAlignedBackend()
    ptr = backend.malloc(4 * PAGE)
    for address, size in ((ptr, 2 * PAGE), (ptr + PAGE, 3 * PAGE), (0x1000, PAGE), (-PAGE, PAGE), (ptr, -1)):
        with pytest.raises(ValueError, match="not a segment"):
            backend.release_pages(address, size)
        with pytest.raises(ValueError, match="not a segment"):
            backend.restore_pages(address, size)
    ctypes.memset(ptr, 5, 4 * PAGE)
    backend.release_pages(ptr, 4 * PAGE)
    backend.restore_pages(ptr, 4 * PAGE)
    assert read(ptr, 4 * PAGE) == bytes(4 * PAGE)     # fresh pages
    backend.free(ptr, 4 * PAGE)
    with pytest.raises(ValueError, match="not a segment"):
        backend.release_pages(ptr, 4 * PAGE)          # freed: no longer its


@pytest.mark.parametrize("expandable", [False, True])
def test_backend_calls_that_re_enter_the_allocator(expandable):
    """A backend call that frees a live block (a finalizer), allocates or
    calls sleep/wake_up again: the free works, the rest is refused, and every
    other block keeps its bytes."""
    holder = {}
    outcomes = []

    def hook(kind):
        allocator = holder.get("allocator")
        if allocator is None or not allocator.is_sleeping():
            return                           # allocating, not sleeping
        if holder["victims"]:
            allocator.free(holder["victims"].pop())
        for call in (lambda: allocator.malloc(100), allocator.sleep, allocator.wake_up):
            try:
                call()
            except RuntimeError as exc:
                outcomes.append(str(exc))
    allocator = host_allocator(expandable, Hooked(PageAlignedBackend(), hook))
    holder["allocator"] = allocator
    blocks = live_blocks(allocator)
    holder["victims"] = [p for p in blocks if len(blocks[p]) < MiB]
    victims = list(holder["victims"])
    allocator.sleep()
    allocator.wake_up()
    assert all("asleep" in o or "under way" in o for o in outcomes) and outcomes
    for ptr in victims:
        assert not allocator.owns(ptr)
        blocks.pop(ptr)
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data
    allocator._check_invariants()


def test_a_map_refused_by_a_fault_injecting_backend_on_wake():
    backend = FaultInjectingBackend(PageAlignedBackend())
    allocator = host_allocator(True, backend)
    blocks = live_blocks(allocator)
    allocator.sleep()
    backend.refuse_next()
    with pytest.raises(MemoryError):
        allocator.wake_up()
    allocator.wake_up()
    for ptr, data in blocks.items():
        assert read(ptr, len(data)) == data


# ---------------------------------------------------------------------------
# a segment filter and a tag: a private pool sleeping alone
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("expandable", [False, True])
def test_only_the_selected_segments_sleep_and_nothing_hands_out_their_blocks(expandable):
    allocator = host_allocator(expandable)
    small = allocator.malloc(1000)                       # small pool
    large = allocator.malloc(3 * MiB)                    # large pool
    data = fill(small, 1000, 1)
    run = next((s["address"], s["total_size"]) for s in allocator.snapshot()
               if s["address"] <= small < s["address"] + s["total_size"])
    allocator.sleep(segments=lambda address, size, stream: address <= small < address + size, tag="pool")
    assert allocator.is_sleeping("pool") and not allocator.is_sleeping()
    more = allocator.malloc(1000)                        # not refused here: the caller's job
    assert not run[0] <= more < run[0] + run[1]          # never in what sleeps
    fill(large, 3 * MiB, 2)
    allocator._check_invariants()
    allocator.wake_up()                                  # another tag: nothing
    assert allocator.is_sleeping("pool")
    allocator.wake_up("pool")
    assert read(small, 1000) == data
    for ptr in (small, large, more):
        allocator.free(ptr)
    allocator._check_invariants()


# ---------------------------------------------------------------------------
# the state machine
# ---------------------------------------------------------------------------
class SleepMachine(RuleBasedStateMachine):
    """Allocate, free, write, sleep (with or without offload), wake up and
    empty the cache in any order on real host memory: every live block keeps
    its address and (after an offloaded sleep) its bytes, and the statistics
    stay exact."""

    expandable = False

    def __init__(self):
        super().__init__()
        self.allocator = host_allocator(self.expandable)
        self.live = {}          # address -> bytes expected (None: contents not promised)
        self.asleep = False
        self.seed = 0

    @rule(size=st.sampled_from([100, 4000, 200 << 10, 2 * MiB + 1, 12 * MiB]))
    def allocate(self, size):
        if self.asleep:
            with pytest.raises(RuntimeError):
                self.allocator.malloc(size)
            return
        ptr = self.allocator.malloc(size)
        assert ptr not in self.live
        self.seed += 1
        self.live[ptr] = fill(ptr, size, self.seed)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.allocator.free(ptr)
        del self.live[ptr]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def write(self, data):
        if self.asleep:
            return                     # nothing is mapped
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.seed += 1
        self.live[ptr] = fill(ptr, len(self.live[ptr]), self.seed)

    @rule(offload=st.booleans())
    def sleep(self, offload):
        self.allocator.sleep(offload=offload)
        if not self.asleep and not offload:
            self.live = {p: bytes(len(d)) for p, d in self.live.items()}    # new pages are zeros
        self.asleep = True
        assert self.allocator.memory_reserved() == 0

    @rule()
    def wake_up(self):
        self.allocator.wake_up()
        self.asleep = False

    @rule()
    def empty_cache(self):
        self.allocator.empty_cache()

    @invariant()
    def consistent(self):
        self.allocator._check_invariants()
        assert self.allocator.is_sleeping() == self.asleep
        assert self.allocator.memory_allocated() == sum(self.allocator.round_size(len(d)) for d in self.live.values())
        if not self.asleep:
            for ptr, expected in self.live.items():
                assert read(ptr, len(expected)) == expected

    def teardown(self):
        self.allocator.wake_up()
        for ptr in list(self.live):
            self.allocator.free(ptr)
        self.allocator.empty_cache()
        self.allocator._check_invariants()


class ExpandableSleepMachine(SleepMachine):
    expandable = True


SETTINGS = hypothesis.settings(max_examples=25, stateful_step_count=25, deadline=None,
                               suppress_health_check=list(hypothesis.HealthCheck))
TestSleepMachine = SleepMachine.TestCase
TestSleepMachine.settings = SETTINGS
TestExpandableSleepMachine = ExpandableSleepMachine.TestCase
TestExpandableSleepMachine.settings = SETTINGS
