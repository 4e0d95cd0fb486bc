"""The core's rule: nothing that can run Python or wait runs while its lock is
held. The probe: while a backend call (or a hook) runs, another thread asks
the same allocator for a block its cache already holds; it must get it before
the call returns. Waits too: empty_cache waits for an
XPU queue's events without the lock, which a dpctl host task queued before
them needs (in a subprocess: a hang fails the test, not the suite)."""
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

from tests.helpers.fresh import run_within_timeout

MiB = 1 << 20
GiB = 1 << 30
WAIT_S = 5.0


class Probe:
    """Run ``action`` once, from inside the next probed callback; by default
    a cache hit on another thread, noting whether it was served before the
    callback returned."""

    def __init__(self, action=None):
        self.allocator = None
        self.armed = False
        self.outcomes = []
        self.blocked = []
        self.action = action or self.hit_on_another_thread

    def __call__(self):
        if self.armed:
            self.armed = False
            self.action()

    def on_another_thread(self, work):
        done = []
        t = threading.Thread(target=lambda: (work(), done.append(True)), daemon=True)
        t.start()
        t.join(WAIT_S)                          # lets the GIL go meanwhile
        self.outcomes.append(bool(done))
        if not done:                            # it waits for the lock: joined at the end
            self.blocked.append(t)

    def hit_on_another_thread(self):
        self.on_another_thread(lambda: self.allocator.free(self.allocator.malloc(512)))


class ProbingBackend(SimulatedBackend):
    def __init__(self, probe, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe = probe
        self.probe_in = set()

    def malloc(self, size, device=0, stream=0):
        if "malloc" in self.probe_in:
            self.probe()
        return super().malloc(size, device, stream)

    def free(self, ptr, size, device=0, stream=0):
        if "free" in self.probe_in:
            self.probe()
        return super().free(ptr, size, device, stream)

    def record_event(self, stream, device):
        if "record_event" in self.probe_in:
            self.probe()
        return super().record_event(stream, device)

    def event_done(self, event):
        if "event_done" in self.probe_in:
            self.probe()
        return super().event_done(event)

    def event_synchronize(self, event):
        if "event_synchronize" in self.probe_in:
            self.probe()
        return super().event_synchronize(event)

    def check_stream(self, stream, device):
        if "check_stream" in self.probe_in:
            self.probe()

    def release_stream(self, stream, device):
        if "release_stream" in self.probe_in:
            self.probe()


def allocator_with_a_cached_small_block(probe, **options):
    backend = ProbingBackend(probe, capacity=8 * GiB)
    allocator = _core.CachingAllocator(backend, 0, **options)
    allocator.set_capacity(8 * GiB)
    allocator.free(allocator.malloc(512))       # one 2 MiB small segment, cached
    probe.allocator = allocator
    return allocator, backend


def finish(allocator, probe):
    for t in probe.blocked:
        t.join(WAIT_S)
    _core._check_invariants(allocator)


def test_a_cache_hit_on_another_thread_is_served_while_record_stream_checks_the_stream():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    p = allocator.malloc(30 * MiB)
    backend.probe_in = {"check_stream"}
    probe.armed = True
    allocator.record_stream(p, 9)
    allocator.free(p)
    finish(allocator, probe)
    assert probe.outcomes == [True]


def test_a_cache_hit_on_another_thread_is_served_while_the_backend_allocates():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    backend.probe_in = {"malloc"}
    probe.armed = True
    p = allocator.malloc(30 * MiB)              # a miss: a new large segment
    allocator.free(p)
    finish(allocator, probe)
    assert probe.outcomes == [True]
    stats = allocator.memory_stats()
    assert stats["allocation.all.current"] == 0
    assert stats["segment.all.current"] == 2
    assert stats["num_alloc_retries"] == 0


def test_a_cache_hit_on_another_thread_is_served_while_the_history_hook_runs():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    allocator.set_trace_hook(lambda events: probe())
    probe.armed = True
    allocator.free(allocator.malloc(4096))
    finish(allocator, probe)
    assert probe.outcomes and probe.outcomes[0] is True


def test_a_cache_hit_on_another_thread_is_served_while_an_event_is_recorded():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    p = allocator.malloc(1 << 20)
    allocator.record_stream(p, 7)
    backend.probe_in = {"record_event"}
    probe.armed = True
    allocator.free(p)                           # records an event on stream 7
    finish(allocator, probe)
    assert probe.outcomes == [True]


def test_a_cache_hit_on_another_thread_is_served_while_an_event_is_asked_about():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    p = allocator.malloc(1 << 20)
    allocator.record_stream(p, 7)
    allocator.free(p)
    backend.probe_in = {"event_done"}
    probe.armed = True
    allocator.free(allocator.malloc(4096))      # asks whether stream 7's event is done
    finish(allocator, probe)
    assert probe.outcomes == [True]


class MissOnAnotherThread:
    """From inside the probed callback, start a request of ``size`` bytes on
    another thread and give it half a second (it waits for the call in
    flight, so it cannot finish then); ``result`` is the address or the
    OutOfMemoryError it got."""

    def __init__(self, size, stream=0):
        self.size = size
        self.stream = stream
        self.results = []
        self.finished_inside = None
        self.thread = None

    def __call__(self, allocator):
        def request():
            try:
                self.results.append(allocator.malloc(self.size, self.stream))
            except _core.OutOfMemoryError as exc:
                self.results.append(exc)
        self.thread = threading.Thread(target=request, daemon=True)
        self.thread.start()
        self.thread.join(0.5)
        self.finished_inside = bool(self.results)

    def result(self):
        self.thread.join(WAIT_S)
        assert len(self.results) == 1, self.results
        return self.results[0]


def test_a_cache_hit_on_another_thread_is_served_while_empty_cache_waits_for_an_event():
    probe = Probe()
    allocator, backend = allocator_with_a_cached_small_block(probe)
    p = allocator.malloc(1 << 20)
    allocator.record_stream(p, 7)
    allocator.free(p)                           # its event pending: stream 7 never completes
    backend.probe_in = {"event_synchronize"}
    probe.armed = True
    allocator.empty_cache()                     # waits for the event
    finish(allocator, probe)
    assert probe.outcomes == [True]
    assert allocator.memory_stats()["active.all.current"] == 0


class ProbingGPU(SimulatedGPU):
    """The virtual memory calls, probed."""

    def __init__(self, probe, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe = probe
        self.probe_in = set()

    def _probed(self, name):
        if name in self.probe_in:
            self.probe()

    def reserve_address_range(self, size, device):
        self._probed("reserve_address_range")
        return super().reserve_address_range(size, device)

    def map_pages(self, address, size, device):
        self._probed("map_pages")
        return super().map_pages(address, size, device)

    def unmap_pages(self, address, size, device):
        self._probed("unmap_pages")
        return super().unmap_pages(address, size, device)

    def unmap_idle_pages(self, address, size, device):
        self._probed("unmap_idle_pages")
        return super().unmap_idle_pages(address, size, device)

    def release_address_range(self, address, size, device):
        self._probed("release_address_range")
        return super().release_address_range(address, size, device)

    def record_event(self, stream, device):
        self._probed("record_event")
        return super().record_event(stream, device)


def expandable_allocator_with_a_cached_small_block(probe, **options):
    gpu = ProbingGPU(probe, capacity=8 * GiB)
    allocator = _core.CachingAllocator(gpu, 0, expandable_segments=True, **options)
    allocator.set_capacity(8 * GiB)
    allocator.free(allocator.malloc(512))
    probe.allocator = allocator
    return allocator, gpu


@pytest.mark.parametrize("callback", ["reserve_address_range", "map_pages"])
def test_a_cache_hit_on_another_thread_is_served_while_expandable_segments_grow(callback):
    probe = Probe()
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe)
    gpu.probe_in = {callback}
    probe.armed = True
    allocator.free(allocator.malloc(64 * MiB, 3))      # stream 3: a new range, new pages
    finish(allocator, probe)
    assert probe.outcomes == [True]


@pytest.mark.parametrize("callback", ["record_event", "unmap_idle_pages"])
def test_a_cache_hit_on_another_thread_is_served_while_a_miss_unmaps_a_hole(callback):
    """With max_reserved_ratio a miss unmaps the free pages of a hole first,
    stream-ordered: an event on the hole's stream (idle here: done at once),
    then unmap_idle_pages. The hit is on stream 9, whose cached page is the
    free end of its range, never a hole."""
    probe = Probe(lambda: probe.on_another_thread(lambda: allocator.free(allocator.malloc(512, 9))))
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe, max_reserved_ratio=1.0)
    allocator.free(allocator.malloc(512, 9))
    first, hole, last = (allocator.malloc(n * MiB) for n in (2, 8, 2))
    allocator.free(hole)
    gpu.probe_in = {callback}
    probe.armed = True
    p = allocator.malloc(10 * MiB)              # 8 MiB past the ratio: the hole goes
    finish(allocator, probe)
    assert probe.outcomes == [True]
    assert not any(hole <= page < hole + 8 * MiB for page in gpu.mapped_pages[0])
    for ptr in (first, last, p):
        allocator.free(ptr)
    _core._check_invariants(allocator)


def test_a_cache_hit_on_another_thread_is_served_while_empty_virt_addr_cache_releases_a_range():
    probe = Probe()
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe)
    allocator.free(allocator.malloc(64 * MiB, 3))
    allocator.empty_cache(3)                    # stream 3's range: no page mapped
    gpu.probe_in = {"release_address_range"}
    probe.armed = True
    allocator.empty_virt_addr_cache()
    finish(allocator, probe)
    assert probe.outcomes == [True]
    assert allocator.reserved_address_space()["ranges"] == 1       # the small pool's


@pytest.mark.parametrize("callback, expandable, size, stream", [
    pytest.param("free", False, 30 * MiB, 0, id="free"),
    pytest.param("unmap_pages", True, 64 * MiB, 0, id="unmap_pages"),
    # stream 9 keeps nothing after empty_cache: the backend is told it is dropped
    pytest.param("release_stream", False, 4096, 9, id="release_stream"),
])
def test_a_cache_hit_on_another_thread_is_served_while_empty_cache_calls_the_backend(
        callback, expandable, size, stream):
    probe = Probe()
    make = expandable_allocator_with_a_cached_small_block if expandable else allocator_with_a_cached_small_block
    allocator, backend = make(probe)
    allocator.free(allocator.malloc(size, stream))
    backend.probe_in = {callback}
    probe.armed = True
    allocator.empty_cache()
    finish(allocator, probe)
    assert probe.outcomes == [True]


def test_a_miss_refused_for_bytes_in_flight_waits_for_them_and_takes_the_new_segment():
    """The first miss's segment counts against the fraction while the backend
    is asked for it with the lock let go. A second miss on another thread
    meanwhile, refused for those bytes alone, waits for the call and takes
    its block from the new segment, as it would have had it waited for the
    lock: no out-of-memory error, no cache emptied, no retry."""
    second = MissOnAnotherThread(5 * MiB)
    probe = Probe(lambda: second(probe.allocator))
    allocator, backend = allocator_with_a_cached_small_block(probe)
    allocator.set_memory_fraction((2 * MiB + 20 * MiB + 10 * MiB) / (8 * GiB))
    backend.probe_in = {"malloc"}
    probe.armed = True
    p = allocator.malloc(5 * MiB)               # the first miss: a 20 MiB segment
    got = second.result()
    assert second.finished_inside is False
    assert isinstance(got, int), got
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == 22 * MiB      # the small segment and the new one
    assert stats["segment.large_pool.current"] == 1
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    assert got == p + 5 * MiB                   # the best fit in the new segment
    allocator.free(p)
    allocator.free(got)
    _core._check_invariants(allocator)


def test_two_misses_on_other_threads_cannot_pass_the_memory_fraction_together():
    """With the new segment as large as the fraction allows, the second miss
    cannot be served when the first's call returns: it is refused, once,
    after waiting for it."""
    second = MissOnAnotherThread(22 * MiB)
    probe = Probe(lambda: second(probe.allocator))
    allocator, backend = allocator_with_a_cached_small_block(probe)
    allocator.set_memory_fraction((2 * MiB + 22 * MiB + 10 * MiB) / (8 * GiB))
    backend.probe_in = {"malloc"}
    probe.armed = True
    p = allocator.malloc(22 * MiB)
    assert isinstance(second.result(), _core.OutOfMemoryError)
    stats = allocator.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["reserved_bytes.all.current"] == 22 * MiB      # the small segment went in its retry
    allocator.free(p)
    _core._check_invariants(allocator)


def test_a_request_the_backends_own_python_makes_during_its_malloc_waits_for_nothing():
    """The backend's malloc allocates from the same allocator (its Python, a
    finalizer): that request may not wait for the call it is part of. Past
    the fraction it is refused at once; the outer request succeeds."""
    inner = []

    def allocate_inside():
        try:
            inner.append(probe.allocator.malloc(22 * MiB))
        except _core.OutOfMemoryError as exc:
            inner.append(exc)

    probe = Probe(allocate_inside)
    allocator, backend = allocator_with_a_cached_small_block(probe)
    allocator.set_memory_fraction((2 * MiB + 22 * MiB + 10 * MiB) / (8 * GiB))
    backend.probe_in = {"malloc"}
    probe.armed = True
    p = allocator.malloc(22 * MiB)
    assert len(inner) == 1 and isinstance(inner[0], _core.OutOfMemoryError), inner
    allocator.free(p)
    _core._check_invariants(allocator)


def test_a_free_made_by_the_backends_python_during_its_malloc_is_an_ordinary_free():
    """A finalizer that frees a block while the backend allocates finds the
    lock free: the block is back in the pool when the allocation returns."""
    held = []
    probe = Probe(lambda: probe.allocator.free(held.pop()))
    allocator, backend = allocator_with_a_cached_small_block(probe)
    held.append(allocator.malloc(4096))
    backend.probe_in = {"malloc"}
    probe.armed = True
    p = allocator.malloc(30 * MiB)
    assert not held
    stats = allocator.memory_stats()
    assert stats["allocation.all.current"] == 1
    assert stats["active_bytes.small_pool.current"] == 0
    allocator.free(p)
    _core._check_invariants(allocator)


def test_a_miss_refused_for_pages_being_mapped_waits_for_them_and_takes_their_free_end():
    """Expandable segments, as the plain segment above: [L][hole][L2][end of
    the range]. The first miss maps 4 MiB at the end for 2.5 MiB; a second
    miss meanwhile, on another thread, would map the hole and pass the
    fraction with the pages in flight: it waits for the map and takes the
    1.5 MiB left free at its end. No out-of-memory error, no retry (which
    would have mapped the hole again and been refused)."""
    second = MissOnAnotherThread(5 * MiB // 4)
    probe = Probe(lambda: second(probe.allocator))
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe)
    low, hole, high = (allocator.malloc(2 * MiB) for _ in range(3))
    allocator.free(hole)
    allocator.empty_cache()                     # the hole's page (and the small one) unmapped: 4 MiB mapped
    allocator.set_memory_fraction((4 * MiB + 4 * MiB + 1 * MiB) / (8 * GiB))
    gpu.probe_in = {"map_pages"}
    probe.armed = True
    p = allocator.malloc(5 * MiB // 2)
    got = second.result()
    assert second.finished_inside is False
    assert got == p + 5 * MiB // 2, got
    stats = allocator.memory_stats()
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    assert stats["reserved_bytes.all.current"] == 8 * MiB
    for ptr in (low, high, p, got):
        allocator.free(ptr)
    _core._check_invariants(allocator)


def test_two_misses_cannot_pass_the_memory_fraction_together_with_a_map_in_flight():
    """Expandable segments: the first miss's pages count against the fraction
    while map_pages runs with the lock let go. A second miss on another
    thread (stream 5, whose range has room) would pass it with them: it is
    refused, waits for the map, is refused again, and runs out of memory
    once, the fraction never passed."""
    second = MissOnAnotherThread(2 * MiB, stream=5)
    probe = Probe(lambda: second(probe.allocator))
    gpu = ProbingGPU(probe, capacity=8 * GiB)
    allocator = probe.allocator = _core.CachingAllocator(gpu, 0, expandable_segments=True)
    allocator.set_capacity(8 * GiB)
    allocator.free(allocator.malloc(2 * MiB, 5))
    allocator.empty_cache()                     # stream 5: a range, no page mapped
    allocator.set_memory_fraction(5 * MiB / (8 * GiB))
    gpu.probe_in = {"map_pages"}
    probe.armed = True
    p = allocator.malloc(5 * MiB // 2)          # maps 4 MiB in a new range of stream 0
    got = second.result()
    assert second.finished_inside is False
    assert isinstance(got, _core.OutOfMemoryError), got
    stats = allocator.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["reserved_bytes.all.current"] == stats["reserved_bytes.all.peak"] == 4 * MiB
    allocator.free(p)
    _core._check_invariants(allocator)


def test_a_miss_waits_for_the_span_being_mapped_rather_than_reserving_a_range():
    """The only span of stream 0's large pool is being mapped (a new range)
    when a second miss of that pool comes on another thread: it waits for
    the map and takes its block from the pages mapped, as it would have had
    it waited for the lock, and reserves no range of its own."""
    second = MissOnAnotherThread(5 * MiB // 4)
    probe = Probe(lambda: second(probe.allocator))
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe)
    gpu.probe_in = {"map_pages"}
    probe.armed = True
    p = allocator.malloc(5 * MiB // 2)          # 4 MiB mapped: 1.5 MiB left free after it
    got = second.result()
    assert second.finished_inside is False
    assert got == p + 5 * MiB // 2
    assert allocator.reserved_address_space()["ranges"] == 2       # the small pool's and this one
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == 6 * MiB
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    allocator.free(p)
    allocator.free(got)
    _core._check_invariants(allocator)


def test_a_free_made_by_the_backends_python_during_map_pages_meets_the_new_pages():
    """[A live][unmapped]: a request maps the span after A, and the map's
    Python (a finalizer) frees A with the lock let go. The commit looks at
    the span's neighbours as they are then: the new pages merge with A, and
    the request's best fit starts at A."""
    held = []
    probe = Probe(lambda: probe.allocator.free(held.pop()))
    allocator, gpu = expandable_allocator_with_a_cached_small_block(probe)
    a = allocator.malloc(2 * MiB, 3)
    held.append(a)
    gpu.probe_in = {"map_pages"}
    probe.armed = True
    p = allocator.malloc(4 * MiB, 3)
    assert not held and p == a
    stats = allocator.memory_stats()
    assert stats["allocation.all.current"] == 1 and stats["reserved_bytes.large_pool.current"] == 6 * MiB
    allocator.free(p)
    _core._check_invariants(allocator)


def test_xpu_empty_cache_does_not_wait_on_the_queue_holding_the_lock():
    """A dpctl keep-alive host task, queued before the barrier that
    empty_cache waits on, frees a pool array and needs the allocator lock.

    Kernels queued on queue B keep it busy for a while; then a kernel reads
    pool array ``y`` and dpctl's host task that keeps ``y`` alive until that
    kernel is done holds its last reference. ``x``, used on queue B, is freed
    with an event on B after all of it, and empty_cache waits for that
    event: the host task runs meanwhile and frees ``y``. The old code waited
    with the pool's lock held, and hung. ``before == 2`` says that ``y`` was
    still live when empty_cache was called (the scenario happened)."""
    pytest.importorskip("dpnp")
    result = run_within_timeout("""
        import unimem, dpctl
        import dpnp.tensor as dpt
        xpu = unimem.xpu
        queue_b = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
        work = dpt.ones(1 << 24, dtype="f4", sycl_queue=queue_b)
        dpt.sin(work); queue_b.wait()                  # the kernels are built
        caught = 0
        for round in range(3):
            x = xpu.empty(1 << 20, dtype="f4")
            xpu.record_stream(x, queue_b)
            y = xpu.empty(1 << 20, dtype="f4", sycl_queue=queue_b)
            busy = [dpt.sin(work) for _ in range(3)]   # queue B is busy for a while
            z = dpt.sin(y.get_array())  # after them; a keep-alive host task holds y's memory ...
            del y                       # ... and so the last reference: a pool free from its thread
            del x                       # an event on queue B, after all of that
            before = xpu.memory_stats()["active.all.current"]
            xpu.empty_cache()           # waits for it
            after = xpu.memory_stats()["active.all.current"]
            assert after == 0, after
            caught += before == 2
            del z, busy
        print("caught", caught)
    """, timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "caught 0" not in result.stdout and "caught" in result.stdout, result.stdout
