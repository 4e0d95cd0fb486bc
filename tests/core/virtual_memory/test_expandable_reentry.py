"""A free re-entered from a virtual-memory callback.

With expandable segments the core calls the backend's ``map_pages``,
``unmap_pages``, ``reserve_address_range`` and ``release_address_range``,
Python methods (with its lock held when these tests were written, the lock
recursive; now with it let go, what the call is about marked meanwhile:
_core_expandable.pxi). A garbage collection inside one of them runs
finalizers, which free other blocks of the same allocator; each such free
merges its block with free neighbours. SECURITY.md promises that a free re-entered from a backend
callback is handled safely. The reported crash: ``empty_cache()`` unmapping
the pages of a free block while the collector freed the block before it,
which merged the free block away; ``_unmap_block`` went on using it (SIGSEGV).

Every scenario runs in a child process, so that a crash is a failed test
with the child's output and signal, not a dead test run. After each: the
core's own invariants, the victims freed, live blocks disjoint and (on the
cpu pool, real memory) holding the bytes written into them, reserved bytes
equal to what the backend has mapped; after freeing everything,
``empty_cache()`` and ``empty_virt_addr_cache()``, nothing reserved or mapped.
"""
import ctypes
import gc
import os
import sys

import pytest

from tests.helpers.crash_guard import run_python
from unimem import _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
CAPACITY = 256 * MiB


# ------------------------------------------------------------------------------------
# the reported reproduction: the cpu pool, configured by the environment
# ------------------------------------------------------------------------------------
REPORTED = """
import ctypes, gc
import numpy
import unimem.cpu

MiB = 1 << 20
pool = unimem.cpu.caching_allocator(0)
assert pool.settings["expandable_segments"] is True

class Cycle:
    def __init__(self, thing):
        self.thing = thing
        self.me = self

a = unimem.cpu.empty(3 * MiB, dtype=numpy.uint8)       # a, then a freed block after it
a[:] = 0xA5
freed = unimem.cpu.empty(3 * MiB, dtype=numpy.uint8)
keep = unimem.cpu.empty(2 * MiB, dtype=numpy.uint8)    # and a live array after those
keep[:] = 0x3C
a_ptr, keep_ptr = a.ctypes.data, keep.ctypes.data
del freed
Cycle(a)                                               # a is reachable from a garbage cycle only
del a
gc.set_threshold(1)
pool.empty_cache()                                     # its unmap_pages runs Python: a is collected
gc.set_threshold(700)
print("empty_cache returned")

pool._check_invariants()
assert not pool.owns(a_ptr), "the collector did not free a"
assert set(pool.live_allocations()) == {keep_ptr}
assert ctypes.string_at(keep_ptr, 2 * MiB) == b"\\x3c" * (2 * MiB), "a live array lost its bytes"
stats = pool.memory_stats()
assert stats["allocated_bytes.all.current"] == 2 * MiB
assert stats["reserved_bytes.all.current"] == pool.memory_reserved() == pool.backend.address_ranges.mapped_bytes()
pool.empty_cache()
assert pool.memory_reserved() == 2 * MiB               # keep's one page
del keep
gc.collect()
pool.empty_cache()
pool.empty_virt_addr_cache()
assert pool.memory_reserved() == 0 and pool.backend.address_ranges.mapped_bytes() == 0
assert all(v == 0 for k, v in pool.memory_stats().items() if k.endswith(".current"))
assert pool.reserved_address_space() == {"ranges": 0, "bytes": 0}
print("PASSED")
"""


def test_the_reported_reproduction_on_the_cpu_pool():
    run_python(REPORTED, env={"UNIMEM_DEVICE": "cpu", "UNIMEM_ALLOC_CONF": "expandable_segments:True"})


# ------------------------------------------------------------------------------------
# backends whose virtual-memory callbacks collect garbage
# ------------------------------------------------------------------------------------

class Reentrant:
    """Mixed into a backend: an armed callback, on its next call, lets go of
    the garbage cycles it was given and runs a full garbage collection,
    before or after doing its real work."""

    armed: dict = {}

    def arm(self, name, when, victims):
        self.armed = dict(self.armed, **{name: (when, victims)})

    def _around(self, name, *args):
        when, victims = self.armed.pop(name, (None, None))
        del victims                     # now only garbage cycles hold them
        if when == "before":
            gc.collect()
        result = getattr(super(), name)(*args)
        if when == "after":
            gc.collect()
        return result

    def reserve_address_range(self, size, device=0):
        return self._around("reserve_address_range", size, device)

    def map_pages(self, address, size, device=0):
        return self._around("map_pages", address, size, device)

    def unmap_pages(self, address, size, device=0):
        return self._around("unmap_pages", address, size, device)

    def release_address_range(self, address, size, device=0):
        return self._around("release_address_range", address, size, device)


class ReentrantSimulated(Reentrant, SimulatedBackend):
    def mapped_bytes(self):
        return len(self.mapped_pages[0]) * self.granularity

    def range_count(self):
        return len(self.ranges[0])


class ReentrantHost(Reentrant, PageAlignedBackend):
    """The cpu pool's backend: real memory, so contents can be checked."""

    def mapped_bytes(self):
        return self.address_ranges.mapped_bytes()

    def range_count(self):
        return len(self.address_ranges.reserved())


class Cycle:
    """Holds an Allocation, and itself: only the collector frees it. Its
    finalizer lets go of the Allocation, whose own finalizer then frees the
    block (left to the collector, the Allocation could be cleared before it
    is finalized and never free it: see the test at the end)."""

    def __init__(self, thing):
        self.thing = thing
        self.me = self

    def __del__(self):
        self.thing = None


class FreesOnDel:
    """A raw address from ``malloc``, freed by the finalizer of a garbage cycle."""

    def __init__(self, core, ptr):
        self.core, self.ptr = core, ptr
        self.me = self

    def __del__(self):
        self.core.free(self.ptr)


class Blocks:
    """The blocks of one scenario: live ones filled with a byte each (on real
    memory), victims held by garbage cycles only, and the checks."""

    def __init__(self, kind):
        self.backend = ReentrantSimulated(capacity=CAPACITY) if kind == "simulated" else ReentrantHost("CPU")
        self.real = kind == "host"
        self.core = _core.CachingAllocator(self.backend, 0, expandable_segments=True)
        self.core.set_capacity(CAPACITY)
        self.live = {}              # address -> (handle, size, byte)
        self.victims = []
        self.doomed = {}            # callback -> the garbage cycles it collects
        self.holes = []

    def keep(self, size, stream=0):
        handle = self.core.allocate(size, stream)
        self.adopt(handle, size)
        return handle.ptr

    def adopt(self, handle, size):
        byte = 1 + len(self.live) % 250
        if self.real:
            ctypes.memset(handle.ptr, byte, size)
        self.live[handle.ptr] = (handle, size, byte)

    def victim(self, size, dies_in, stream=0, raw=False):
        """A block that dies in the callback ``dies_in`` once :meth:`arm`
        armed it: there a garbage cycle holding it is collected (its
        Allocation's finalizer, or ``free`` in a ``__del__`` when raw)."""
        if raw:
            ptr = self.core.malloc(size, stream)
            holder = FreesOnDel(self.core, ptr)
        else:
            holder = Cycle(self.core.allocate(size, stream))
            ptr = holder.thing.ptr
        self.doomed.setdefault(dies_in, []).append(holder)
        self.victims.append(ptr)

    def arm(self, when):
        """Hand the victims to their callbacks: from now on only the backend
        holds the garbage cycles, until the callback lets go."""
        for name in list(self.doomed):
            self.backend.arm(name, when, self.doomed.pop(name))

    def hole(self, size, stream=0):
        """A block to be freed by :meth:`free_holes`, once the blocks after
        it are laid out (freed at once, the next malloc would take it)."""
        self.holes.append(self.core.malloc(size, stream))

    def free_holes(self):
        for ptr in self.holes:
            self.core.free(ptr)

    def check(self):
        core, backend = self.core, self.backend
        assert not backend.armed, f"the scenario never called {sorted(backend.armed)}"
        core._check_invariants()
        live = core.live_allocations()
        assert set(live) == set(self.live), (f"live: {sorted(map(hex, live))}, expected "
                                             f"{sorted(map(hex, self.live))}, victims {sorted(map(hex, self.victims))}")
        spans = sorted((p, size) for p, (size, _, _) in live.items())
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b, f"live blocks {a:#x} and {b:#x} overlap"
        if self.real:
            for ptr, (_, size, byte) in self.live.items():
                assert ctypes.string_at(ptr, size) == bytes([byte]) * size, f"the block at {ptr:#x} lost its bytes"
        stats = core.memory_stats()
        assert stats["reserved_bytes.all.current"] == core.memory_reserved() == backend.mapped_bytes()
        assert stats["allocated_bytes.all.current"] == sum(size for size, _, _ in live.values())

    def drain(self):
        """Free everything: nothing may stay reserved, mapped or counted."""
        for handle, _, _ in self.live.values():
            handle.release()
        self.live.clear()
        self.core.empty_cache()
        self.core._check_invariants()
        assert self.core.memory_reserved() == 0 and self.backend.mapped_bytes() == 0
        self.core.empty_virt_addr_cache()
        assert self.core.reserved_address_space() == {"ranges": 0, "bytes": 0}
        assert self.backend.range_count() == 0
        stats = self.core.memory_stats()
        assert all(v == 0 for k, v in stats.items() if k.endswith(".current")), \
            {k: v for k, v in stats.items() if k.endswith(".current") and v}


# The cases: each lays out blocks around the spot the core works on, with
# victims beside it, arms the callback and makes the call.
def unmapping_a_free_block(blocks, when):
    """The report: a victim before and one after a free block whose whole
    pages empty_cache() unmaps."""
    blocks.victim(3 * MiB, "unmap_pages")
    blocks.hole(3 * MiB)
    blocks.victim(3 * MiB, "unmap_pages", raw=True)
    blocks.keep(2 * MiB)
    blocks.free_holes()
    blocks.arm(when)
    blocks.core.empty_cache()


def mapping_after_a_free_block(blocks, when):
    """malloc grows a free block into the unmapped span after it; the block
    before the free one dies meanwhile (and one in the small pool)."""
    blocks.keep(2 * MiB)
    blocks.victim(3 * MiB, "map_pages")
    blocks.hole(3 * MiB)
    blocks.victim(4096, "map_pages", raw=True)
    blocks.free_holes()
    blocks.arm(when)
    blocks.adopt(blocks.core.allocate(5 * MiB), 5 * MiB)


def reserving_a_new_range(blocks, when):
    """The first large block of stream 1 reserves its range; a block of
    stream 0 and one of stream 1's small pool die meanwhile."""
    blocks.victim(3 * MiB, "reserve_address_range")
    blocks.hole(3 * MiB)
    blocks.keep(2 * MiB)
    blocks.victim(4096, "reserve_address_range", stream=1, raw=True)
    blocks.free_holes()
    blocks.arm(when)
    blocks.adopt(blocks.core.allocate(4 * MiB, 1), 4 * MiB)


def releasing_an_empty_range(blocks, when):
    """empty_virt_addr_cache() gives back stream 1's empty range; a block of
    stream 0 and one of stream 1's small pool die meanwhile."""
    blocks.victim(3 * MiB, "release_address_range")
    blocks.hole(3 * MiB)
    blocks.keep(2 * MiB)
    blocks.hole(4 * MiB, stream=1)
    blocks.victim(4096, "release_address_range", stream=1, raw=True)
    blocks.free_holes()
    blocks.core.empty_cache()
    blocks.arm(when)
    blocks.core.empty_virt_addr_cache()


def retrying_a_malloc_on_a_full_device(blocks, when):
    """A malloc finds the (simulated) device full; the retry unmaps the free
    pages and releases stream 1's emptied range, and blocks die in both."""
    blocks.victim(60 * MiB, "unmap_pages")
    blocks.hole(60 * MiB)
    blocks.victim(60 * MiB, "release_address_range", raw=True)
    blocks.keep(30 * MiB)
    blocks.hole(40 * MiB, stream=1)
    blocks.free_holes()
    blocks.arm(when)
    blocks.adopt(blocks.core.allocate(100 * MiB), 100 * MiB)
    assert blocks.core.memory_stats()["num_alloc_retries"] == 1


CASES = {f.__name__: f for f in (unmapping_a_free_block, mapping_after_a_free_block, reserving_a_new_range,
                                 releasing_an_empty_range, retrying_a_malloc_on_a_full_device)}


def scenario(kind, case, when):
    """Run in the child process: ``case`` over a ``kind`` backend; prints PASSED."""
    seen = []
    sys.unraisablehook = lambda info: seen.append(f"{info.exc_type.__name__}: {info.exc_value}")
    blocks = Blocks(kind)
    CASES[case](blocks, when)
    print(f"{case} returned")
    assert not seen, f"a finalizer's free failed: {seen}"
    blocks.check()
    blocks.drain()
    assert not seen, f"a finalizer's free failed: {seen}"
    print("PASSED")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind, case", [(kind, case) for case in CASES for kind in ("simulated", "host")
                                        if (kind, case) != ("host", "retrying_a_malloc_on_a_full_device")])
def test_a_collection_inside_a_virtual_memory_callback(kind, case, when):
    here = os.path.dirname(os.path.abspath(__file__))
    run_python(f"import test_expandable_reentry as t; t.scenario({kind!r}, {case!r}, {when!r})",
               env={"PYTHONPATH": here})


def test_an_allocation_collected_with_a_garbage_cycle_frees_its_block():
    """Found while writing the tests above: when
    the collector finds an Allocation in a garbage cycle, it may clear the
    Allocation (Cython's tp_clear sets ``allocator`` to None) before it is
    deallocated; ``__dealloc__`` then frees nothing, and the block stays live
    for good, with no warning. Which happens depends on the order the
    collector clears in, so both orders of making are tried."""
    class Node:                     # no finalizer: the collector alone decides
        pass

    core = _core.CachingAllocator(SimulatedBackend(capacity=CAPACITY), 0)
    for allocation_first in (True, False):
        first = core.allocate(1000) if allocation_first else Node()
        second = Node() if allocation_first else core.allocate(1000)
        node, handle = (second, first) if allocation_first else (first, second)
        node.me, node.handle = node, handle
        del first, second, node, handle
        gc.collect()
        assert core.live_allocations() == {}, \
            f"made {'before' if allocation_first else 'after'} the cycle: the block was never freed"


ALLOCATION_DURING_THE_GROWTH_OF_A_FREE_BLOCK = """
from unimem import _core
from unimem.backends.simulated import SimulatedBackend
MiB = 1 << 20

class MapHook(SimulatedBackend):
    hook = None

    def map_pages(self, address, size, device):
        super().map_pages(address, size, device)
        hook, MapHook.hook = MapHook.hook, None
        if hook:
            hook()

backend = MapHook(1 << 30, granularity=2 * MiB)
a = _core.CachingAllocator(backend, 0, expandable_segments=True)
A = a.malloc(2 * MiB); H = a.malloc(4 * MiB); B = a.malloc(2 * MiB)
assert H == A + 2 * MiB and B == A + 6 * MiB
a.free(H); a.empty_cache()                 # [A][4 MiB unmapped][B live][end]
a.free(A)                                  # [A free][hole][B live]
stolen = []
MapHook.hook = lambda: stolen.append(a.malloc(2 * MiB))    # what a finalizer may do
big = a.malloc(6 * MiB)                    # grows A over the hole: the map runs the hook, which takes A
a._check_invariants()
assert stolen and not (big <= B < big + 6 * MiB) and not (big <= stolen[0] < big + 6 * MiB), \\
    (hex(big), hex(B), [hex(p) for p in stolen])
for p in stolen + [big]:
    a.free(p)
again = a.malloc(8 * MiB)
assert not (again <= B < again + 8 * MiB), "the live block was handed out again"
a._check_invariants()
a.free(again); a.free(B); a.empty_cache()
assert a.memory_stats()["reserved_bytes.all.current"] == 0
print("PASSED")
"""


def test_an_allocation_taking_the_free_block_a_request_grows_sends_the_request_elsewhere():
    """A request that grows a free block over the unmapped space after it maps
    the pages, running the backend; a re-entered allocation (a finalizer)
    took that free block, and the request went on \"mapping\" the next block,
    a live one: the map was refused (a spurious error), the live block was
    marked free, and a later call crashed (SIGSEGV). The request now looks
    for its place again."""
    run_python(ALLOCATION_DURING_THE_GROWTH_OF_A_FREE_BLOCK)
