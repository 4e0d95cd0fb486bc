"""What the backend is told about streams (_core_stream_notices.pxi):
``check_stream`` when record_stream names one, ``release_stream`` once the
core keeps nothing for one. Both run with the lock let go, so a naming and a
release of one stream can be told at once; whatever the order, the backend
must end up holding what the core's table says (the XPU backend keeps a
stream's SYCL queue from its check to its release, and a handle let go while
blocks wait on the queue's work could go to another queue)."""
import os
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fresh import run_within_timeout


class HeldStreams(SimulatedBackend):
    """The XPU backend's hold, modelled: check_stream begins it and
    release_stream ends it. ``during_check`` runs once inside check_stream
    after the hold begins; ``during_release`` once inside release_stream
    before it ends: the other call's effect then lands in the wrong order."""

    def __init__(self):
        super().__init__()
        self.held = set()
        self.calls = []
        self.during_check = None
        self.during_release = None
        self.after_release = None

    def check_stream(self, stream, device):
        self.calls.append(("check", stream))
        self.held.add(stream)
        hook, self.during_check = self.during_check, None
        if hook is not None:
            hook()

    def release_stream(self, stream, device):
        self.calls.append(("release", stream))
        hook, self.during_release = self.during_release, None
        if hook is not None:
            hook()
        self.held.discard(stream)
        hook, self.after_release = self.after_release, None
        if hook is not None:
            hook()


def end_the_use_of(allocator, backend, ptr, stream):
    """Free ``ptr`` (recorded on ``stream``) and let its event complete."""
    allocator.free(ptr)
    backend.complete(stream)
    allocator.process_events()


def two_blocks_p_on_stream_7():
    """An allocator of HeldStreams with two live blocks, p recorded on 7."""
    backend = HeldStreams()
    a = _core.CachingAllocator(backend, 0)
    p, q = a.malloc(4096), a.malloc(4096)
    a.record_stream(p, 7)
    return backend, a, p, q


def test_the_hold_begins_at_record_stream_and_ends_when_the_stream_is_released():
    backend = HeldStreams()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(4096)
    a.record_stream(p, 7)
    assert backend.held == {7} and a._stream_count() == 2
    end_the_use_of(a, backend, p, 7)
    assert backend.held == set() and a._stream_count() == 1
    assert backend.calls == [("check", 7), ("release", 7)]
    a._check_invariants()


def test_a_stream_named_again_while_its_release_is_told_keeps_the_hold():
    """While stream 7's release is told, the same thread (nothing holds the
    lock then) names 7 again: the record lands first, the release after it.
    The teller then finds 7 in the table and names it once more."""
    backend, a, p, q = two_blocks_p_on_stream_7()
    backend.during_release = lambda: a.record_stream(q, 7)
    end_the_use_of(a, backend, p, 7)
    assert a._stream_count() == 2                   # q's use of 7
    assert backend.held == {7}
    assert backend.calls == [("check", 7), ("release", 7), ("check", 7), ("check", 7)]
    end_the_use_of(a, backend, q, 7)
    assert backend.held == set() and a._stream_count() == 1
    a._check_invariants()


def test_a_stream_named_on_another_thread_while_its_release_is_told_keeps_the_hold():
    """As above, from another thread: it is served while the release runs
    (the lock is let go), and the release's teller settles the hold."""
    backend, a, p, q = two_blocks_p_on_stream_7()
    served_during_the_release = []

    def name_again_elsewhere():
        t = threading.Thread(target=a.record_stream, args=(q, 7))
        t.start()
        t.join(5.0)
        served_during_the_release.append(not t.is_alive())

    backend.during_release = name_again_elsewhere
    end_the_use_of(a, backend, p, 7)
    assert served_during_the_release == [True]
    assert backend.held == {7} and a._stream_count() == 2
    end_the_use_of(a, backend, q, 7)
    assert backend.held == set()
    a._check_invariants()


def test_a_check_that_lands_after_a_release_is_undone_when_its_record_is_refused():
    """While stream 7's release is told, record_stream checks 7 after the
    release ended (the hold begins again), and its block goes meanwhile: the
    record is refused. The teller, told the check happened, releases 7
    once more, so the backend holds nothing the table has no entry for."""
    backend, a, p, q = two_blocks_p_on_stream_7()
    refused = []

    def record_a_block_that_goes():
        backend.during_check = lambda: a.free(q)
        with pytest.raises(_core.InvalidPointerError) as error:
            a.record_stream(q, 7)
        refused.append(error.value)

    backend.after_release = record_a_block_that_goes
    end_the_use_of(a, backend, p, 7)
    assert len(refused) == 1
    assert backend.held == set() and a._stream_count() == 1
    assert backend.calls == [("check", 7), ("release", 7), ("check", 7), ("release", 7)]
    a._check_invariants()


def test_a_release_told_while_record_stream_checks_the_stream_is_settled():
    """record_stream checks stream 7 (the hold begins); meanwhile empty_cache
    gives back 7's cached segment and tells its release (the hold ends).
    Then the record gives 7 an entry again: record_stream sees a release
    told since its check and names 7 once more."""
    backend = HeldStreams()
    a = _core.CachingAllocator(backend, 0)
    a.free(a.malloc(4096, 7))                       # a segment cached on 7
    p = a.malloc(4096)
    backend.during_check = a.empty_cache
    a.record_stream(p, 7)
    assert ("release", 7) in backend.calls
    assert backend.held == {7} and a._stream_count() == 2
    end_the_use_of(a, backend, p, 7)
    assert backend.held == set()
    a._check_invariants()


def test_a_block_freed_while_its_stream_is_checked_leaves_no_hold():
    """The block goes (a finalizer, another thread) while record_stream
    checks the stream: the record is refused, and the hold the check began
    is ended, since the table has no entry for the stream."""
    backend = HeldStreams()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    backend.during_check = lambda: a.free(p)
    with pytest.raises(_core.InvalidPointerError, match="freed while the stream was checked"):
        a.record_stream(p, 7)
    assert backend.held == set() and a._stream_count() == 1
    assert backend.calls == [("check", 7), ("release", 7)]
    after = a.memory_stats()
    assert after["allocation.all.current"] == 0
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    a._check_invariants()


def test_a_refused_stream_is_not_recorded_and_nothing_is_told_after():
    class Refusing(HeldStreams):
        def check_stream(self, stream, device):
            self.calls.append(("check", stream))
            raise ValueError(f"no stream {stream}")

    backend = Refusing()
    a = _core.CachingAllocator(backend, 0)
    p = a.malloc(4096)
    before = a.memory_stats()
    with pytest.raises(ValueError, match="no stream 7"):
        a.record_stream(p, 7)
    assert a.memory_stats() == before and a._stream_count() == 1
    assert backend.calls == [("check", 7)]
    a.free(p)
    assert backend.calls == [("check", 7)]
    a._check_invariants()


def test_a_stream_whose_release_was_being_told_at_a_fork_is_released_in_the_child():
    """fork() from inside release_stream: in the child nobody is telling
    about the stream any more (the teller's call never returns there), so
    it is told again at the child's next release."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    result = run_within_timeout("""
        import os
        from unimem import _core
        from tests.core.streams.test_stream_notices import HeldStreams, end_the_use_of

        backend = HeldStreams()
        a = _core.CachingAllocator(backend, 0)
        p = a.malloc(4096)
        a.record_stream(p, 7)

        def fork_here():
            pid = os.fork()
            if pid == 0:
                ok = backend.held == {7}                # this call's release never happens here
                a.empty_cache()                         # the child's next release told
                ok = ok and backend.held == set() and a._stream_count() == 1
                a._check_invariants()
                os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
            print("child", os.waitstatus_to_exitcode(status))

        backend.during_release = fork_here
        end_the_use_of(a, backend, p, 7)
        assert backend.held == set()
    """, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert "child 0" in result.stdout, result.stdout + result.stderr
