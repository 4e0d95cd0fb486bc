"""The timeline that ``view`` and ``plot`` draw (unimem/_observe/timeline.py):
its bands against a plain recomputation, and the bound on its work."""
import random

import pytest
from hypothesis import example, given, settings, strategies as st

from unimem._observe import timeline as timeline_module
from unimem._observe.timeline import Timeline


def snapshot_of(events, live=()):
    """A snapshot with ``events`` as device 0's trace; ``live``: the
    (address, size) blocks of a segment still active at the end."""
    blocks = [{"address": addr, "size": size, "state": "active_allocated"} for addr, size in live]
    total = sum(size for _, size in live)
    return {"segments": [{"device": 0, "address": min(a for a, _ in live), "total_size": total, "blocks": blocks}]
            if blocks else [], "device_traces": [events]}


def random_trace(rng, n, before=0):
    """Allocations and frees in random order; ``before`` bytes allocated
    before the recording, freed in the trace by two frees. Returns the
    events and the (address, size) blocks live at the end."""
    events, live, t = [], [], 0
    pre = [(1 << 40, before // 2), ((1 << 40) + 4096, before - before // 2)] if before else []
    for _ in range(n):
        t += 1
        if pre and rng.random() < 0.05:
            addr, size = pre.pop()
            events.append({"action": "free_completed", "addr": addr, "size": size, "time_us": t})
        elif live and rng.random() < 0.45:
            addr, size = live.pop(rng.randrange(len(live)))
            events.append({"action": "free_completed", "addr": addr, "size": size, "time_us": t})
        else:
            addr, size = 4096 * (len(events) + 1), rng.choice((512, 1024, 4096, 1 << 20))
            live.append((addr, size))
            events.append({"action": "alloc", "addr": addr, "size": size, "time_us": t, "frames": []})
    return events, live + pre


def reference_bottoms(events, base):
    """Each allocation's bottom after each event, by the plain O(n^2) sweep:
    (event index of its alloc) -> [(time, bottom)] whenever it moved."""
    live, steps = [], {}
    for i, e in enumerate(events):
        t = (e["time_us"] - events[0]["time_us"]) / 1e6
        moved_from = None
        if e["action"] == "alloc":
            live.append((i, e["addr"], e["size"]))
            steps[i] = []
            moved_from = len(live) - 1
        else:
            position = next((k for k, b in enumerate(live) if b[1] == e["addr"]), None)
            if position is None:
                base -= e["size"]
                moved_from = 0
            else:
                live.pop(position)
                moved_from = position
        y = base
        for position, (first, _, size) in enumerate(live):
            if position >= moved_from and (not steps[first] or steps[first][-1][1] != y):
                steps[first].append((t, y))
            y += size
    return steps


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 120), before=st.sampled_from([0, 3 << 20]))
@example(seed=21012201, n=1, before=3 << 20)    # the peak before the first event
def test_every_band_is_where_the_plain_sweep_puts_it(seed, n, before):
    events, live_at_end = random_trace(random.Random(seed), n, before)
    tl = Timeline(snapshot_of(events, live_at_end), 0)
    expected = reference_bottoms(events, before)
    bands = {band["first"]: band for band in tl.bands}
    assert len(tl.tracked_bands) == len(tl.bands)          # a short trace: every allocation has its band
    for first, steps in expected.items():
        got = [(t, y) for t, y in bands[first]["steps"]]
        # the plain sweep skips a step that does not move; the new one never records one
        assert [y for _, y in got] == [y for _, y in steps]
        assert [t for t, _ in got] == pytest.approx([t for t, _ in steps])
    live = {e["addr"]: e["size"] for e in events if e["action"] == "alloc"}
    peak_time = tl.peak[1]
    at_peak = sum(b["size"] for b in tl.live_at_peak)
    # the peak is the highest level drawn: after an event, or before the first
    # (memory from before the recording that its first events free)
    assert max(tl.active_steps()[1]) == tl.peak[0] >= at_peak
    assert tl.peak[0] in ((tl.active[peak_time], tl.active_at_start) if peak_time == 0 else (tl.active[peak_time],))
    assert set(b["addr"] for b in tl.live_at_peak) <= set(live)


def test_a_trace_that_frees_its_oldest_first_stays_within_the_step_budget(monkeypatch):
    """Allocations freed oldest first move every band at every free:
    recording all of them took minutes and GiBs (8,000 of them: view 38 s
    and 3.4 GB, plot 167 s and 20 GB). The bands tracked are cut to the
    budget."""
    monkeypatch.setattr(timeline_module, "STEP_BUDGET", 50_000)
    n = 3000
    events = [{"action": "alloc", "addr": 4096 * (k + 1), "size": 512, "time_us": k, "frames": []}
              for k in range(n)]
    events += [{"action": "free_completed", "addr": 4096 * (k + 1), "size": 512, "time_us": n + k}
               for k in range(n)]
    tl = Timeline(snapshot_of(events), 0, tracked=2000)
    steps = sum(len(b["steps"]) for b in tl.bands)
    assert 0 < len(tl.tracked_bands) <= 2000
    assert steps <= 50_000
    assert max(tl.active) == tl.peak[0] == n * 512 and tl.active[-1] == 0
    assert len(tl.live_at_peak) == n
    # the bands tracked are where the plain sweep puts them
    expected = reference_bottoms(events, 0)
    for band in tl.tracked_bands:
        assert [y for _, y in band["steps"]] == [y for _, y in expected[band["first"]]]


def test_the_largest_allocations_get_bands_first():
    events = [{"action": "alloc", "addr": 4096 * (k + 1), "size": 512 * (k % 7 + 1), "time_us": k,
               "frames": []} for k in range(100)]
    tl = Timeline(snapshot_of(events), 0, tracked=10)
    sizes = sorted((b["size"] for b in tl.bands), reverse=True)
    assert sorted(b["size"] for b in tl.tracked_bands) == sorted(sizes[:10])


def test_rounded_blocks_of_recorded_allocations_are_not_memory_from_before_the_recording():
    """The trace records requests, the segments rounded blocks: 4,000 live
    1-byte requests in 512-byte blocks, recorded from the first, counted
    1,996 KiB of their rounding as allocated before the recording."""
    events = [{"action": "alloc", "addr": 512 * (k + 1), "size": 1, "time_us": k, "frames": []}
              for k in range(4000)]
    before = [((1 << 30), 4096)]                       # one block from before the recording, still live
    tl = Timeline(snapshot_of(events, [(512 * (k + 1), 512) for k in range(4000)] + before), 0)
    assert tl.base_steps[0][1] == 4096
    assert tl.peak[0] == 4096 + 4000


def test_a_real_history_counts_only_what_was_live_before_it():
    """The same through the allocator: 100 1-byte requests recorded, on top
    of what the cpu pool already held (other tests' blocks, if any)."""
    import unimem
    api = unimem.cpu
    held_before = api.memory_allocated()
    api._record_memory_history(max_entries=10_000)
    held = []
    try:
        held = [api.caching_allocator_alloc(1) for _ in range(100)]
        tl = Timeline(api._snapshot(), 0)
        assert tl.base_steps[0][1] == held_before
        assert tl.peak[0] == held_before + 100
    finally:
        for p in held:
            api.caching_allocator_delete(p)
        api._record_memory_history(None)


def test_a_snapshot_whose_blocks_have_no_addresses_falls_back_to_the_difference_of_totals():
    """Blocks without addresses (a hand-made or older snapshot): what was
    live before is the live block bytes less the requests still open."""
    events = [{"action": "alloc", "addr": 4096 * (k + 1), "size": 1000, "time_us": k, "frames": []}
              for k in range(3)]
    snapshot = {"segments": [{"device": 0, "address": 0, "total_size": 1 << 20,
                              "blocks": [{"size": 1024, "state": "active_allocated"}] * 3
                              + [{"size": 8192, "state": "active_allocated"},
                                 {"size": 4096, "state": "inactive"}]}],
                "device_traces": [events]}
    tl = Timeline(snapshot, 0)
    assert tl.base_steps[0][1] == 3 * 1024 + 8192 - 3 * 1000


def test_a_file_name_shared_by_every_frame_is_looked_at_once(monkeypatch):
    """A snapshot may share one long file name among all its frames (the
    pickle memo): each allocation split the whole name again (a 1 MiB name,
    2,000 allocations: a minute per view or plot). Which folder a name is
    in is decided once per name now; counted here, not timed."""
    looked_at = []
    real = timeline_module.is_unimem_code

    def counting(filename):
        looked_at.append(len(filename))
        return real(filename)
    monkeypatch.setattr(timeline_module, "is_unimem_code", counting)
    timeline_module._is_library_code.cache_clear()
    frames = [{"filename": "/a" * 50_000, "line": 1, "name": "f"}]
    events = []
    for i in range(2000):
        events.append({"action": "alloc", "addr": 512 * i, "size": 512, "time_us": 2 * i, "frames": frames})
        events.append({"action": "free_completed", "addr": 512 * i, "size": 512, "time_us": 2 * i + 1})
    sites = {timeline_module.allocation_site(e["frames"]) for e in events if e["action"] == "alloc"}
    Timeline(snapshot_of(events), 0)
    assert sites == {"a:1 f"}
    assert len(looked_at) == 1, f"the name was looked at {len(looked_at)} times"


def test_the_level_before_the_first_event_counts_for_the_peak():
    """64 MiB allocated before the recording and freed by its first event,
    then 1 MiB: the timeline's peak (the report's "peak active", the plot's
    marker) was 1 MiB, where the summary on the same page says 64 MiB, and
    its lines started after the free."""
    MiB = 1 << 20
    events = [{"action": "free_completed", "addr": 1 << 30, "size": 64 * MiB, "time_us": 10},
              {"action": "alloc", "addr": 1 << 31, "size": MiB, "time_us": 20, "frames": []}]
    segments = [{"device": 0, "address": 1 << 31, "total_size": 2 * MiB,
                 "blocks": [{"address": 1 << 31, "size": MiB, "state": "active_allocated"},
                            {"address": (1 << 31) + MiB, "size": MiB, "state": "inactive"}]}]
    tl = Timeline({"segments": segments, "device_traces": [events]}, 0)
    assert tl.peak[0] == 64 * MiB
    assert tl.live_at_peak == []                  # nothing the trace allocated was live then
    times, active = tl.active_steps()
    assert active == [64 * MiB, 0, MiB] and times[0] == times[1]
    assert tl.reserved_steps()[1][0] == 2 * MiB
