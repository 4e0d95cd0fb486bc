"""Expandable segments' virtual-memory calls are made with the core's lock let
go (_core_expandable.pxi): what a call is about is marked meanwhile, and what
may have changed is read again after it. Here something else happens while a
call is in flight: the opposite operation on another thread (emptying the
caches while a range is mapped, taking the free block a request grows,
growing beside pages being unmapped), or a sleep() from the call's own Python.
After each: the core's invariants, reserved bytes equal to what the device
has mapped, and nothing left mapped or reserved once everything is freed."""
import threading

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20
WAIT_S = 5.0


class Hooked(SimulatedBackend):
    """A simulated device whose virtual-memory calls run a hook once, named
    by the call, before (or, with ``after``, after) the real work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = {}
        self.fail_next_unmap = None

    def _hook(self, name, when):
        hook = self.hooks.get(name)
        if hook is not None and hook[0] == when:
            del self.hooks[name]
            hook[1]()

    def map_pages(self, address, size, device):
        self._hook("map_pages", "before")
        super().map_pages(address, size, device)
        self._hook("map_pages", "after")

    def unmap_pages(self, address, size, device):
        self._hook("unmap_pages", "before")
        if self.fail_next_unmap is not None:
            error, self.fail_next_unmap = self.fail_next_unmap, None
            raise error
        super().unmap_pages(address, size, device)

    def mapped_bytes(self):
        return len(self.mapped_pages[0]) * self.granularity


def allocator(capacity=256 * MiB):
    backend = Hooked(capacity=capacity, granularity=2 * MiB)
    core = _core.CachingAllocator(backend, 0, expandable_segments=True)
    core.set_capacity(capacity)
    return core, backend


def on_another_thread(work):
    """Run ``work`` on another thread; it must finish while the call that
    runs this waits (the lock is let go)."""
    errors = []

    def run():
        try:
            work()
        except BaseException as exc:        # reported here
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), "the other thread waited for the lock the call holds"
    assert not errors, errors


def check(core, backend):
    core._check_invariants()
    assert core.memory_reserved() == core.memory_stats()["reserved_bytes.all.current"] == backend.mapped_bytes()


def drain(core, backend, live):
    for ptr in live:
        core.free(ptr)
    core.empty_cache()
    core.empty_virt_addr_cache()
    check(core, backend)
    assert core.memory_reserved() == 0 and backend.mapped_bytes() == 0
    assert core.reserved_address_space()["ranges"] == 0 and not backend.ranges[0]


def test_emptying_the_caches_on_another_thread_leaves_the_range_being_mapped():
    """The first request of stream 3 maps the only span of its new range;
    empty_cache and empty_virt_addr_cache on another thread meanwhile give
    back everything else (the small pool's cached page and its range) but
    neither merge, unmap nor release that span's range."""
    core, backend = allocator()
    core.free(core.malloc(4096))                # a cached small page: it goes
    backend.hooks["map_pages"] = ("before", lambda: on_another_thread(
        lambda: (core.empty_cache(), core.empty_virt_addr_cache())))
    p = core.malloc(64 * MiB, 3)
    check(core, backend)
    assert core.reserved_address_space()["ranges"] == 1
    assert core.memory_reserved() == 64 * MiB
    drain(core, backend, [p])


def test_another_thread_taking_the_free_block_a_request_grows():
    """[A free][hole unmapped][B live]: a 6 MiB request grows A over the
    hole; while the hole is mapped another thread takes A. The request looks
    for its place again and never hands out B's or the other block's bytes."""
    core, backend = allocator()
    a = core.malloc(2 * MiB)
    hole = core.malloc(4 * MiB)
    b = core.malloc(2 * MiB)
    assert hole == a + 2 * MiB and b == a + 6 * MiB
    core.free(hole)
    core.empty_cache()
    core.free(a)
    taken = []
    backend.hooks["map_pages"] = ("after", lambda: on_another_thread(lambda: taken.append(core.malloc(2 * MiB))))
    big = core.malloc(6 * MiB)
    check(core, backend)
    assert taken == [a]
    spans = sorted([(big, 6 * MiB), (b, 2 * MiB), (a, 2 * MiB)])
    for (x, n), (y, _) in zip(spans, spans[1:]):
        assert x + n <= y, "live blocks overlap"
    drain(core, backend, [a, b, big])


def test_growing_beside_pages_being_unmapped_on_another_thread():
    """[A live][F free 4 MiB][unmapped]: while empty_cache unmaps F's pages
    (held), a request on another thread maps after them, not into them; the
    span F's pages become stays apart from the mapped block after it."""
    core, backend = allocator()
    a = core.malloc(2 * MiB)
    f = core.malloc(4 * MiB)
    core.free(f)
    grown = []
    backend.hooks["unmap_pages"] = ("before", lambda: on_another_thread(lambda: grown.append(core.malloc(6 * MiB))))
    core.empty_cache()
    check(core, backend)
    assert len(grown) == 1 and not (f <= grown[0] < f + 4 * MiB)
    assert core.memory_reserved() == 8 * MiB
    drain(core, backend, [a] + grown)


def test_a_sleep_that_comes_in_while_pages_are_mapped_sends_them_back():
    """sleep() from the map's own Python (a finalizer): the pages it mapped
    go back, the request is refused as an asleep allocator refuses, and
    nothing stays mapped while asleep (it did: the request was served)."""
    core, backend = allocator()
    keep = core.malloc(2 * MiB)
    backend.hooks["map_pages"] = ("after", lambda: core.sleep(offload=False))
    with pytest.raises(RuntimeError, match="asleep"):
        core.malloc(6 * MiB)
    assert core.is_sleeping()
    assert core.memory_reserved() == backend.mapped_bytes() == 0
    core._check_invariants()
    core.wake_up()
    check(core, backend)
    p = core.malloc(6 * MiB)
    assert core.memory_reserved() == 8 * MiB
    drain(core, backend, [keep, p])


def test_pages_a_sleep_sends_back_that_cannot_be_unmapped_are_lost():
    """The unmap that sends back the pages mapped while a sleep came in
    raises: those pages are lost (counted, never used again), the span after
    them stays whole, and the error reaches the caller."""
    core, backend = allocator()
    keep = core.malloc(2 * MiB)

    def sleep_then_fail():
        core.sleep(False)
        backend.fail_next_unmap = RuntimeError("the driver refused")
    backend.hooks["map_pages"] = ("after", sleep_then_fail)
    with pytest.raises(RuntimeError, match="the driver refused"):
        core.malloc(6 * MiB)
    assert core.lost_segments() == {"count": 1, "bytes": 6 * MiB}
    core._check_invariants()
    core.wake_up()
    core._check_invariants()
    p = core.malloc(6 * MiB)
    assert not (keep + 2 * MiB <= p < keep + 8 * MiB), "a lost page was handed out"
    core.free(p)
    core.free(keep)
    core.empty_cache()
    core._check_invariants()


def test_an_unmap_beside_a_span_being_mapped_joins_what_the_map_leaves():
    """[L1][hole, 6 MiB unmapped][F free][L2]: a 4 MiB request maps the start
    of the hole; meanwhile empty_cache on another thread unmaps F, which
    cannot merge with the span being mapped. The 2 MiB the map leaves
    unmapped join F's span once the map is done."""
    core, backend = allocator()
    l1, hole, f, l2 = (core.malloc(n * MiB) for n in (2, 6, 2, 2))
    core.free(hole)
    core.empty_cache()
    core.free(f)
    backend.hooks["map_pages"] = ("before", lambda: on_another_thread(core.empty_cache))
    p = core.malloc(4 * MiB)
    assert p == hole
    check(core, backend)
    assert core.memory_reserved() == 8 * MiB
    drain(core, backend, [l1, l2, p])
