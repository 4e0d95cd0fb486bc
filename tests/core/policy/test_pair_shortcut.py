"""The alloc/free pair of one size, undone and redone without the free index
(unimem/_core_pair.pxi): it must change nothing anyone can see.

The shortcut is taken only while nothing else happens between a cache hit's
split, the free of that block and the next request of its size, so the
machine below checks nothing between its steps (a check takes the lock, and
the lock does the merge that was put off). It runs the same operations on two
allocators: one as it is, one with a history hook installed, which turns the
shortcut off. Both must hand out the same addresses, keep the same statistics
and show the same segments.
"""
import gc

from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, rule

from unimem import OutOfMemoryError, _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
CAPACITY = 256 * MiB

sizes = st.one_of(
    st.sampled_from([512, 4096, 4097, 65536, 1 * MiB, 1 * MiB + 1, 3 * MiB, 12 * MiB]),
    st.integers(1, 2 * MiB),
    st.integers(1, 30 * MiB),
)
streams = st.sampled_from([0, 7])


def _segments(core):
    return [(s["address"], s["total_size"], s["stream"],
             [(b["address"], b["size"], b["state"]) for b in s["blocks"]])
            for s in core.snapshot()]


class ShortcutChangesNothing(RuleBasedStateMachine):
    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.backends = [SimulatedBackend(capacity=CAPACITY), SimulatedBackend(capacity=CAPACITY)]
        self.fast, self.reference = (_core.CachingAllocator(b, 0) for b in self.backends)
        self.reference.set_trace_hook(lambda events: None)

    def _both(self, call):
        results = []
        for core in (self.fast, self.reference):
            try:
                results.append(call(core))
            except OutOfMemoryError:
                results.append("oom")
        assert results[0] == results[1], f"shortcut {results[0]!r}, reference {results[1]!r}"
        return results[0]

    @rule(target=blocks, size=sizes, stream=streams)
    def malloc(self, size, stream):
        got = self._both(lambda core: core.malloc(size, stream))
        return None if got in (0, "oom") else got

    @rule(ptr=consumes(blocks))
    def free(self, ptr):
        if ptr is not None:
            self._both(lambda core: core.free(ptr))

    @rule(size=sizes, stream=streams, times=st.integers(1, 4))
    def pairs(self, size, stream, times):
        """The loop the shortcut is for: allocate and free one size again and again."""
        for _ in range(times):
            ptr = self._both(lambda core: core.malloc(size, stream))
            if ptr in (0, "oom"):
                return
            self._both(lambda core: core.free(ptr))

    @rule()
    def empty_cache(self):
        self._both(lambda core: core.empty_cache())

    @rule()
    def statistics_and_segments_match(self):
        assert self.fast.memory_stats() == self.reference.memory_stats()
        assert _segments(self.fast) == _segments(self.reference)
        self.fast._check_invariants()

    def teardown(self):
        self.statistics_and_segments_match()


ShortcutChangesNothing.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestShortcutChangesNothing = ShortcutChangesNothing.TestCase


def _pair_then_free_left_unmerged(size=4096):
    """An allocator whose last call freed a block split off a 2 MiB segment
    (the shortcut's state: the merge with the rest of the segment put off)."""
    backend = SimulatedBackend(capacity=CAPACITY)
    core = _core.CachingAllocator(backend, 0)
    core.free(core.malloc(size))      # a miss: a new segment, split
    core.free(core.malloc(size))      # a cache hit: split, then freed
    return backend, core


def test_a_snapshot_after_the_pair_shows_the_segment_whole():
    _, core = _pair_then_free_left_unmerged()
    [segment] = core.snapshot()
    assert [(b["size"], b["state"]) for b in segment["blocks"]] == [(2 * MiB, "inactive")]
    assert core.free_block_count() == 1


def test_empty_cache_after_the_pair_gives_the_segment_back():
    backend, core = _pair_then_free_left_unmerged()
    core.empty_cache()
    assert core.memory_reserved() == 0
    assert backend.held() == 0


def test_an_allocator_dropped_after_the_pair_gives_its_segment_back():
    backend, core = _pair_then_free_left_unmerged()
    del core
    gc.collect()
    assert backend.held() == 0


def test_the_pair_keeps_pytorchs_statistics():
    """The statistics a free does at once, though the merge waits: the
    freed block and the rest of its segment are one inactive block again."""
    _, core = _pair_then_free_left_unmerged()
    stats = core.memory_stats()
    assert stats["inactive_split.all.current"] == 0
    assert stats["inactive_split_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == 0
    ptr = core.malloc(4096)
    stats = core.memory_stats()
    assert stats["inactive_split.small_pool.current"] == 1
    assert stats["inactive_split_bytes.small_pool.current"] == 2 * MiB - 4096
    assert stats["allocation.all.allocated"] == 3
    core.free(ptr)


def test_another_size_after_the_pair_sees_the_merged_block():
    """A request of another size takes the merged block's front, as the
    best fit over a merged index does (lowest address of the smallest fit)."""
    _, core = _pair_then_free_left_unmerged(4096)
    first = core.malloc(8192)
    assert core.snapshot()[0]["address"] == first
    core.free(first)


def test_the_pair_on_another_stream_does_not_take_the_unmerged_block():
    _, core = _pair_then_free_left_unmerged(4096)
    other = core.malloc(4096, 7)
    assert core.snapshot()[0]["stream"] == 0
    assert len(core.snapshot()) == 2 and other != core.snapshot()[0]["address"]
    core.free(other)


class _RunsPythonInMalloc(SimulatedBackend):
    """A backend whose malloc runs a callback first, under the allocator's lock."""
    callback = None

    def malloc(self, size, device=0, stream=0):
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()
        return super().malloc(size, device, stream)


def _nested_hit_then_pair(shortcut):
    """A cache hit made inside the backend call of an outer miss, whose new
    segment then adds a smaller free block to the index; then that hit's
    block is freed and its size asked for again."""
    backend = _RunsPythonInMalloc(capacity=CAPACITY)
    core = _core.CachingAllocator(backend, 0)
    if not shortcut:
        core.set_trace_hook(lambda events: None)
    first, second, third = core.malloc(MiB), core.malloc(512 << 10), core.malloc(512 << 10)
    nested = {}

    def inside():
        core.free(first)
        core.free(second)                       # 1.5 MiB free
        nested["ptr"] = core.malloc(4096)       # a hit at lock depth 2
    backend.callback = inside
    outer = core.malloc(MiB)                    # the miss: a new segment, 1 MiB of it free
    core.free(nested["ptr"])
    again = core.malloc(4096)                   # best fit: the new segment's 1 MiB
    return again, dict(core.memory_stats()), _segments(core), (outer, third)


def test_a_hit_made_inside_a_backend_call_is_not_taken_back_past_a_better_fit():
    assert _nested_hit_then_pair(True)[:3] == _nested_hit_then_pair(False)[:3]
