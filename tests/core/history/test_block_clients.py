"""Every block remembers its client: the framework whose entry point it was
handed out through (``CachingAllocator.allocate(..., client=)`` here; each
framework's own entry point is tested with it: test_capi*.py, test_dpnp_allocator.py,
test_numba_manager.py, test_sycl_interposer.py, test_torch_allocator.py). Snapshots,
the history and ``memory_allocated_by_client`` tell it; a free block has no
client."""
import pytest

from unimem import _core
from unimem.backends._host import PageAlignedBackend
from unimem.backends.simulated import SimulatedBackend

MiB = 1 << 20


def new_allocator():
    return _core.CachingAllocator(SimulatedBackend(capacity=1 << 40), 0)


def blocks_of(a):
    return {b["address"]: b for s in a.snapshot() for b in s["blocks"]}


def test_a_block_stays_120_bytes():
    """blocks.pxd: the client is a byte of the padding after ``releasing``
    (128 bytes measured 6% slower on the typed core pair)."""
    assert _core._BLOCK_BYTES == 120


def test_the_clients_are_named_in_order():
    assert _core.CLIENTS == ("unimem", "torch", "cupy", "dpnp", "numba", "c")


@pytest.mark.parametrize("client", _core.CLIENTS)
def test_each_client_is_remembered_and_a_free_block_has_none(client):
    a = new_allocator()
    held = a.allocate(1000, 0, client)
    assert a.memory_allocated_by_client() == {client: 1024}
    states = {b["state"]: b["client"] for b in blocks_of(a).values()}
    assert states == {"active_allocated": client, "inactive": None}
    held.release()
    assert a.memory_allocated_by_client() == {}
    assert {b["client"] for b in blocks_of(a).values()} == {None}


def test_unimems_own_functions_are_unimems():
    a = new_allocator()
    p = a.malloc(1000)
    held = a.allocate(3000)
    assert a.memory_allocated_by_client() == {"unimem": 1024 + 3072}
    assert blocks_of(a)[p]["client"] == blocks_of(a)[held.ptr]["client"] == "unimem"
    a.free(p)


def test_a_block_split_from_a_free_one_takes_the_requests_client():
    a = new_allocator()
    first = a.allocate(1000, 0, "cupy")
    address = first.ptr
    first.release()
    # the same size again: the pair's shortcut hands the same block out again (_core_pair.pxi)
    again = a.allocate(1000, 0, "numba")
    assert again.ptr == address and blocks_of(a)[address]["client"] == "numba"
    # another size: the put-off merge is done first, then the free rest is split
    other = a.allocate(5000, 0, "c")
    # a miss: a new segment
    big = a.allocate(30 * MiB, 0, "torch")
    blocks = blocks_of(a)
    assert [blocks[p]["client"] for p in (again.ptr, other.ptr, big.ptr)] == ["numba", "c", "torch"]
    assert a.memory_allocated_by_client() == {"torch": 30 * MiB, "numba": 1024, "c": 5120}
    assert sum(a.memory_allocated_by_client().values()) == a.memory_allocated()
    assert all(b["client"] is None for b in blocks.values() if b["state"] == "inactive")
    a._check_invariants()


def test_routed_and_uncached_requests_remember_their_client():
    a = new_allocator()
    a.create_pool((0, 1))
    a.begin_pool((0, 1))
    try:
        in_pool = a.allocate(2000, 0, "dpnp")
    finally:
        a.end_pool((0, 1))
    a.set_caching(False)
    uncached = a.allocate(4000, 0, "numba")
    a.set_caching(True)
    blocks = blocks_of(a)
    assert blocks[in_pool.ptr]["client"] == "dpnp" and blocks[uncached.ptr]["client"] == "numba"
    assert a.memory_allocated_by_client() == {"dpnp": 2048, "numba": 4096}
    del in_pool, uncached


def test_a_block_waiting_on_a_stream_is_still_its_clients_but_allocated_to_no_one():
    backend = SimulatedBackend()
    a = _core.CachingAllocator(backend, 0)
    held = a.allocate(1000, 0, "cupy")
    address = held.ptr
    a.record_stream(address, 5)
    held.release()
    block = blocks_of(a)[address]
    assert (block["state"], block["client"]) == ("active_pending_free", "cupy")
    assert a.memory_allocated_by_client() == {} and a.memory_allocated() == 0
    backend.complete(5)
    a.process_events()
    assert blocks_of(a)[address]["client"] is None


def test_the_history_says_whose_block_each_event_is():
    a = new_allocator()
    events = []
    a.set_trace_hook(events.extend)
    held = a.allocate(1000, 0, "numba")
    held.release()
    p = a.malloc(512)
    a.free(p)
    a.set_trace_hook(None)
    assert [(e[0], e[5]) for e in events] == [
        ("segment_alloc", None), ("alloc", "numba"), ("free_requested", "numba"), ("free_completed", "numba"),
        ("alloc", "unimem"), ("free_requested", "unimem"), ("free_completed", "unimem")]


@pytest.mark.parametrize("client, error", [("tensorflow", ValueError), ("CuPy", ValueError),
                                           (3, TypeError), (b"cupy", TypeError)])
def test_a_client_unimem_does_not_know_is_refused_and_changes_nothing(client, error):
    a = new_allocator()
    with pytest.raises(error, match="unimem, torch, cupy, dpnp, numba, c"):
        a.allocate(1000, 0, client)
    stats = a.memory_stats()
    assert stats["allocation.all.allocated"] == 0 and stats["num_device_alloc"] == 0
    assert a.snapshot() == [] and a.memory_allocated_by_client() == {}


class ReleaseRefused(PageAlignedBackend):
    """release_pages raises with the memory left as it was, so that the free
    blocks a sleep holds stay in the snapshot."""

    def release_pages(self, address, size, device=0):
        raise OSError("refused")


def test_a_free_block_a_sleep_holds_has_no_client():
    """A split's free rest is a Block the slab kept from an earlier block
    (here a merged "numba" one): its client byte must be cleared, or the
    snapshot names a client that never held it (or, for a byte past the
    names, reads past the table)."""
    a = _core.CachingAllocator(ReleaseRefused(), 0)
    first, second = a.allocate(1000, 0, "numba"), a.allocate(1000, 0, "numba")
    first.release()
    second.release()                  # the merge gives one Block back to the slab
    held = a.allocate(3000, 0, "c")   # the split's rest takes it
    freed = a.allocate(1000, 0, "cupy")
    freed.release()                   # a block freed before the sleep: no client either
    a._check_invariants()
    with pytest.raises(OSError):
        a.sleep()
    blocks = blocks_of(a)
    assert blocks[held.ptr]["client"] == "c"
    assert {b["client"] for p, b in blocks.items() if p != held.ptr} == {None}
    a.wake_up()
    a._check_invariants()
