"""Host USM arrays share the pinned host pool's 2 MiB segments, whatever
queue they are made on, and their freed blocks are reused on every queue.

Host memory belongs to the SYCL context, not to a queue: the pool caches it
under no queue (PyTorch's CachingHostAllocator takes no stream). Keyed by
queue, each queue held a 2 MiB segment of its own, for a one-byte array on a
queue a user made or on one of the queues dpnp makes for itself (dpnp.ones'
fill on its first call), and a loop over queues pinned a new segment per queue.
On the real SYCL device (the OpenCL CPU device in CI): these tests must run.
"""
import json

import pytest

import unimem
from unimem import host
from tests.helpers.fresh import run_fresh

MiB = 1 << 20


def new_queue(xpu):
    """A queue of the default queue's context and device, not the default queue."""
    import dpctl
    default = xpu.default_queue()
    return dpctl.SyclQueue(default.sycl_context, default.sycl_device)


def segment_of(address):
    """The address of the pinned pool's segment holding ``address``."""
    for segment in host.caching_allocator().snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment["address"]
    raise AssertionError(f"{address:#x} is in no segment of the pinned host pool")


def address_of(array):
    return array.get_array().usm_data._pointer


MAKERS = {
    "dpnp.empty": lambda xpu, dpnp, queue: dpnp.empty(1, dtype="u1", usm_type="host", sycl_queue=queue),
    "dpnp.ones": lambda xpu, dpnp, queue: dpnp.ones(1, dtype="u1", usm_type="host", sycl_queue=queue),
    "unimem.xpu.empty": lambda xpu, dpnp, queue: xpu.empty(1, dtype="u1", usm_type="host", sycl_queue=queue),
}


@pytest.mark.parametrize("maker", MAKERS)
def test_six_one_byte_host_arrays_on_six_queues_share_one_segment(hooked, dpnp, maker):
    arrays = [MAKERS[maker](hooked, dpnp, new_queue(hooked)) for _ in range(6)]
    for array in arrays:
        assert array.usm_type == "host" and host.caching_allocator().owns(address_of(array))
    assert len({segment_of(address_of(array)) for array in arrays}) == 1
    assert len({array.sycl_queue for array in arrays}) == 6       # each array keeps its own queue
    if maker == "dpnp.ones":
        assert [int(array[0]) for array in arrays] == [1] * 6


@pytest.mark.parametrize("maker", MAKERS)
def test_a_loop_of_small_host_arrays_on_new_queues_reuses_one_segment(hooked, dpnp, maker):
    unimem.host.empty_host_cache()              # what stays holds live blocks
    keep = MAKERS[maker](hooked, dpnp, None)   # one more: its segment stays while the loop runs
    before = unimem.host_memory_stats()
    unimem.host.reset_peak_host_memory_stats()
    for _ in range(100):
        queue = new_queue(hooked)
        a = MAKERS[maker](hooked, dpnp, queue)
        b = MAKERS[maker](hooked, dpnp, queue)
        c = MAKERS[maker](hooked, dpnp, None)             # the default queue: the same pool
        del a, b, c
    hooked.synchronize()
    after = unimem.host_memory_stats()
    assert after["num_host_alloc"] == before["num_host_alloc"]         # every block from the cache
    assert after["segment.peak"] == before["segment.current"]
    assert after["reserved_bytes.peak"] == before["reserved_bytes.current"]
    del keep


FRESH_PROCESS = """
import json, dpnp, unimem, unimem.xpu
unimem.xpu.set_allocator()
arrays = [dpnp.{maker}(1, dtype="u1", usm_type="host") for _ in range(6)]
stats = unimem.host_memory_stats()
print(json.dumps([stats["segment.current"], stats["reserved_bytes.current"], sum(int(a[0]) for a in arrays)]))
"""


@pytest.mark.parametrize("maker", ["empty", "ones"])
def test_six_one_byte_host_arrays_of_a_new_process_hold_one_segment(xpu, maker):
    """What a program sees first: dpnp.ones' first call fills through queues
    dpnp makes for itself, which held a segment each (6 MiB for six bytes)."""
    segments, reserved, total = json.loads(run_fresh(FRESH_PROCESS.format(maker=maker)).splitlines()[-1])
    assert (segments, reserved) == (1, 2 * MiB)
    if maker == "ones":
        assert total == 6               # the arrays were filled, on the device
