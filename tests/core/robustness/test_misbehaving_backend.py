"""A backend that misbehaves, and the core's guarantees after every step (issue 12, "Build").

A hypothesis state machine drives a :class:`~unimem._core.CachingAllocator`
over :class:`MisbehavingBackend`, a :class:`SimulatedBackend` (which knows
what is really allocated) that, on request:

* returns from ``malloc`` an address already live, one inside a live segment,
  a range overlapping one from below, a float, a bool, a negative, a huge or a
  wrapping address, a string; or 0 / None / ``MemoryError`` (out of memory);
* raises from ``free`` after really freeing, or without freeing;
* raises from ``record_event`` (after recording events for other streams);
* collects garbage inside a callback: drops the last reference to
  :class:`~unimem._core.Allocation` objects of the same allocator, whose
  finalizers free their blocks re-entrantly;
* raises ``KeyboardInterrupt`` inside a callback (malloc before or after the
  memory was taken, free before or after it was given back, record_event,
  event_done, event_synchronize, the history hook).

After every step: no block is handed out twice (live blocks do not overlap,
each lies in a segment the backend really holds, never in memory it was told
to free), the statistics are consistent (``_check_invariants``, no
``.current`` below zero, ``allocated - freed == current``), segments whose
free raised are forgotten and counted in ``lost_segments()``, events given up
are given back through ``release_event`` and never waited on. A bad backend
answer gives a clear error and leaves the allocator exactly as it was; an
interrupt leaves each operation done or not done; at the end everything can
be freed.

The bugs the machine found are reproduced by the tests at the end (each
failed before its fix), and the machine injects all of their triggers. The
backend, the plain rules and the checks every allocator passes are shared
with the expandable-segments machine (test_misbehaving_expandable.py) in
tests/helpers/misbehaving.py.
"""
import functools
import threading
import sys

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.helpers.misbehaving import EVENT_CHAOS, STREAMS, AllocatorMachine, MisbehavingBackend, sizes, streams
from unimem import OutOfMemoryError, _core
from unimem.backends.simulated import SimulatedBackend

# --------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------
BAD_ADDRESSES = {
    # kind: (exception, words of its message)
    "same": (RuntimeError, "overlaps"),
    "inside": (RuntimeError, "overlaps"),
    "straddle": (RuntimeError, "overlaps"),
    "wraps": (RuntimeError, "wraps around"),
    "float": (TypeError, "must return an address as a positive int"),
    "integral_float": (TypeError, "must return an address as a positive int"),
    "true": (TypeError, "must return an address as a positive int"),
    "negative": (TypeError, "must return an address as a positive int"),
    "huge": (TypeError, "must return an address as a positive int"),
    "string": (TypeError, "must return an address as a positive int"),
}

CHAOS = [("malloc", ("interrupt",)), ("malloc", ("interrupt_after",)),
         ("free", ("interrupt_before",)), ("free", ("interrupt_after",)),
         ("free", ("raise_before",)), ("free", ("raise_after",))] + EVENT_CHAOS


def no_allocated_block(segment):
    return all(b["state"] != "active_allocated" for b in segment["blocks"])


def isolated(method):
    """A rule that injects its own misbehaviour and checks exactly what follows:
    the plans made by earlier rules wait, and completed stream work is
    processed first (as malloc does), so that "as before" means as before."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.backend.isolated():
            self.core.process_events()
            return method(self, *args, **kwargs)
    return run


class MisbehavingBackendMachine(AllocatorMachine):

    def __init__(self):
        super().__init__(MisbehavingBackend(self.collect))

    # -- bookkeeping ------------------------------------------------------------------
    def state(self):
        stats = dict(self.core.memory_stats())
        del stats["num_ooms"]
        return (stats, self.core.live_allocations(), self.core.snapshot(), self.core.lost_segments(),
                dict(self.device.live[0]), dict(self.backend.stranded))

    def miss_size(self, size, stream):
        """``size``, or more: larger than every cached block of the stream."""
        largest = max((b["size"] for s in self.core.snapshot() if s["stream"] == stream
                       for b in s["blocks"] if b["state"] == "inactive"), default=0)
        return size if self.core.round_size(size) > largest else largest + 1

    def bad_address(self, kind, data):
        segments = [s for s in self.core.snapshot() if not no_allocated_block(s)]
        if kind in ("same", "inside", "straddle") and not segments:
            kind = "float"
        if kind in ("same", "inside", "straddle"):
            seg = data.draw(st.sampled_from(segments), label="clashing segment")
            base, size = seg["address"], seg["total_size"]
            # a segment of the cache switched off is the request itself: 512 bytes at least
            value = {"same": base, "straddle": base - 256,
                     "inside": base + 256 * data.draw(st.integers(1, size // 256 - 1), label="offset")}[kind]
        else:
            value = {"wraps": (1 << 64) - 256, "float": 4096.5, "integral_float": float(1 << 40),
                     "true": True, "negative": -4096, "huge": 1 << 64, "string": "0x1000"}[kind]
        return kind, value

    # -- misbehaviour, at some later point --------------------------------------------
    @rule(callback=st.sampled_from(MisbehavingBackend.CALLBACKS), count=st.integers(1, 3),
          offset=st.integers(0, 7))
    def garbage_collection_in_a_callback(self, callback, count, offset):
        self.backend.plans[callback].append(("gc", count, offset))

    @rule(where=st.sampled_from(CHAOS))
    def failure_in_a_callback(self, where):
        callback, action = where
        self.backend.plans[callback].append(action)

    # -- misbehaviour, and exactly what must follow -----------------------------------
    @rule(kind=st.sampled_from(sorted(BAD_ADDRESSES)), size=sizes, stream=streams, data=st.data())
    @isolated
    def malloc_returns_a_bad_address(self, kind, size, stream, data):
        kind, value = self.bad_address(kind, data)
        error_type, words = BAD_ADDRESSES[kind]
        size = self.miss_size(size, stream)
        before = self.state()
        self.backend.malloc_log.clear()
        self.backend.plans["malloc"].append(("return", value))
        try:
            ptr = self.core.malloc(size, stream)
        except error_type as exc:
            assert self.backend.malloc_log == ["address"], f"{exc!r} without a backend call"
            assert words in str(exc), f"unclear error for {value!r}: {exc}"
            assert self.state() == before, f"the allocator changed on a refused address {value!r}"
            return
        except OutOfMemoryError:
            assert not self.backend.malloc_log           # larger than the device: never asked
            return
        finally:
            self.backend.disarm()
        assert not self.backend.malloc_log, f"backend returned {value!r}, core handed out {ptr:#x}"
        self.adopt(ptr, size, stream)                     # a cache hit after all

    @rule(how=st.sampled_from(["zero", "none", "memory_error"]), refusals=st.integers(1, 2),
          retry=st.sampled_from([None, "float", "same"]), size=sizes, stream=streams, data=st.data())
    @isolated
    def backend_out_of_memory(self, how, refusals, retry, size, stream, data):
        plan = [("refuse", how)] * refusals
        if retry is not None and refusals == 1:
            kind, value = self.bad_address(retry, data)
            plan.append(("return", value))
        else:
            kind = None
        size = self.miss_size(size, stream)
        stats_before = self.core.memory_stats()
        _, live_before, snapshot_before, *_ = self.state()
        releasable = {s["address"] for s in snapshot_before if no_allocated_block(s)}
        self.backend.malloc_log.clear()
        self.backend.plans["malloc"] = plan
        ptr = error = None
        try:
            ptr = self.core.malloc(size, stream)
        except (OutOfMemoryError, TypeError, RuntimeError) as exc:
            error = exc
            error.__traceback__ = None
        finally:
            self.backend.disarm()
        calls = self.backend.malloc_log
        stats = self.core.memory_stats()
        assert len(calls) <= 2
        assert stats["num_alloc_retries"] - stats_before["num_alloc_retries"] == (len(calls) == 2)
        if len(calls) == 2:
            assert calls[0] == "refused"
            left = {s["address"] for s in self.core.snapshot()}
            assert not releasable & left, "refused, but the cache was not released before the retry"
        if isinstance(error, OutOfMemoryError):
            assert stats["num_ooms"] == stats_before["num_ooms"] + 1
            assert "out of memory" in str(error) and error.requested == size
            assert not calls or calls[-1] == "refused"
        elif error is not None:
            error_type, words = BAD_ADDRESSES[kind]
            assert isinstance(error, error_type) and words in str(error), repr(error)
            assert calls == ["refused", "address"]
        else:
            assert not calls or calls[-1] == "address"
            self.adopt(ptr, size, stream)
        if error is not None:
            assert self.core.live_allocations() == live_before

    @rule(kind=st.sampled_from(["raise_after", "raise_before", "interrupt_after", "interrupt_before"]),
          where=st.sampled_from(["empty_cache", "malloc"]), size=sizes, stream=streams)
    @isolated
    def backend_free_fails(self, kind, where, size, stream):
        _, live_before, snapshot_before, lost_before, *_ = self.state()
        releasable = {s["address"]: s["total_size"] for s in snapshot_before if no_allocated_block(s)}
        self.backend.free_log.clear()
        self.backend.plans["free"].append((kind,))
        if where == "malloc":
            size = self.miss_size(size, stream)
            self.backend.plans["malloc"].append(("refuse", "zero"))
            call = lambda: self.core.malloc(size, stream)           # noqa: E731
        else:
            call = self.core.empty_cache
        try:
            ptr, error = self.attempt(call)
        except OutOfMemoryError:
            ptr = error = None
        finally:
            self.backend.disarm()
        if not releasable:
            assert error is None and not self.backend.free_log
            if ptr:
                self.adopt(ptr, size, stream)
            return
        assert error is not None and error is self.backend.fired[-1], \
            "the backend's failure did not reach the caller"
        failed, failed_size, _ = self.backend.free_log[0]
        assert {p for p, _, _ in self.backend.free_log} == set(releasable), "not every free segment went"
        assert failed_size == releasable[failed]
        lost = self.core.lost_segments()
        assert lost == {"count": lost_before["count"] + 1, "bytes": lost_before["bytes"] + failed_size}
        assert failed not in {s["address"] for s in self.core.snapshot()}, "a failed free was cached again"
        assert (failed in self.device.live[0]) == kind.endswith("before")
        assert self.core.live_allocations() == live_before

    @precondition(lambda self: self.live())
    @rule(data=st.data(), kind=st.sampled_from(["raise", "interrupt"]),
          extra=st.sets(streams, max_size=3),
          collect_in=st.sampled_from([None, "record_event", "release_event"]))
    @isolated
    def record_event_fails(self, data, kind, extra, collect_in):
        ptr = data.draw(st.sampled_from(sorted(self.live())), label="address")
        own = self.requests[ptr][1]
        extra = set(extra) - {own} or {(own + 1) % len(STREAMS)}
        for stream in sorted(extra):
            self.core.record_stream(ptr, stream)
        self.uses.setdefault(ptr, set()).update(extra)
        fail_at = data.draw(st.integers(0, len(self.uses[ptr]) - 1), label="failing event")
        plan = [("ok",)] * fail_at + [(kind,)]
        collect = collect_in is not None and fail_at > 0     # finalizers run in the first such call
        if collect:
            gc = ("gc", 2, data.draw(st.integers(0, 7), label="offset"))
            if collect_in == "record_event":
                plan[0] = gc
            else:
                self.backend.plans["release_event"].append(gc)
        handle = self.handles.get(ptr)
        before = self.state()
        recorded, released = len(self.backend.top_events), len(self.backend.released)
        self.backend.plans["record_event"] = plan
        self.pinned.add(ptr)
        try:
            _, error = self.attempt(handle.release if handle is not None else lambda: self.core.free(ptr))
        finally:
            self.pinned.discard(ptr)
            self.backend.disarm()
        del handle
        assert error is not None and error is self.backend.fired[-1], \
            "the failed event did not reach the caller"
        mine = self.backend.top_events[recorded:]
        given_back = self.backend.released[released:]
        assert len(mine) == fail_at
        assert {id(e) for e in mine} == {id(e) for e in given_back}, \
            "events recorded before the failure were not given back"
        live = self.core.live_allocations()
        assert live[ptr] == before[1][ptr], "the block whose free failed is not live as before"
        if ptr in self.handles:
            assert self.handles[ptr].ptr == ptr
        if not collect:
            assert self.state() == before, "a failed free changed the allocator"

    # -- after every step -------------------------------------------------------------
    @invariant()
    def segments_are_device_memory(self):
        """Each segment is memory the backend holds, whole, and no two
        overlap; the device holds nothing else but what failed calls stranded."""
        live = self.core.live_allocations()
        segments = self.core.snapshot()
        on_device = dict(self.device.live[0])
        allocated = 0
        for seg in segments:
            assert on_device.pop(seg["address"], None) == seg["total_size"], \
                f"segment {seg['address']:#x} is not memory the backend holds"
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    allocated += 1
                    assert block["address"] in live
        assert allocated == len(live)
        assert on_device == self.backend.stranded, "the device holds memory no one knows of"
        bases = sorted((s["address"], s["total_size"]) for s in segments)
        for (a, size), (b, _) in zip(bases, bases[1:]):
            assert a + size <= b, f"segments {a:#x} and {b:#x} overlap"
        assert self.core.lost_segments() == {"count": len(self.backend.failed_frees),
                                             "bytes": sum(self.backend.failed_frees)}

    def check_drained(self):
        assert self.device.live[0] == self.backend.stranded


MisbehavingBackendMachine.TestCase.settings = settings(
    max_examples=600, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestMisbehavingBackend = MisbehavingBackendMachine.TestCase


# --------------------------------------------------------------------------------------
# What the machine found: one reproduction each; every one failed before its fix.
# --------------------------------------------------------------------------------------
class Switchable(SimulatedBackend):
    """A simulated device whose callbacks do one bad thing when told to."""

    def __init__(self):
        super().__init__()
        self.on_event_done = None       # called (once) inside the next event_done
        self.event_done_fails = False
        self.failing_event_stream = None
        self.release_event_interrupts = False
        self.release_stream_interrupts = False
        self.refuse = 0

    def malloc(self, size, device=0, stream=0):
        if self.refuse:
            self.refuse -= 1
            return 0
        return super().malloc(size, device, stream)

    def event_done(self, event):
        if self.on_event_done is not None:
            callback, self.on_event_done = self.on_event_done, None
            callback()
        if self.event_done_fails:
            self.event_done_fails = False
            raise KeyboardInterrupt
        return super().event_done(event)

    def record_event(self, stream, device):
        if stream == self.failing_event_stream:
            raise RuntimeError("recording an event failed")
        return super().record_event(stream, device)

    def release_event(self, event):
        if self.release_event_interrupts:
            raise KeyboardInterrupt

    def release_stream(self, stream, device):
        if self.release_stream_interrupts:
            self.release_stream_interrupts = False
            raise KeyboardInterrupt


def test_a_finalizer_inside_event_done_keeps_the_event_it_records():
    """Found by the machine (fixed by 0b527c6): a finalizer run by a garbage
    collection inside event_done freed an Allocation used on another stream;
    the event it recorded was dropped when process_events replaced its list."""
    backend = Switchable()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 1)
    a.free(p)                                   # an event pending: process_events asks event_done
    handles = [a.allocate(1000)]
    a.record_stream(handles[0].ptr, 2)
    backend.on_event_done = handles.clear      # the Allocation's last reference goes there
    a.process_events()
    backend.complete(1)
    backend.complete(2)
    a.empty_cache()
    a._check_invariants()
    assert a.memory_stats()["active.all.current"] == 0, "a freed block waits for an event no one has"
    assert a.memory_reserved() == 0


# Bug B, fixed.
def test_an_interrupt_while_giving_events_back_leaves_the_block_live():
    backend = Switchable()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 1)
    a.record_stream(p, 2)
    backend.failing_event_stream = 2            # stream 1's event is recorded, then given back
    backend.release_event_interrupts = True
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        a.free(p)
    backend.failing_event_stream = None
    backend.release_event_interrupts = False
    assert a.owns(p), "the free failed, but the block is no longer live"
    a._check_invariants()
    a.free(p)


# Bug C, fixed.
def test_an_interrupt_in_release_stream_leaves_no_block_behind():
    backend = Switchable()
    a = _core.CachingAllocator(backend, 0)
    a.free(a.malloc(1000, stream=3))            # stream 3 holds a cached segment
    backend.refuse = 1                          # so the malloc releases it and retries
    backend.release_stream_interrupts = True
    try:
        p = a.malloc(1000)
    except KeyboardInterrupt:
        p = None
    assert set(a.live_allocations()) == ({p} if p else set()), "a live block whose address no one has"


# Bug D, fixed.
def test_an_interrupt_in_the_history_hook_during_release_frees_no_other_owner():
    seen = []
    saved_hook = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append((info.exc_type, str(info.exc_value)))
    try:
        a = _core.CachingAllocator(SimulatedBackend(), 0)
        interrupt = []

        def hook(events):
            if interrupt:
                interrupt.pop()
                raise KeyboardInterrupt

        a.set_trace_hook(hook)
        old = a.allocate(1000)
        ptr = old.ptr
        interrupt.append(True)
        with pytest.raises(KeyboardInterrupt):
            old.release()
        freed, kept = not a.owns(ptr), old.ptr
        new_owner = a.allocate(1000)            # the same address
        del old
        new_owner_alive = a.owns(new_owner.ptr)
        try:
            new_owner.release()
        except ValueError:                      # "freed behind its Allocation's back"
            pass
    finally:
        sys.unraisablehook = saved_hook
    assert freed and kept == 0, "the handle still holds the address of the block it freed"
    assert new_owner_alive, "the old handle freed the new owner's block"
    assert not seen


def test_an_interrupt_in_event_done_loses_no_event():
    """Found by the machine (fixed by 0b527c6): an exception from event_done in
    process_events dropped the event being queried; its block waited forever."""
    backend = Switchable()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(1000)
    a.record_stream(p, 1)
    a.free(p)
    backend.event_done_fails = True
    with pytest.raises(KeyboardInterrupt):
        a.process_events()
    backend.complete(1)
    a.process_events()
    a.empty_cache()
    assert a.memory_stats()["active.all.current"] == 0, "the block waits for an event no one has"
    assert a.memory_reserved() == 0


class AnsweringMemoryInfo(SimulatedBackend):
    """A simulated device whose memory_info answers ``answer``."""

    answer = (1 << 30, 4 << 30)

    def memory_info(self, device):
        return self.answer


@pytest.mark.parametrize("answer", [(0, -1), (-5, 1 << 30), (0, 1 << 64), (0, 2.5), (0, True), (1,), None, "ab"])
def test_a_memory_info_answer_that_is_no_pair_of_byte_counts(answer):
    """set_memory_fraction converted memory_info's total into the allocator
    with its lock taken: a negative total raised OverflowError and left the
    lock held, and the next allocator call from another thread hung. Now a
    RuntimeError before anything changed; mem_get_info says the same."""
    backend = AnsweringMemoryInfo(1 << 40)
    a = _core.CachingAllocator(backend, 0)
    keep = a.malloc(1 << 20)
    backend.answer = answer
    with pytest.raises(RuntimeError, match="memory_info"):
        a.set_memory_fraction(0.5)
    assert a.get_memory_fraction() == 1.0
    with pytest.raises(RuntimeError, match="memory_info"):
        _core.backend_memory_info(backend, 0)
    done = []
    worker = threading.Thread(target=lambda: done.append(a.memory_stats()["allocation.all.current"]), daemon=True)
    worker.start()
    worker.join(30)
    assert done == [1], "another thread could not take the allocator's lock"
    # the out-of-memory error reads it too: it is still that error, counted once
    with pytest.raises(OutOfMemoryError):
        a.malloc(1 << 50)
    assert a.memory_stats()["num_ooms"] == 1
    a.free(keep)
    # and a new device allocator reads it for its capacity
    from unimem._runtime import devices
    with pytest.raises(RuntimeError, match="memory_info"):
        devices.new_allocator(devices.DEVICE_POOLS["cpu"], backend, 0)


def test_a_backend_without_memory_info_does_not_know_its_memory():
    """memory_info is optional (backends/base.py): a backend with only malloc
    and free gave AttributeError from set_per_process_memory_fraction and
    mem_get_info; it is the NotImplementedError of a PluggableAllocator
    without memory_info_fn."""

    class MallocAndFreeOnly:
        def __init__(self):
            self.simulated = SimulatedBackend(1 << 40)

        def malloc(self, size, device, stream):
            return self.simulated.malloc(size, device, stream)

        def free(self, ptr, size, device, stream):
            self.simulated.free(ptr, size, device, stream)

    a = _core.CachingAllocator(MallocAndFreeOnly(), 0)
    with pytest.raises(NotImplementedError, match="no memory_info"):
        a.set_memory_fraction(0.5)
    with pytest.raises(NotImplementedError, match="no memory_info"):
        _core.backend_memory_info(a.backend, 0)
    a.free(a.malloc(100))
    assert a.memory_stats()["allocation.all.allocated"] == 1
