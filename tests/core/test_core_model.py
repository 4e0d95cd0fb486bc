"""The core against a plain-Python model of the policy (hypothesis, stateful).

After every step: the core handed out the same address the model did, live
blocks never overlap, and every statistic equals the model's. At the end,
freeing everything and emptying the cache gives all memory back.
"""
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, Bundle, consumes

from tests.helpers.model import ModelAllocator, ModelOOM
from unimem import OutOfMemoryError, _core
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
        try:
            expected = self.model.malloc(size)
        except ModelOOM:
            try:
                self.core.malloc(size)
            except OutOfMemoryError:
                return None
            raise AssertionError(f"the core served {size} bytes the model could not")
        got = self.core.malloc(size)
        assert got == expected, f"malloc({size}): core {got:#x}, model {expected:#x}"
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
