"""The core against a plain-Python model of the policy (hypothesis, stateful).

After every step: the core handed out the same address the model did, live
blocks never overlap, and every statistic equals the model's. At the end,
freeing everything and emptying the cache gives all memory back.
"""
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, Bundle, consumes

from tests.helpers.model import ModelAllocator, ModelOOM
from unimem import OutOfMemoryError, _core
from unimem.backends.faults import FaultInjectingBackend
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
CAPACITY = 256 * MiB

# Sizes that exercise both pools, the 1 MiB / 10 MiB boundaries and large segments.
sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(1, 1 * MiB + 1024),
    st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB - 1, 10 * MiB, 19 * MiB, 20 * MiB]),
    st.integers(1 * MiB, 40 * MiB),
    st.integers(200 * MiB, 300 * MiB),    # sometimes more than fits: OOM paths
)


class CoreMatchesModel(RuleBasedStateMachine):
    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.backend = SimulatedBackend(capacity=CAPACITY)
        self.core = _core.CachingAllocator(self.backend, 0)
        self.core.set_capacity(CAPACITY)
        self.model = ModelAllocator(CAPACITY)
        self.live = {}   # ptr -> size handed out

    @rule(target=blocks, size=sizes)
    def malloc(self, size):
        return self.malloc_both(size, 0)

    def malloc_both(self, size, stream):
        """The same request to the core and the model: the same address, or
        out-of-memory on both."""
        try:
            expected = self.model.malloc(size, stream)
        except ModelOOM:
            try:
                self.core.malloc(size, stream)
            except OutOfMemoryError:
                return None
            raise AssertionError(f"the core served {size} bytes the model could not")
        got = self.core.malloc(size, stream)
        assert got == expected, f"malloc({size}, stream {stream}): core {got:#x}, model {expected:#x}"
        if got:
            self.live[got] = self.core.round_size(size)
        return got or None

    @rule(ptr=consumes(blocks))
    def free(self, ptr):
        if ptr is None:
            return
        self.core.free(ptr)
        self.model.free(ptr)
        del self.live[ptr]

    @rule()
    def empty_cache(self):
        self.core.empty_cache()
        self.model.empty_cache()

    @rule()
    def reset_peak(self):
        self.core.reset_peak_stats()
        self.model.reset_peak()

    @rule()
    def reset_accumulated(self):
        self.core.reset_accumulated_stats()
        self.model.reset_accumulated()

    @invariant()
    def statistics_match(self):
        core = dict(self.core.memory_stats())
        assert core == self.model.memory_stats()
        for key, value in core.items():
            if key.endswith(".current"):
                assert core[key[:-len("current")] + "peak"] >= value

    @invariant()
    def live_blocks_do_not_overlap(self):
        spans = sorted(self.live.items())
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b, f"blocks at {a:#x} (+{size}) and {b:#x} overlap"

    @invariant()
    def internal_structure_is_consistent(self):
        self.core._check_invariants()

    def teardown(self):
        for ptr in list(self.live):
            self.core.free(ptr)
        self.core.empty_cache()
        assert self.core.memory_stats()["reserved_bytes.all.current"] == 0
        assert self.backend.held() == 0


CoreMatchesModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCoreMatchesModel = CoreMatchesModel.TestCase


class CoreMatchesModelWithReservedRatio(CoreMatchesModel):
    """The same, with unimem's max_reserved_ratio policy on."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.backend = SimulatedBackend(capacity=CAPACITY)
        self.core = _core.CachingAllocator(self.backend, 0, max_reserved_ratio=1.1)
        self.core.set_capacity(CAPACITY)
        self.model = ModelAllocator(CAPACITY, max_reserved_ratio=1.1)
        self.live = {}


CoreMatchesModelWithReservedRatio.TestCase.settings = CoreMatchesModel.TestCase.settings
TestCoreMatchesModelWithReservedRatio = CoreMatchesModelWithReservedRatio.TestCase


class CoreMatchesModelWithMaxSplitSize(CoreMatchesModel):
    """max_split_size set: oversize blocks (never split, taken only by a
    request that wastes little), the oversize_allocations/oversize_segments
    counts across resets, and the release of cached oversize segments
    (PyTorch's release_available_cached_blocks) before the full flush, on
    two streams."""

    MAX_SPLIT = 24 * MiB

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.backend = SimulatedBackend(capacity=CAPACITY)
        self.core = _core.CachingAllocator(self.backend, 0, max_split_size=self.MAX_SPLIT)
        self.core.set_capacity(CAPACITY)
        self.model = ModelAllocator(CAPACITY, max_split_size=self.MAX_SPLIT)
        self.live = {}

    @rule(target=CoreMatchesModel.blocks, stream=st.sampled_from([0, 0, 7]), size=st.one_of(
        sizes, st.sampled_from([MAX_SPLIT - 1, MAX_SPLIT, MAX_SPLIT + 1, 2 * MAX_SPLIT])))
    def malloc_on_stream(self, size, stream):
        return self.malloc_both(size, stream)


CoreMatchesModelWithMaxSplitSize.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCoreMatchesModelWithMaxSplitSize = CoreMatchesModelWithMaxSplitSize.TestCase


class CoreMatchesModelWithExpandableSegments(CoreMatchesModel):
    """expandable_segments:True: ranges reserved per stream and pool, pages
    mapped and unmapped (in the middle of a range too), ranges released,
    out-of-memory while mapping (the capacity, or a refusal injected by the
    fault injector), every statistic and every address compared with the
    model. Both pools map 2 MiB pages (or ``GRANULARITY`` bytes if larger)."""

    GRANULARITY = 2 * MiB

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.backend = SimulatedBackend(capacity=CAPACITY, granularity=self.GRANULARITY)
        self.faults = FaultInjectingBackend(self.backend)
        self.core = _core.CachingAllocator(self.faults, 0, expandable_segments=True)
        self.core.set_capacity(CAPACITY)
        self.model = ModelAllocator(CAPACITY, expandable_segments=True, granularity=self.GRANULARITY)
        self.live = {}

    @rule(target=CoreMatchesModel.blocks, size=sizes, stream=st.sampled_from([0, 0, 7]))
    def malloc_on_stream(self, size, stream):
        return self.malloc_both(size, stream)

    @rule(count=st.integers(1, 2))
    def refuse_next_maps(self, count):
        self.faults.refuse_next(count)
        self.model.refuse_next += count

    @rule()
    def empty_virt_addr_cache(self):
        self.core.empty_virt_addr_cache()
        self.model.empty_virt_addr_cache()

    @invariant()
    def memory_and_ranges_match(self):
        assert self.backend.held() == self.core.memory_reserved() == self.model.used
        assert self.core.reserved_address_space()["ranges"] == self.model.reserved_ranges()
        assert len(self.backend.ranges[0]) == self.model.reserved_ranges()
        assert all(s["is_expandable"] for s in self.core.snapshot())

    def teardown(self):
        self.faults.refuse_next(-self.faults._refuse_next)     # no refusal left over
        super().teardown()
        self.core.empty_virt_addr_cache()
        assert self.backend.reserved() == 0 and not self.backend.mapped_pages[0]


CoreMatchesModelWithExpandableSegments.TestCase.settings = CoreMatchesModel.TestCase.settings
TestCoreMatchesModelWithExpandableSegments = CoreMatchesModelWithExpandableSegments.TestCase


class CoreMatchesModelWithSmallPages(CoreMatchesModelWithExpandableSegments):
    """The same with 64 KiB pages: ranges are reserved by them, while both
    pools still map by 2 MiB (PyTorch maps its small pool by kSmallBuffer)."""

    GRANULARITY = 64 << 10


CoreMatchesModelWithSmallPages.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCoreMatchesModelWithSmallPages = CoreMatchesModelWithSmallPages.TestCase
