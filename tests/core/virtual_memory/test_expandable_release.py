"""Expandable segments: a hole unmapped on the allocation path waits for no
kernel (_core_holes.pxi, stream-ordered release).

With max_reserved_ratio, a miss unmaps free whole pages of holes before it
maps more. On CUDA, cuMemUnmap does not wait for kernels still using the
pages, so the backend's unmap_pages synchronizes the device first: called on
the miss path, every allocation that unmapped a hole waited for every kernel
queued. A backend with ``unmap_idle_pages`` has the hole released
stream-ordered instead: its pages are held, an event is recorded on its
stream, and they are unmapped without waiting once the event has completed.
Only running out of memory (and empty_cache, sleep, teardown) waits.

The device here is :class:`SimulatedGPU`: work launched on a stream uses
memory until the stream completes; its ``unmap_pages`` waits for the device
and counts it, its ``unmap_idle_pages`` refuses pages queued work still uses.
"""
import gc
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedGPU

from tests.helpers.mapped_pages import mapped, unmapped
from tests.helpers.stream_events import AllocatesInAQuery

MiB = 1 << 20


def allocator(capacity=256 * MiB, backend=None):
    gpu = backend or SimulatedGPU(capacity=capacity)
    a = _core.CachingAllocator(gpu, 0, expandable_segments=True, max_reserved_ratio=1.0)
    a.set_capacity(capacity)
    return a, gpu


def a_hole_in_use(a, gpu, stream=0, busy=True):
    """[0, 2) live, [2, 10) free with work queued on it, [10, 12) live (MiB):
    12 MiB mapped, the most ever in use. The 10 MiB request after it maps
    10 MiB at the range's end, 8 past ratio 1.0 x 14: the hole goes."""
    first = a.malloc(2 * MiB, stream)
    hole = a.malloc(8 * MiB, stream)
    last = a.malloc(2 * MiB, stream)
    if busy:
        gpu.launch(stream, hole, 8 * MiB)
    a.free(hole)
    return first, hole, last


def test_a_miss_that_unmaps_a_hole_in_use_waits_for_no_kernel():
    a, gpu = allocator()
    _, hole, _ = a_hole_in_use(a, gpu)
    unmaps = gpu.n_unmap
    a.malloc(10 * MiB)
    assert gpu.device_waits == 0 and gpu.busy(hole, 8 * MiB)
    assert mapped(gpu, hole, 8 * MiB) and gpu.n_unmap == unmaps    # held until the kernel ends
    assert a.memory_reserved() == 22 * MiB                         # reserved, until then
    a._check_invariants()
    assert [b["state"] for s in a.snapshot() for b in s["blocks"] if b["address"] == hole] == ["inactive"]
    a.malloc(1 * MiB, 1)                     # the kernel runs on: still held, nothing waited
    assert mapped(gpu, hole, 8 * MiB) and gpu.device_waits == 0
    gpu.complete(0)
    a.malloc(1 * MiB, 1)                     # the next allocation unmaps it, without waiting
    assert unmapped(gpu, hole, 8 * MiB) and gpu.n_unmap == unmaps + 1 and gpu.device_waits == 0
    assert a.memory_reserved() == 16 * MiB   # 14 on stream 0, a page on stream 1
    stats = a.memory_stats()
    assert stats["num_device_free"] == 1 and stats["num_sync_all_streams"] == 0
    a._check_invariants()


def test_a_miss_on_the_holes_stream_takes_its_held_pages_back():
    """Reuse on the same stream is ordered after the kernel: a later request
    that fits the held pages gets them, mapping nothing; one on another
    stream does not."""
    a, gpu = allocator()
    _, hole, _ = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)                                  # holds the hole
    maps = gpu.n_map
    other = a.malloc(6 * MiB, 1)                        # another stream: maps its own
    assert not hole <= other < hole + 8 * MiB and gpu.n_map == maps + 1
    again = a.malloc(6 * MiB)                           # this stream: the held pages
    assert hole <= again < hole + 8 * MiB and gpu.n_map == maps + 1
    assert gpu.device_waits == 0
    a._check_invariants()
    gpu.complete(0)
    a.process_events()                                  # its event is dropped with nothing to unmap
    assert a.memory_stats()["num_device_free"] == 0
    a._check_invariants()


def test_held_pages_taken_back_merge_with_a_neighbour_freed_since():
    """[2) live, [2, 10) held, [10, 12) freed after: a 10 MiB request fits
    the two together once the held pages are back in the free index."""
    a, gpu = allocator()
    first, hole, last = a_hole_in_use(a, gpu)
    big = a.malloc(12 * MiB)                            # holds the hole, maps 12 at the end
    a.free(last)
    maps = gpu.n_map
    assert a.malloc(10 * MiB) == hole and gpu.n_map == maps
    a._check_invariants()


def test_a_hole_whose_stream_is_idle_is_unmapped_at_once():
    """Work queued on another stream does not hold it either."""
    a, gpu = allocator()
    other = a.malloc(2 * MiB, 1)
    gpu.launch(1, other, 2 * MiB)
    _, hole, _ = a_hole_in_use(a, gpu, busy=False)
    a.malloc(10 * MiB)
    assert unmapped(gpu, hole, 8 * MiB) and gpu.device_waits == 0
    assert a.memory_reserved() == 16 * MiB           # 14 on stream 0, 2 on stream 1
    a._check_invariants()


def test_empty_cache_waits_for_the_held_pages():
    a, gpu = allocator()
    first, hole, last = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)
    a.empty_cache()
    assert unmapped(gpu, hole, 8 * MiB) and not gpu.busy(hole, 8 * MiB)
    assert a.memory_reserved() == 14 * MiB
    a._check_invariants()


def test_a_map_refused_for_held_pages_waits_for_those_alone():
    """24 MiB device: the 10 MiB at the end fit only once the hole is gone.
    The map is refused, the miss waits for the hole's kernel alone, unmaps it
    and maps again: no retry, and stream 1's cache stays (the retry would
    wait for every event and give back every free page)."""
    a, gpu = allocator(capacity=24 * MiB)
    cached = a.malloc(4 * MiB, 1)
    a.free(cached)                                   # stream 1 keeps 4 MiB cached
    _, hole, _ = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)
    assert unmapped(gpu, hole, 8 * MiB) and mapped(gpu, cached, 4 * MiB)
    assert a.memory_reserved() == 18 * MiB
    stats = a.memory_stats()
    assert stats["num_alloc_retries"] == 0 and stats["num_sync_all_streams"] == 0 and gpu.device_waits == 0
    a._check_invariants()


def test_sleep_and_wake_up_with_pages_held():
    a, gpu = allocator()
    first, hole, last = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)
    a.sleep(offload=False)
    assert gpu.mapped_pages[0] == set() and a.memory_reserved() == 0
    a.wake_up()
    assert unmapped(gpu, hole, 8 * MiB) and mapped(gpu, first, 2 * MiB) and mapped(gpu, last, 2 * MiB)
    assert a.memory_reserved() == 14 * MiB
    a._check_invariants()


class WaitsInAnotherThread(SimulatedGPU):
    """event_synchronize blocks (when armed) until the test lets it go."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = None
        self.entered = threading.Event()

    def event_synchronize(self, event):
        gate = self.gate
        if gate is not None:
            self.gate = None
            self.entered.set()
            gate.wait(30)
        super().event_synchronize(event)


def test_sleep_leaves_pages_another_thread_waits_for_to_their_own_unmap():
    """Thread A's empty_cache waits for a held hole's event (outside the
    lock); thread B's sleep() meanwhile must not give those pages back:
    A unmaps them once its wait ends. Each page is unmapped once."""
    a, gpu = allocator(backend=WaitsInAnotherThread(capacity=256 * MiB))
    first, hole, last = a_hole_in_use(a, gpu)
    big = a.malloc(10 * MiB)
    gate = threading.Event()
    gpu.gate = gate
    errors = []

    def empty_cache():
        try:
            a.empty_cache()
        except BaseException as exc:
            errors.append(exc)
    thread = threading.Thread(target=empty_cache)
    thread.start()
    assert gpu.entered.wait(30)
    a.sleep(offload=False)
    gate.set()
    thread.join(30)
    assert errors == [] and a.lost_segments() == {"count": 0, "bytes": 0}
    assert a.memory_reserved() == 0 and gpu.mapped_pages[0] == set()
    a.wake_up()
    assert a.memory_reserved() == 14 * MiB == len(gpu.mapped_pages[0]) * 2 * MiB
    a._check_invariants()
    for p in (first, big, last):
        a.free(p)
    a.empty_cache()
    a.empty_virt_addr_cache()
    assert gpu.mapped_pages[0] == set() and gpu.ranges[0] == {}


def test_a_hole_held_while_sleep_selects_its_segments_is_not_given_back_twice():
    """sleep(segments=select) whose select allocates (a finalizer, a hook):
    that miss holds a hole of a segment the sleep then gives back."""
    a, gpu = allocator()
    first, hole, last = a_hole_in_use(a, gpu)
    got = []

    def select(address, size, stream):
        if not got:
            gpu.launch(0, hole, 8 * MiB)
            got.append(a.malloc(10 * MiB))
        return True
    a.sleep(offload=False, segments=select)
    gpu.complete(0)
    a.process_events()
    assert a.lost_segments() == {"count": 0, "bytes": 0} and a.memory_reserved() >= 0
    a.wake_up()
    assert a.memory_reserved() == len(gpu.mapped_pages[0]) * 2 * MiB
    assert unmapped(gpu, hole, 8 * MiB)
    a._check_invariants()


def test_empty_cache_without_waiting_takes_the_held_pages_its_unmaps_waited_for():
    """empty_cache(wait=False) unmaps free pages with unmap_pages, which
    waits for the device: the held pages' work is done then, and they go too."""
    a, gpu = allocator()
    _, hole, _ = a_hole_in_use(a, gpu)
    a.free(a.malloc(10 * MiB))
    a.empty_cache(wait=False)
    assert unmapped(gpu, hole, 8 * MiB) and a.memory_reserved() == 4 * MiB
    a._check_invariants()


class FailingEvents(SimulatedGPU):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fail = None

    def record_event(self, stream, device):
        if self.fail == "record_event":
            raise RuntimeError("record_event failed")
        return super().record_event(stream, device)

    def event_done(self, event):
        if self.fail == "event_done":
            raise RuntimeError("event_done failed")
        return super().event_done(event)


@pytest.mark.parametrize("failing", ["record_event", "event_done"])
def test_an_event_that_cannot_be_had_unmaps_after_waiting_and_is_reported(failing, monkeypatch):
    """The allocation does not fail for want of an event: the hole is
    unmapped with unmap_pages (which waits for the device) and the error
    reported as unraisable, at every such miss."""
    reported = []
    monkeypatch.setattr("sys.unraisablehook", lambda info: reported.append(str(info.exc_value)))
    a, gpu = allocator(backend=FailingEvents(capacity=256 * MiB))
    _, hole, _ = a_hole_in_use(a, gpu)
    gpu.fail = failing
    a.malloc(10 * MiB)
    assert unmapped(gpu, hole, 8 * MiB) and gpu.device_waits == 1 and a.memory_reserved() == 14 * MiB
    assert reported == [f"{failing} failed"]
    a._check_invariants()


class Interrupting(FailingEvents):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.released = []

    def record_event(self, stream, device):
        if self.fail == "interrupt":
            raise KeyboardInterrupt
        return super().record_event(stream, device)

    def event_done(self, event):
        if self.fail == "interrupt in event_done":
            raise KeyboardInterrupt
        return super().event_done(event)

    def release_event(self, event):
        self.released.append(event)


@pytest.mark.parametrize("where", ["interrupt", "interrupt in event_done"])
def test_a_ctrl_c_while_recording_the_event_leaves_the_hole_free_and_mapped(where):
    """... and an event recorded before it is given back (release_event)."""
    a, gpu = allocator(backend=Interrupting(capacity=256 * MiB))
    _, hole, _ = a_hole_in_use(a, gpu)
    before = a.memory_stats()
    gpu.fail = where
    with pytest.raises(KeyboardInterrupt):
        a.malloc(10 * MiB)
    assert len(gpu.released) == (where == "interrupt in event_done")
    assert a.memory_stats() == before
    assert mapped(gpu, hole, 8 * MiB) and gpu.n_unmap == 0
    a._check_invariants()
    gpu.fail = None
    assert a.malloc(8 * MiB) == hole                 # free, and whole
    a._check_invariants()


class FailingIdleUnmap(SimulatedGPU):
    def unmap_idle_pages(self, address, size, device):
        raise RuntimeError("cuMemUnmap failed")


def test_an_unmap_that_fails_after_the_kernel_loses_the_span_once():
    a, gpu = allocator(backend=FailingIdleUnmap(capacity=256 * MiB))
    _, hole, _ = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)
    gpu.complete(0)
    with pytest.raises(RuntimeError, match="cuMemUnmap failed"):
        a.process_events()
    assert a.lost_segments() == {"count": 1, "bytes": 8 * MiB}
    a.process_events()                                # never tried again
    a._check_invariants()


def test_the_allocators_death_unmaps_held_pages_and_releases_the_range():
    a, gpu = allocator()
    first, hole, last = a_hole_in_use(a, gpu)
    a.free(a.malloc(10 * MiB))
    a.free(first)
    a.free(last)
    assert gpu.busy(hole, 8 * MiB)
    del a
    gc.collect()
    assert gpu.mapped_pages[0] == set() and gpu.ranges[0] == {}
    assert gpu.device_waits >= 1                     # unmap_pages waited for the kernel


def test_an_allocation_re_entered_from_an_event_query_handles_no_event():
    """The finalizer's malloc goes through process_events: a nested pass
    used to unmap the held pages and leave the outer one to count their
    event down to -1 (an unmapped span "in use")."""
    a, gpu = allocator(backend=AllocatesInAQuery(capacity=256 * MiB))
    first, hole, last = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)                                  # holds the hole
    gpu.complete(0)
    got = []
    gpu.hook = lambda: got.append(a.malloc(1 * MiB, 1))
    a.process_events()
    assert got and unmapped(gpu, hole, 8 * MiB) and a.lost_segments() == {"count": 0, "bytes": 0}
    a._check_invariants()


def test_held_pages_taken_back_inside_an_event_query_are_not_handled_again():
    """The finalizer's miss takes the held hole back (and hands it out)
    while the outer pass asks about its event: the outer pass must not
    count that block's event down once the event is done."""
    a, gpu = allocator(backend=AllocatesInAQuery(capacity=256 * MiB))
    first, hole, last = a_hole_in_use(a, gpu)
    a.malloc(10 * MiB)
    got = []

    def finalizer():
        got.append(a.malloc(6 * MiB))                   # the held hole, taken back
        gpu.complete(0)
    gpu.hook = finalizer
    a.process_events()
    assert hole <= got[0] < hole + 8 * MiB
    a._check_invariants()
    a.free(got[0])
    a._check_invariants()
    assert a.malloc(6 * MiB) == got[0]                  # handed out once, freed once
    a._check_invariants()



def test_the_event_goes_back_even_when_the_fallback_unmap_fails(monkeypatch):
    """event_done fails, then unmap_pages does: the span is lost (counted),
    and the event recorded for it is still given back."""
    monkeypatch.setattr("sys.unraisablehook", lambda info: None)

    class Broken(Interrupting):
        def unmap_pages(self, address, size, device):
            raise RuntimeError("unmap broken")
    a, gpu = allocator(backend=Broken(capacity=256 * MiB))
    _, hole, _ = a_hole_in_use(a, gpu)
    gpu.fail = "event_done"
    with pytest.raises(RuntimeError, match="unmap broken"):
        a.malloc(10 * MiB)
    assert len(gpu.released) == 1 and a.lost_segments() == {"count": 1, "bytes": 8 * MiB}
    a._check_invariants()
