"""The one inbox (_core_streams.pxi): a free that arrives while this
thread's own call still holds the core's lock (a finalizer run by a backend
call made under it: reserve_address_range, unmap_pages, release_stream) or
on a runtime's thread cannot record its events there, and is kept. It is
done before the operation that was running returns: the caller never sees
the block still live, nor its memory still counted."""
import gc

from unimem import _core
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

MiB = 1 << 20


class FinalizerInCallback:
    """A backend mixin: ``hooks[name]`` runs once, inside the next call of
    the backend's ``name`` (as a garbage collection there would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = {}

    def _run_hook(self, name):
        hook = self.hooks.pop(name, None)
        if hook is not None:
            hook()

    def reserve_address_range(self, size, device):
        self._run_hook("reserve_address_range")
        return super().reserve_address_range(size, device)

    def unmap_pages(self, *args, **kwargs):
        self._run_hook("unmap_pages")
        return super().unmap_pages(*args, **kwargs)

    def release_stream(self, stream, device):
        self._run_hook("release_stream")


class GPU(FinalizerInCallback, SimulatedGPU):
    pass


class Plain(FinalizerInCallback, SimulatedBackend):
    pass


def expandable():
    gpu = GPU(capacity=256 * MiB)
    a = _core.CachingAllocator(gpu, 0, expandable_segments=True, max_reserved_ratio=1.0)
    a.set_capacity(256 * MiB)
    return a, gpu


def test_an_allocation_dying_while_a_miss_reserves_address_space_is_freed_before_malloc_returns():
    a, gpu = expandable()
    held = [a.allocate(512, 0)]
    dying = int(held[0])
    a.record_stream(dying, 1)                   # its free records an event: it needs Python
    gpu.hooks["reserve_address_range"] = held.clear
    p = a.malloc(512, 1)                        # stream 1: a new range reserved
    live = a.live_allocations()
    assert dying not in live and set(live) == {p}
    assert a.memory_stats()["active.all.current"] == 2     # the dead block waits for its event
    gpu.complete(1)
    a.free(p)
    a.empty_cache()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()


def test_a_block_dying_while_empty_cache_unmaps_is_freed_before_empty_cache_returns():
    a, gpu = expandable()
    held = [a.allocate(512, 0)]
    dying = int(held[0])
    a.record_stream(dying, 1)
    a.free(a.malloc(20 * MiB))                  # free pages for empty_cache to unmap
    gpu.hooks["unmap_pages"] = held.clear
    a.empty_cache()
    assert dying not in a.live_allocations()
    gpu.complete(1)
    a.empty_cache()
    assert a.memory_stats()["active.all.current"] == 0 and a.memory_allocated() == 0
    a._check_invariants()


def test_a_block_freed_while_the_backend_is_told_of_a_dropped_stream_is_freed_before_the_call_returns():
    backend = Plain()
    a = _core.CachingAllocator(backend, 0)
    on_9 = a.malloc(4096, 9)                    # stream 9's pools
    y = a.malloc(4096)
    a.record_stream(y, 7)
    a.free(on_9)
    backend.hooks["release_stream"] = lambda: a.free(y)
    a.empty_cache()                             # stream 9 dropped: release_stream told
    assert y not in a.live_allocations()
    assert a.memory_stats()["active.all.current"] == 1     # y waits for its event
    backend.complete(7)
    a.process_events()
    assert a.memory_stats()["active.all.current"] == 0
    a._check_invariants()
