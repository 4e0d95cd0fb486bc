"""A malloc re-entered from the backend's ``map_pages`` that runs out of
memory, while the outer request's span is being mapped (the malloc's side
of test_expandable_reentry.py's re-entered frees).

``_map_block`` marks the span it maps as handed out while ``map_pages`` runs
(Python: a garbage collection in it runs finalizers, and those may allocate).
A re-entered request that runs out of memory retries after giving memory
back: ``_unmap_free_pages`` and ``_release_empty_ranges``. Both ignored the
mark: the first merged the span being mapped into an unmapped neighbour and
deleted its Block (the outer map then wrote to freed memory: SIGSEGV), the
second released the range whose only span was being mapped (the outer map
then mapped into address space no longer reserved).

Each scenario runs in a child process (a crash is a failed test). After the
outer request: it got its block or an OutOfMemoryError, the core's invariants
hold, and after freeing everything nothing is reserved or mapped.
"""
import pytest

from tests.helpers.crash_guard import run_python

SCENARIO = """
from unimem._core import CachingAllocator, OutOfMemoryError
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend
MiB = 1 << 20

class Backend({base}):
    hook = None
    def map_pages(self, address, size, device):
        hook, self.hook = self.hook, None
        if hook:
            hook()
        return super().map_pages(address, size, device)

if {base} is SimulatedBackend:
    backend = Backend(capacity=64 * MiB)
    core = CachingAllocator(backend, 0, expandable_segments=True)
else:                      # real mmap'ed ranges: a released range's addresses are reused at once
    backend = Backend("CPU")
    core = CachingAllocator(backend, 0, expandable_segments=True)
    core.set_memory_limit(64 * MiB)
live = []
inner_ooms = []

def reentered(size, stream):
    def hook():
        try:
            live.append(core.malloc(size, stream))
        except OutOfMemoryError:
            inner_ooms.append(size)
    return hook

{setup}
try:
    live.append(core.malloc({outer_size}, {outer_stream}))
    outcome = "served"
except OutOfMemoryError:
    outcome = "out of memory"
core._check_invariants()
assert inner_ooms, "the re-entered request was to run out of memory"
assert outcome == "served", outcome
for ptr in live:
    core.free(ptr)
core.empty_cache()
core.empty_virt_addr_cache()
core._check_invariants()
stats = core.memory_stats()
assert stats["reserved_bytes.all.current"] == 0, stats["reserved_bytes.all.current"]
assert {base} is not SimulatedBackend or backend.used == [0], backend.used
assert core.reserved_address_space()["ranges"] == 0
print("PASSED")
"""

CASES = {
    # The outer request is the first of its stream: a new range whose only span
    # is being mapped. The re-entered retry released that range.
    "the range being mapped": dict(
        setup="live.append(core.malloc(30 * MiB, 1))\nbackend.hook = reentered(40 * MiB, 1)",
        outer_size="20 * MiB", outer_stream=2),
    # The same on host memory, where another new range (of stream 3, made by
    # a second re-entered request) took the released range's addresses.
    "the range being mapped, its addresses reused": dict(
        setup=("live.append(core.malloc(30 * MiB, 1))\n"
               "first, second = reentered(40 * MiB, 1), reentered(4 * MiB, 3)\n"
               "backend.hook = lambda: (first(), second())"),
        outer_size="20 * MiB", outer_stream=2),
    # A free block followed by unmapped space: the outer request extends it by
    # mapping the span after it. The re-entered retry unmapped the free block and
    # merged the span being mapped into it (SIGSEGV).
    "the span being mapped": dict(
        setup=("live.append(core.malloc(4 * MiB))\nfreed = core.malloc(4 * MiB)\ncore.free(freed)\n"
               "live.append(core.malloc(30 * MiB, 1))\nbackend.hook = reentered(34 * MiB, 1)"),
        outer_size="8 * MiB", outer_stream=0),
}


@pytest.mark.parametrize("base", ["SimulatedBackend", "PageAlignedBackend"])
@pytest.mark.parametrize("case", CASES)
def test_a_malloc_reentered_from_map_pages_that_runs_out_of_memory(case, base):
    run_python(SCENARIO.format(base=base, **CASES[case]))


def test_a_span_whose_map_fails_joins_the_neighbour_a_re_entered_call_unmapped():
    """The outer request maps a free block's hole and the
    unmapped span after it; the re-entered request unmaps the free block to
    stay under the ratio (it cannot merge with the span being mapped), then
    the outer map fails for want of memory. The two unmapped spans stayed
    apart ("unmapped spans merge"), and the range was never released."""
    from unimem import OutOfMemoryError
    from unimem._core import CachingAllocator
    from unimem.backends.simulated import SimulatedGPU
    MiB = 1 << 20

    class GPU(SimulatedGPU):
        hook = None

        def map_pages(self, address, size, device):
            hook, self.hook = self.hook, None
            if hook:
                hook()
            super().map_pages(address, size, device)

    gpu = GPU(capacity=11 * MiB)
    core = CachingAllocator(gpu, 0, expandable_segments=True, max_reserved_ratio=1.0)
    core.set_capacity(11 * MiB)
    first, hole, gap, last = (core.malloc(n * MiB) for n in (2, 2, 4, 2))
    core.free(gap)
    core.empty_cache()                          # [first][hole][4 MiB unmapped][last]
    core.free(hole)
    got = []
    gpu.hook = lambda: got.append(core.malloc(6 * MiB))    # unmaps hole's pages, maps 6 MiB at the end
    with pytest.raises(OutOfMemoryError):
        core.malloc(4 * MiB)                    # hole + 2 MiB of the span after it
    assert len(got) == 1
    core._check_invariants()
    for ptr in [first, last] + got:
        core.free(ptr)
    core.empty_cache()
    core.empty_virt_addr_cache()
    core._check_invariants()
    assert core.memory_reserved() == 0 and not gpu.mapped_pages[0]
    assert core.reserved_address_space()["ranges"] == 0

