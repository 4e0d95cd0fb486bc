"""The misbehaving backend with expandable segments.

The state machine of test_misbehaving_backend.py, over a caching allocator
with ``expandable_segments=True``: its backend (a :class:`SimulatedBackend`
with virtual memory, which knows every range reserved and page mapped)
misbehaves in the four calls that reserve address space and map memory into
it, ``reserve_address_range``, ``map_pages``, ``unmap_pages`` and
``release_address_range``, on request:

* a garbage collection inside the call, before or after its real work: the
  last references to Allocations of the same allocator go, and their
  finalizers free blocks re-entrantly (the core's lock is recursive: the
  reported crash was such a free merging away the block being unmapped);
* ``MemoryError`` before the work (the device, or the address space, is full);
* ``KeyboardInterrupt`` or another error before the work, or after it: then
  pages stay mapped, or a range reserved, that the core does not know of
  (stranded), as when Ctrl-C arrives just after the system call;

and in the event callbacks and the history hook as the first machine does.
Each is planned for some later call; one rule also plans a collection for
the very next call and makes that call at once, the blocks nearest to its
span dying first: the shape of the reported crash, found by the machine in
a few minutes before the fix (SIGSEGV in empty_cache's unmap).

After every step, besides the checks every allocator passes
(tests/helpers/misbehaving.py): the pages the device has mapped are those of
the allocator's mapped runs and those failed calls stranded or lost, never
one used by both; every live block lies in mapped pages; reserved bytes are
the mapped bytes; the ranges are the allocator's and the stranded ones; a
failed unmap is counted in ``lost_segments()`` and its span never touched
again. After freeing everything, ``empty_cache()`` and
``empty_virt_addr_cache()``: nothing mapped or reserved but what failed calls
left.

Each example runs first in a forked copy (tests/helpers/crash_guard.py), so
that a crash of the compiled core is a failure hypothesis shrinks and prints.
"""
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import invariant, rule

from tests.helpers.crash_guard import guarded, guarded_check
from tests.helpers.misbehaving import EVENT_CHAOS, MiB, AllocatorMachine, MisbehavingBackend, note, sizes, streams
from unimem._runtime.config import EXPANDABLE_RESERVED_RATIO
from unimem.backends.faults import InjectedFault
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

CAPACITY = 256 * MiB              # small enough that requests often find the device full
GRANULARITY = 64 << 10            # the small pool's page; the large pool maps 2 MiB pages
VM_CALLBACKS = ("reserve_address_range", "map_pages", "unmap_pages", "release_address_range")


class ExpandableMisbehavingBackend(MisbehavingBackend):
    """A :class:`MisbehavingBackend` whose virtual-memory calls misbehave too,
    and which records what the misbehaviour left on the device."""

    CALLBACKS = MisbehavingBackend.CALLBACKS + VM_CALLBACKS

    def __init__(self, collect, inner=None):
        super().__init__(collect, inner or SimulatedBackend(capacity=CAPACITY, granularity=GRANULARITY))
        self.map_stranded = set()       # pages mapped by a map that then raised
        self.lost_pages = set()         # pages still mapped after an unmap that raised first
        self.lost_spans = []            # (address, size) of every unmap that raised: lost
        self.stranded_ranges = {}       # base -> size: reserved on the device, unknown to the core
        self.maps_done = 0              # map calls that returned
        self.unmaps_done = 0            # unmap calls that returned
        self.unmap_calls = 0

    def virtual_memory_granularity(self, device):
        return self.inner.virtual_memory_granularity(device)

    def _pages(self, address, size):
        return set(range(address, address + size, self.inner.granularity))

    def _on_device(self, call, *args):
        """The simulated device's ``call``: one it refuses is the core's misuse."""
        try:
            return getattr(self.inner, call)(*args)
        except RuntimeError as exc:
            self.violations.append(f"{call}{args}: {exc}")
            raise

    def _before(self, callback, action, near=None):
        """The actions before the real work: a collection (the blocks nearest
        to the span ``near`` die first), an interrupt, an error, a full device."""
        if action[0] == "gc":
            self.collect(action[1], action[2], callback, near)
        elif action[0] == "memory_error":
            raise MemoryError(f"injected in {callback}: the device is full")
        self._common(callback, action)          # interrupt, raise

    def _after(self, callback, action, near=None):
        """The actions after the real work."""
        if action[0] == "interrupt_after":
            raise self._fire(KeyboardInterrupt(f"injected in {callback}, after its work"))
        if action[0] == "raise_after":
            raise self._fire(InjectedFault(f"injected failure in {callback}, after its work"))
        if action[0] == "gc_after":
            self.collect(action[1], action[2], callback, near)

    def reserve_address_range(self, size, device):
        action = self._action("reserve_address_range")
        with self._inside():
            self._before("reserve_address_range", action)
            base = self._on_device("reserve_address_range", size, device)
            if action[0] in ("interrupt_after", "raise_after"):
                self.stranded_ranges[base] = size
            self._after("reserve_address_range", action)
            return base

    def map_pages(self, address, size, device):
        action = self._action("map_pages")
        with self._inside():
            self._before("map_pages", action, (address, size))
            pages = self._pages(address, size)
            if pages & self.lost_pages:
                self.violations.append(f"map of {address:#x}+{size}: the core lost that span")
            if pages & self.map_stranded:       # a device maps a page once; the core could not know
                raise self._fire(InjectedFault(f"{address:#x}+{size} is mapped already (a map that raised)"))
            self._on_device("map_pages", address, size, device)
            if action[0] in ("interrupt_after", "raise_after"):
                self.map_stranded |= pages
            else:
                self.maps_done += 1
            self._after("map_pages", action, (address, size))

    def unmap_pages(self, address, size, device):
        self._unmap("unmap_pages", address, size, device)

    def _unmap(self, callback, address, size, device):
        action = self._action(callback)
        with self._inside():
            self.unmap_calls += 1
            pages = self._pages(address, size)
            if pages & (self.lost_pages | self.map_stranded):
                self.violations.append(f"unmap of {address:#x}+{size}: pages the core does not hold")
            if action[0] in ("interrupt", "raise"):         # nothing unmapped: the span stays mapped
                self.lost_pages |= pages
                self.lost_spans.append((address, size))
            self._before(callback, action, (address, size))
            self._on_device(callback, address, size, device)
            if action[0] in ("interrupt_after", "raise_after"):
                self.lost_spans.append((address, size))
            else:
                self.unmaps_done += 1
            self._after(callback, action, (address, size))

    def release_address_range(self, address, size, device):
        action = self._action("release_address_range")
        with self._inside():
            if any(address <= p < address + size for p in self.lost_pages):
                self.violations.append(f"release of {address:#x}: a lost span is mapped in it")
            if action[0] in ("interrupt", "raise"):         # not released: the core forgets it
                self.stranded_ranges[address] = size
            self._before("release_address_range", action, (address, size))
            if any(address <= p < address + size for p in self.map_stranded):
                self.stranded_ranges[address] = size        # a device refuses: pages are mapped in it
                raise self._fire(InjectedFault(f"the range {address:#x} still has pages mapped"))
            self._on_device("release_address_range", address, size, device)
            self._after("release_address_range", action, (address, size))


CHAOS = ([(callback, (kind,)) for callback in VM_CALLBACKS
          for kind in ("interrupt", "raise", "interrupt_after", "raise_after")]
         + [("map_pages", ("memory_error",)), ("reserve_address_range", ("memory_error",))]
         + EVENT_CHAOS)
# The callbacks an expandable allocator calls (never malloc or free).
CALLED = tuple(c for c in ExpandableMisbehavingBackend.CALLBACKS if c not in ("malloc", "free"))


class ExpandableMachine(AllocatorMachine):
    """An allocator with expandable segments over :class:`ExpandableMisbehavingBackend`."""

    guard_steps = True
    collect_frees_raw = True
    options: dict = {}          # more of the allocator's options

    backend_class = ExpandableMisbehavingBackend

    def __init__(self):
        super().__init__(self.backend_class(self.collect), CAPACITY, expandable_segments=True,
                         **self.options)

    @rule()
    @guarded
    def empty_virt_addr_cache(self):
        self.attempt(self.core.empty_virt_addr_cache)

    # -- misbehaviour, at some later point --------------------------------------------
    @rule(callback=st.sampled_from(CALLED), count=st.integers(1, 3), offset=st.integers(0, 7),
          after=st.booleans())
    def garbage_collection_in_a_callback(self, callback, count, offset, after):
        after = after and callback in VM_CALLBACKS
        self.backend.plans[callback].append(("gc_after" if after else "gc", count, offset))

    @rule(where=st.sampled_from(CHAOS))
    def failure_in_a_callback(self, where):
        callback, action = where
        self.backend.plans[callback].append(action)

    # -- a collection, and the operation that makes the callback run at once ------------
    @rule(callback=st.sampled_from(VM_CALLBACKS), count=st.integers(1, 3), after=st.booleans(),
          size=sizes, stream=streams, handle=st.booleans())
    @guarded
    def neighbours_die_in_the_next_call(self, callback, count, after, size, stream, handle):
        """A collection in the very next call of ``callback`` (the blocks
        nearest to its span die: they merge with it), and the operation that
        calls it: malloc maps and reserves, empty_cache unmaps, and
        empty_virt_addr_cache releases."""
        self.backend.plans[callback].insert(0, ("gc_after" if after else "gc", count, 0))
        if callback in ("map_pages", "reserve_address_range"):
            self.malloc(size, stream, handle)
        else:
            self.empty_cache(None)
            if callback == "release_address_range":
                self.empty_virt_addr_cache()

    # -- after every step -------------------------------------------------------------
    def known_pages(self):
        """The pages of the allocator's mapped runs (its snapshot's segments)."""
        pages = set()
        for seg in self.core.snapshot():
            assert seg["is_expandable"], "an expandable allocator made a plain segment"
            assert seg["address"] % GRANULARITY == 0 and seg["total_size"] % GRANULARITY == 0, \
                f"the mapped run at {seg['address']:#x} is not whole pages"
            pages |= set(range(seg["address"], seg["address"] + seg["total_size"], GRANULARITY))
        return pages

    @invariant()
    @guarded_check
    def mapped_pages_are_what_the_allocator_knows(self):
        backend = self.backend
        known = self.known_pages()
        left = backend.map_stranded | backend.lost_pages
        assert not known & left, "the allocator counts as its own pages that failed calls left"
        mapped = self.device.mapped_pages[0]
        assert mapped == known | left, (f"mapped by the device and unknown to the allocator: "
                                        f"{sorted(map(hex, mapped - known - left))[:8]}; the other way: "
                                        f"{sorted(map(hex, known - mapped))[:8]}")
        for ptr, (size, _, _) in self.core.live_allocations().items():
            assert set(range(ptr - ptr % GRANULARITY, ptr + size, GRANULARITY)) <= known, \
                f"the live block at {ptr:#x} is not all in mapped pages"
        stats = self.core.memory_stats()
        assert stats["reserved_bytes.all.current"] == self.core.memory_reserved() == len(known) * GRANULARITY
        assert stats["segment.all.current"] == 0 and stats["inactive_split.all.current"] == 0
        assert stats["num_device_alloc"] == backend.maps_done
        assert backend.unmaps_done <= stats["num_device_free"] <= backend.unmap_calls
        assert self.core.lost_segments() == {"count": len(backend.lost_spans),
                                             "bytes": sum(size for _, size in backend.lost_spans)}
        assert not self.device.live[0], "an expandable allocator called malloc"

    @invariant()
    @guarded_check
    def ranges_are_what_the_allocator_knows(self):
        self.check_ranges()

    def check_ranges(self):
        """The device's reserved ranges are the allocator's and the stranded ones."""
        ranges = dict(self.device.ranges[0])
        for base, size in self.backend.stranded_ranges.items():
            assert ranges.pop(base) == size
        assert self.core.reserved_address_space() == {"ranges": len(ranges), "bytes": sum(ranges.values())}

    def check_drained(self):
        self.attempt(self.core.empty_virt_addr_cache)
        backend = self.backend
        assert self.device.mapped_pages[0] == backend.map_stranded | backend.lost_pages
        ranges = self.device.ranges[0]
        with_lost = {base for base, size in ranges.items()
                     if any(base <= address < base + size for address, _ in backend.lost_spans)}
        assert set(ranges) == set(backend.stranded_ranges) | with_lost, \
            "a range without a lost span stayed reserved"
        self.check_ranges()


class ExpandableMachineWithReservedRatio(ExpandableMachine):
    """The same with the bound on reserved memory that UNIMEM_ALLOC_CONF gives
    expandable segments: a malloc then unmaps free pages in holes before it
    maps more, so unmap_pages runs inside malloc too."""

    options = {"max_reserved_ratio": EXPANDABLE_RESERVED_RATIO}


class StreamOrderedMisbehavingBackend(ExpandableMisbehavingBackend):
    """The same over a :class:`SimulatedGPU`, whose kernels use memory until
    their stream completes, with ``unmap_idle_pages``: it misbehaves as
    ``unmap_pages`` does, and the device refuses it (a violation) pages that
    queued work still uses."""

    CALLBACKS = ExpandableMisbehavingBackend.CALLBACKS + ("unmap_idle_pages",)

    def __init__(self, collect):
        super().__init__(collect, SimulatedGPU(capacity=CAPACITY, granularity=GRANULARITY))

    def unmap_idle_pages(self, address, size, device):
        note("a hole's pages unmapped without waiting" if self.depth == 0
             else "a hole's pages unmapped without waiting, re-entered")
        self._unmap("unmap_idle_pages", address, size, device)


class StreamOrderedReleaseMachine(ExpandableMachineWithReservedRatio):
    """With the bound, over a device whose unmap_pages waits (as CUDA's): a
    malloc releases holes stream-ordered (_core_holes.pxi). Kernels use live
    blocks on their streams; the pages of a hole are held until an event
    after them has completed, then unmapped with unmap_idle_pages, which
    never gets pages a kernel still uses."""

    backend_class = StreamOrderedMisbehavingBackend
    options = {"max_reserved_ratio": 1.0}           # holes go at most misses

    def tolerated(self, reported):
        """An event callback's injected fault while a hole is released: the
        hole is unmapped after waiting instead, and the error reported."""
        kind, _, where = reported
        if kind is InjectedFault and "to unmap a hole without waiting" in where:
            note("an event failed: the hole was unmapped after waiting")
            return True
        return super().tolerated(reported)

    @rule(data=st.data())
    @guarded
    def a_kernel_uses_a_live_block(self, data):
        live = sorted(self.live())
        if live:
            ptr = data.draw(st.sampled_from(live))
            size, stream = self.requests[ptr]
            stream = data.draw(st.sampled_from(sorted({stream} | self.uses.get(ptr, set()))))
            self.device.launch(stream, ptr, size)

    @rule(size=st.integers(MiB, 12 * MiB), stream=streams, busy=st.booleans(), handle=st.booleans(),
          event_fails=st.booleans())
    @guarded
    def a_hole_then_a_larger_miss(self, size, stream, busy, handle, event_fails):
        """Three blocks, the middle one freed (a kernel still using it, or
        not), then a larger request: the shape that unmaps a hole (with the
        event it records failing, or not)."""
        before = self.live()
        for _ in range(3):
            self.malloc(size, stream, False)
        new = sorted(self.live() - before)
        if len(new) == 3 and new[1] in self.raw:
            if busy:
                self.device.launch(stream, new[1], size)
            self.pinned.add(new[1])
            try:
                _, error = self.attempt(lambda: self.core.free(new[1]))
            finally:
                self.pinned.discard(new[1])
            if error is None or not self.core.owns(new[1]):
                self.forget(new[1])
        if event_fails:
            self.backend.plans["record_event"].insert(0, ("raise",))
        self.malloc(size + 2 * MiB, stream, handle)

    @rule(action=st.sampled_from([("interrupt",), ("raise",), ("interrupt_after",), ("raise_after",)]),
          count=st.integers(1, 3), offset=st.integers(0, 7), after=st.booleans(), collect=st.booleans())
    def misbehaviour_in_the_idle_unmap(self, action, count, offset, after, collect):
        if collect:
            action = ("gc_after" if after else "gc", count, offset)
        self.backend.plans["unmap_idle_pages"].append(action)


# A failure is shrunk for up to five minutes (hypothesis's limit), one fork per
# try; the explain phase, as long again, is left out.
SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
ExpandableMachine.TestCase.settings = SETTINGS
ExpandableMachineWithReservedRatio.TestCase.settings = SETTINGS
StreamOrderedReleaseMachine.TestCase.settings = SETTINGS
TestMisbehavingExpandable = pytest.mark.timeout(900)(ExpandableMachine.TestCase)
TestMisbehavingExpandableWithReservedRatio = pytest.mark.timeout(900)(ExpandableMachineWithReservedRatio.TestCase)
TestMisbehavingStreamOrderedRelease = pytest.mark.timeout(900)(StreamOrderedReleaseMachine.TestCase)
