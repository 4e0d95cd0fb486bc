"""What the misbehaving-backend state machines share.

tests/core/robustness/test_misbehaving_backend.py drives a caching allocator with
segments, tests/core/robustness/test_misbehaving_expandable.py one with expandable
segments; both over :class:`MisbehavingBackend`, a simulated device whose
callbacks misbehave as planned (garbage collections that free blocks of the
same allocator re-entrantly, interrupts, errors). :class:`AllocatorMachine`
holds their common part: the bookkeeping of what was handed out, the plain
rules (malloc, free, release, record_stream, stream work, empty_cache, the
cache switch, frees made on other threads), the checks every step must pass
and the final draining.

Rules, invariants and the teardown are guarded (tests/helpers/crash_guard.py):
a machine with ``guard_steps = True`` runs each example in a forked copy
first, so that a crash of the compiled core is a shrunk, printed failure.
"""
import sys
import threading
from contextlib import contextmanager

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unimem import OutOfMemoryError, _core
from unimem.backends.base import Backend
from unimem.backends.faults import InjectedFault
from unimem.backends.simulated import SimulatedBackend

from .crash_guard import guarded, guarded_check, guarded_teardown

MiB = 1 << 20
CAPACITY = 1 << 30
STREAMS = (0, 1, 2, 3)

sizes = st.one_of(st.integers(1, 4096), st.integers(4097, MiB), st.integers(MiB + 1, 12 * MiB),
                  st.integers(12 * MiB, 80 * MiB))
streams = st.sampled_from(STREAMS)


#: The thread hypothesis runs the machines on: it records events there only.
MACHINE_THREAD = threading.get_ident()


def note(event):
    """``hypothesis.event``, skipped on the threads a rule starts (a free on
    another thread may run callbacks there)."""
    if threading.get_ident() == MACHINE_THREAD:
        hypothesis.event(event)


class HookError(Exception):
    """An ordinary error from the history hook: reported as unraisable, not raised."""


#: Failures of the event callbacks and the history hook, for both machines:
#: (callback, action).
EVENT_CHAOS = [("record_event", ("interrupt",)), ("record_event", ("raise",)),
               ("event_done", ("interrupt",)), ("event_synchronize", ("interrupt",)),
               ("history", ("interrupt",)), ("history", ("error",)),
               ("release_event", ("interrupt",)), ("release_stream", ("interrupt",))]     # bugs B and C


# --------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------
class MisbehavingBackend(Backend):
    """A simulated device whose callbacks misbehave as planned.

    ``plans[callback]`` is a queue of actions; each call of ``callback`` made
    directly by the core (not from inside another callback, such as a
    finalizer run by a garbage collection in one) takes the next action.
    """

    name = "SIM"
    CALLBACKS = ("malloc", "free", "record_event", "event_done", "event_synchronize",
                 "release_event", "release_stream", "history")

    def __init__(self, collect, inner=None):
        self.inner = inner if inner is not None else SimulatedBackend(capacity=CAPACITY)
        self.collect = collect          # collect(count, offset, callback): drop Allocations (a GC)
        self.plans = {name: [] for name in self.CALLBACKS}
        self.depth = 0                  # > 0: inside one of our callbacks
        self.suspended = 0              # > 0: no plan is taken
        self.paused = set()             # callbacks whose plans wait
        self.fired = []                 # every exception injected
        self.stranded = {}              # address -> size: still held by the device, unknown to the core
        self.failed_frees = []          # sizes of the segments whose free raised
        self.malloc_log = []            # top-level malloc outcomes: "refused" or "address"
        self.free_log = []              # top-level frees: (address, size, action)
        self.top_events = []            # events recorded by top-level record_event calls
        self.recorded = {}              # id -> every event recorded
        self.released = []              # events given back by the core
        self.violations = []            # misuse of the backend by the core
        self.runtime_threads = set()    # threads freeing as a SYCL host task does: none may call us

    def disarm(self):
        for plan in self.plans.values():
            plan.clear()

    @contextmanager
    def isolated(self):
        """Plans made before wait: only those made inside apply meanwhile."""
        saved = {name: list(plan) for name, plan in self.plans.items()}
        self.disarm()
        try:
            yield
        finally:
            self.plans = saved

    @contextmanager
    def quiet(self, *callbacks):
        """No plan is taken meanwhile (of ``callbacks`` only, if named)."""
        if callbacks:
            saved = set(self.paused)
            self.paused |= set(callbacks)
        else:
            self.suspended += 1
        try:
            yield
        finally:
            if callbacks:
                self.paused = saved
            else:
                self.suspended -= 1

    @contextmanager
    def _inside(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def _action(self, callback):
        if threading.get_ident() in self.runtime_threads:
            # a free there must wait for nothing: the XPU backend's free waits for a queue
            self.violations.append(f"{callback} called on a runtime's thread")
        if self.depth or self.suspended or callback in self.paused or not self.plans[callback]:
            return ("ok",)
        action = self.plans[callback].pop(0)
        note(f"{callback}: {action[0]}")
        return action

    def _fire(self, exc):
        self.fired.append(exc)
        return exc

    def _common(self, callback, action):
        """The actions every callback knows, before it does its work."""
        if action[0] == "gc":
            self.collect(action[1], action[2], callback)
        elif action[0] == "interrupt":
            raise self._fire(KeyboardInterrupt(f"injected in {callback}"))
        elif action[0] == "raise":
            raise self._fire(InjectedFault(f"injected failure in {callback}"))

    # raw memory ---------------------------------------------------------------------
    def malloc(self, size, device, stream):
        top = self.depth == 0
        action = self._action("malloc")
        with self._inside():
            self._common("malloc", action)
            kind = action[0]
            if kind == "refuse":
                if top:
                    self.malloc_log.append("refused")
                if action[1] == "memory_error":
                    raise MemoryError("injected: the device is full")
                return 0 if action[1] == "zero" else None
            if kind == "return":                       # a bad answer; nothing was allocated
                if top:
                    self.malloc_log.append("address")
                return action[1]
            ptr = self.inner.malloc(size, device, stream)
            if top:
                self.malloc_log.append("address" if ptr else "refused")
            if kind == "interrupt_after":              # taken, and the address never told
                if ptr:
                    self.stranded[ptr] = size
                raise self._fire(KeyboardInterrupt("injected in malloc, after allocating"))
            return ptr

    def free(self, ptr, size, device, stream):
        action = self._action("free")
        with self._inside():
            if self.depth == 1:
                self.free_log.append((ptr, size, action[0]))
            if action[0] == "gc":
                self.collect(action[1], action[2], "free")
            kind = action[0]
            if kind in ("raise_before", "interrupt_before"):
                self.stranded[ptr] = size
                self.failed_frees.append(size)
                raise self._fire(KeyboardInterrupt("injected in free, before freeing")
                                 if kind == "interrupt_before" else
                                 InjectedFault(f"injected failure freeing {ptr:#x}, not freed"))
            try:
                self.inner.free(ptr, size, device, stream)
            except Exception as exc:
                self.violations.append(f"the core freed {ptr:#x} ({size} bytes): {exc}")
                raise
            if kind in ("raise_after", "interrupt_after"):
                self.failed_frees.append(size)
                raise self._fire(KeyboardInterrupt("injected in free, after freeing")
                                 if kind == "interrupt_after" else
                                 InjectedFault(f"injected failure freeing {ptr:#x}, after freeing"))

    def memory_info(self, device):
        return self.inner.memory_info(device)

    def device_count(self):
        return 1

    # streams ------------------------------------------------------------------------
    def check_stream(self, stream, device):
        if stream not in STREAMS:
            raise ValueError(f"no stream {stream}")

    def record_event(self, stream, device):
        top = self.depth == 0
        action = self._action("record_event")
        with self._inside():
            self._common("record_event", action)
            event = self.inner.record_event(stream, device)
            self.recorded[id(event)] = event
            if top:
                self.top_events.append(event)
            return event

    def release_event(self, event):
        action = self._action("release_event")
        with self._inside():
            if action[0] == "gc":
                self.collect(action[1], action[2], "release_event")
            if self.recorded.get(id(event)) is not event:
                self.violations.append(f"release_event of {event!r}, never recorded")
            if any(event is e for e in self.released):
                self.violations.append(f"release_event of {event!r} twice")
            self.released.append(event)
            if action[0] in ("interrupt", "raise"):
                self._common("release_event", action)

    def _waited_on(self, event, what):
        if any(event is e for e in self.released):
            self.violations.append(f"{what} of {event!r}, which the core gave back")

    def event_done(self, event):
        action = self._action("event_done")
        with self._inside():
            self._waited_on(event, "event_done")
            self._common("event_done", action)
            return self.inner.event_done(event)

    def event_synchronize(self, event):
        action = self._action("event_synchronize")
        with self._inside():
            self._waited_on(event, "event_synchronize")
            self._common("event_synchronize", action)
            self.inner.event_synchronize(event)

    def release_stream(self, stream, device):
        action = self._action("release_stream")
        with self._inside():
            self._common("release_stream", action)

    # the allocator's history hook ---------------------------------------------------
    def history(self, events):
        action = self._action("history")
        with self._inside():
            if action[0] == "error":
                raise self._fire(HookError("injected error in the history hook"))
            self._common("history", action)


# --------------------------------------------------------------------------------------
# what both machines do
# --------------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """An allocator over ``backend`` (a :class:`MisbehavingBackend`), the
    plain rules and the checks every allocator passes; subclasses add the
    misbehaviour and the checks of their kind of segments."""

    #: Try every step in a forked copy first (tests.helpers.crash_guard).
    guard_steps = False
    #: Whether a garbage collection in a callback also frees plain blocks.
    collect_frees_raw = False

    def __init__(self, backend, capacity=CAPACITY, **options):
        super().__init__()
        self.backend = backend
        self.device = backend.inner
        self.core = _core.CachingAllocator(backend, 0, **options)
        self.core.set_capacity(capacity)
        self.core.set_trace_hook(backend.history)
        self.raw = set()            # live addresses from malloc
        self.handles = {}           # address -> the only reference to its Allocation
        self.requests = {}          # address -> (requested size, stream)
        self.uses = {}              # address -> streams record_stream named
        self.kept = set()           # freed on a runtime's thread: live until a call from Python's side
        self.pinned = set()         # blocks a garbage collection must not free now
        self.unraisable = []
        self._unraisablehook = sys.unraisablehook
        # Only the type and text: a traceback would keep frames, and the
        # Allocations in their variables, alive.
        sys.unraisablehook = lambda info: self.unraisable.append(
            (info.exc_type, str(info.exc_value), f"{info.err_msg or ''} {info.object}"))

    # -- bookkeeping ------------------------------------------------------------------
    def live(self):
        return self.raw | set(self.handles)

    def adopt(self, ptr, size, stream, handle=None):
        assert ptr != 0
        assert ptr not in self.live(), f"{ptr:#x} handed out while live"
        if handle is None:
            self.raw.add(ptr)
        else:
            self.handles[ptr] = handle
        self.requests[ptr] = (size, stream)
        self.kept.discard(ptr)      # handed out again: its kept free was done

    def forget(self, ptr):
        self.raw.discard(ptr)
        self.handles.pop(ptr, None)
        del self.requests[ptr]
        self.uses.pop(ptr, None)

    def collect(self, count, offset, callback, near=None):
        """A garbage collection inside ``callback``: the last references to
        ``count`` Allocations go, and their finalizers free the blocks; with
        :attr:`collect_frees_raw`, plain blocks count too, freed as a
        ``__del__`` would. By address, or with ``near`` (a span: address,
        size) the blocks nearest to it first: its neighbours."""
        def distance(p):
            size = self.requests[p][0]
            return max(0, p - (near[0] + near[1]), near[0] - (p + size)), p
        owned = set(self.handles) | (self.raw if self.collect_frees_raw else set())
        candidates = [p for p in sorted(owned, key=None if near is None else distance) if p not in self.pinned]
        chosen = (candidates[offset:] + candidates[:offset])[:count] if candidates else []
        victims = [self.handles[p] for p in chosen if p in self.handles]
        raw = [p for p in chosen if p in self.raw]
        for p in chosen:
            self.forget(p)
        if chosen:
            note(f"finalizers run inside {callback}")
        del victims                                            # the finalizers run here
        # A finalizer run inside a backend call still made with the lock
        # held: its free went to the inbox, done as the operation ends, or
        # kept when its events cannot be recorded then (an injected fault).
        live = self.core.live_allocations()
        self.kept |= {p for p in chosen if p in live}
        for p in raw:
            try:
                self.core.free(p)
            except BaseException as exc:                       # what a __del__'s error becomes
                self.unraisable.append((type(exc), f"free({p:#x}) in a finalizer: {exc}"))

    def attempt(self, call):
        """``(result, None)``, or ``(None, error)`` for an error injected during the call."""
        mark = len(self.backend.fired)
        try:
            return call(), None
        except BaseException as exc:
            if any(exc is e for e in self.backend.fired[mark:]):
                return None, exc
            raise
        finally:
            for exc in self.backend.fired[mark:]:
                exc.__traceback__ = None       # its frames would keep Allocations alive

    # -- plain use ------------------------------------------------------------------
    @initialize(blocks=st.lists(st.tuples(st.integers(1, 3 * MiB), streams, st.booleans(),
                                          st.sets(streams, max_size=2)), max_size=8))
    @guarded
    def some_blocks(self, blocks):
        """A few Allocations (and plain blocks) for the garbage collections to find."""
        for size, stream, handle, used_on in blocks:
            before = self.live()
            self.malloc(size, stream, handle)
            for ptr in self.live() - before:
                for other in sorted(used_on - {stream}):
                    self.core.record_stream(ptr, other)
                    self.uses.setdefault(ptr, set()).add(other)

    @rule(size=sizes, stream=streams, handle=st.booleans())
    @guarded
    def malloc(self, size, stream, handle):
        allocate = self.core.allocate if handle else self.core.malloc
        try:
            result, error = self.attempt(lambda: allocate(size, stream))
        except OutOfMemoryError:
            return
        if error is None:
            self.adopt(result.ptr if handle else result, size, stream, result if handle else None)

    @precondition(lambda self: self.raw)
    @rule(data=st.data())
    @guarded
    def free(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.raw)), label="address")
        self.pinned.add(ptr)                    # a collection meanwhile must not free it too
        try:
            _, error = self.attempt(lambda: self.core.free(ptr))
        finally:
            self.pinned.discard(ptr)
        if error is None or not self.core.owns(ptr):        # an interrupt: done, or not done
            self.forget(ptr)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), drop=st.booleans())
    @guarded
    def release(self, data, drop):
        ptr = data.draw(st.sampled_from(sorted(self.handles)), label="allocation")
        if drop:
            with self.backend.quiet():          # a finalizer cannot raise: nothing is injected in it
                self.forget(ptr)
            return
        handle = self.handles[ptr]
        self.pinned.add(ptr)
        try:
            _, error = self.attempt(handle.release)     # bug D was a Ctrl-C in the hook here
        finally:
            self.pinned.discard(ptr)
        if error is not None and self.core.owns(ptr):
            assert handle.ptr == ptr, "the free did not happen, but the handle let go of its block"
        else:
            assert handle.ptr == 0, "the block was freed, but its handle still holds the address"
            self.forget(ptr)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), stream=streams)
    @guarded
    def record_stream(self, data, stream):
        ptr = data.draw(st.sampled_from(sorted(self.live())), label="address")
        self.core.record_stream(ptr, stream)
        if stream != self.requests[ptr][1]:
            self.uses.setdefault(ptr, set()).add(stream)

    @rule(stream=streams)
    @guarded
    def stream_work_completes(self, stream):
        self.device.complete(stream)

    @rule()
    @guarded
    def process_events(self):
        self.attempt(self.core.process_events)

    @rule(stream=st.one_of(st.none(), streams))
    @guarded
    def empty_cache(self, stream):
        self.attempt(lambda: self.core.empty_cache(stream))

    @rule(enabled=st.booleans())
    @guarded
    def cache_switch(self, enabled):
        """caching_allocator_enable: off, what is cached goes back and every
        free gives its segment back."""
        self.attempt(lambda: self.core.set_caching(enabled))

    @precondition(lambda self: self.raw)
    @rule(data=st.data(), runtime=st.booleans())
    @guarded
    def free_on_another_thread(self, data, runtime):
        """A block freed on a thread of its own: a Python thread's free, or
        (``runtime``) one let go of as a SYCL host task does (c_free_detached
        without the GIL): the backend is never called there (a violation
        otherwise), and the free is done at once or kept for the next call
        from Python's side."""
        ptr = data.draw(st.sampled_from(sorted(self.raw)), label="address")
        outcome = []

        def run():
            if not runtime:
                try:
                    outcome.append(self.attempt(lambda: self.core.free(ptr)))
                except BaseException as exc:        # not injected: raised below, on the machine's thread
                    outcome.append((None, exc))
                    outcome.append(exc)
                return
            self.backend.runtime_threads.add(threading.get_ident())
            try:
                self.core._free_as_runtime_thread(ptr)
            finally:
                self.backend.runtime_threads.discard(threading.get_ident())

        self.pinned.add(ptr)
        try:
            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            worker.join(30)
        finally:
            self.pinned.discard(ptr)
        assert not worker.is_alive(), "a free on another thread hung"
        if len(outcome) > 1:
            raise outcome[1]
        if runtime:
            self.forget(ptr)
            self.kept.add(ptr)
        elif outcome[0][1] is None or not self.core.owns(ptr):   # an interrupt: done, or not done
            self.forget(ptr)

    # -- after every step -------------------------------------------------------------
    @invariant()
    @guarded_check
    def statistics_consistent(self):
        self.core._check_invariants()
        stats = self.core.memory_stats()
        for key, value in stats.items():
            if key.endswith(".current"):
                name = key[:-len(".current")]
                assert value >= 0, f"{key} = {value}"
                assert stats[name + ".allocated"] - stats[name + ".freed"] == value, name
                assert stats[name + ".peak"] >= value, name

    @invariant()
    @guarded_check
    def live_blocks_as_handed_out(self):
        """No block handed out twice: the live blocks are those handed out and
        not freed, with the sizes and streams asked for, and disjoint."""
        live = self.core.live_allocations()
        self.kept &= set(live)                          # the kept frees done since
        assert set(live) - self.kept == self.live(), "the live blocks are not those handed out and not freed"
        for ptr, (size, requested, stream) in live.items():
            if ptr in self.kept:
                continue
            assert (requested, stream) == self.requests[ptr]
            assert size >= self.core.round_size(requested)
        spans = sorted((p, size) for p, (size, _, _) in live.items())
        for (a, size), (b, _) in zip(spans, spans[1:]):
            assert a + size <= b, f"live blocks {a:#x} and {b:#x} overlap"

    @invariant()
    @guarded_check
    def backend_used_as_its_contract_says(self):
        assert not self.backend.violations, self.backend.violations
        unexpected = [e for e in self.unraisable if e[0] is not HookError and not self.tolerated(e)]
        assert not unexpected, f"unraisable errors: {unexpected!r}"

    def tolerated(self, reported):
        """Whether an unraisable error ``(type, text, where)`` is one the
        machine's kind of allocator reports by design: a kept free whose
        event could not be recorded (kept for the next call)."""
        exc_type, _, where = reported
        return issubclass(exc_type, InjectedFault) and "a runtime's thread let go of" in where

    def drain(self):
        """Free everything and empty the cache: nothing may stay live or counted."""
        self.backend.disarm()
        handles = list(self.handles.values())
        for handle in handles:
            handle.release()
        for ptr in list(self.raw):
            self.core.free(ptr)
        for stream in STREAMS:
            self.device.complete(stream)
        self.core.empty_cache()                 # the kept frees first: their events are recorded
        for stream in STREAMS:
            self.device.complete(stream)
        self.core.empty_cache()
        self.core._check_invariants()
        assert self.core.live_allocations() == {}
        stats = self.core.memory_stats()
        assert all(v == 0 for k, v in stats.items() if k.endswith(".current")), \
            {k: v for k, v in stats.items() if k.endswith(".current") and v}
        assert not self.backend.violations, self.backend.violations
        self.check_drained()

    def check_drained(self):
        """What the device must hold once everything was freed (per kind of segments)."""

    def teardown(self):
        try:
            guarded_teardown(self, self.drain)
        finally:
            sys.unraisablehook = self._unraisablehook
