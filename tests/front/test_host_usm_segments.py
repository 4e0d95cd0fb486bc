"""Host USM arrays share the pinned host pool's 2 MiB segments, whatever
queue they are made on, and their freed blocks are reused on every queue,
once the work record_stream named them used by (on any queue) is done.

Host memory belongs to the SYCL context, not to a queue: the pool caches it
under no queue (PyTorch's CachingHostAllocator takes no stream). Keyed by
queue, each queue held a 2 MiB segment of its own, for a one-byte array on a
queue a user made or on one of the queues dpnp makes for itself (dpnp.ones'
fill on its first call), and a loop over queues pinned a new segment per queue.
On the real SYCL device (the OpenCL CPU device in CI): these tests must run.
"""
import gc
import json
import time

import pytest

import unimem
from unimem import host
from tests.helpers.fresh import run_fresh
from tests.helpers.sycl_gate import Gate

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


#: record_stream's stream for a use on the queue ``busy`` (the default queue, or another)
USES = {
    "None": ("default", lambda xpu, busy: None),
    "the default queue": ("default", lambda xpu, busy: busy),
    "handle 0": ("default", lambda xpu, busy: xpu.stream_handle(busy)),
    "another queue": ("another", lambda xpu, busy: busy),
    "another queue's handle": ("another", lambda xpu, busy: xpu.stream_handle(busy)),
}
SIZED_MAKERS = {
    "dpnp.empty": lambda xpu, dpnp, size, queue: dpnp.empty(size, dtype="u1", usm_type="host", sycl_queue=queue),
    "unimem.xpu.empty": lambda xpu, dpnp, size, queue: xpu.empty(size, dtype="u1", usm_type="host",
                                                                 sycl_queue=queue),
}


def block_states():
    return {block["address"]: block["state"]
            for segment in host.caching_allocator().snapshot() for block in segment["blocks"]}


@pytest.mark.parametrize("maker", SIZED_MAKERS)
@pytest.mark.parametrize("use", USES)
def test_a_host_block_recorded_on_a_busy_queue_waits_for_it_before_any_queue_reuses_it(hooked, dpnp, maker, use):
    """The pool caches host USM of every queue under one stream, so every
    queue record_stream names is another stream than the block's: the
    default queue too. Named by None, the default queue or its handle 0, the
    use was taken for one on the block's own stream, ordered already, and
    the block went to the next host request of any queue at once, while the
    default queue's work still ran."""
    import dpctl
    queue_kind, stream_of = USES[use]
    busy = hooked.default_queue() if queue_kind == "default" else new_queue(hooked)
    size = 3 << 16
    array = SIZED_MAKERS[maker](hooked, dpnp, size, new_queue(hooked))
    ptr = address_of(array)
    gate = Gate(dpctl, busy, flag_queue=new_queue(hooked))
    try:
        hooked.record_stream(array, stream_of(hooked, busy))
        del array
        gc.collect()
        assert block_states()[ptr] == "active_pending_free"
        for queue in (None, new_queue(hooked), busy):
            other = SIZED_MAKERS[maker](hooked, dpnp, size, queue)
            assert address_of(other) != ptr, "a host block went to another allocation while its recorded work ran"
            del other
    finally:
        gate.open()                 # a spinning kernel would hang the process
    deadline = time.monotonic() + 10
    while True:
        again = SIZED_MAKERS[maker](hooked, dpnp, size, new_queue(hooked))
        if address_of(again) == ptr or time.monotonic() > deadline:
            break
        del again
    assert address_of(again) == ptr, "not reused once the recorded work was done"
    del again
    host.caching_allocator()._check_invariants()


def test_the_default_queue_has_a_handle_of_its_own_for_host_blocks(xpu):
    """What record_stream names a host block's use on the default queue by:
    a handle other than 0 that names the default queue, the same at every
    call, kept when the pool lets go of its stream (nothing but the default
    queue's own life ends it), and not waited for twice by synchronize."""
    from unimem.backends import xpu as xpu_backend
    runtime = xpu_backend._SyclRuntime.get()
    default = xpu.default_queue()
    handle = runtime.own_handle(default)
    assert handle != 0 and runtime.queue(handle, 0) == default
    assert runtime.own_handle(default) == handle and xpu.stream_handle(default) == 0
    other = new_queue(xpu)
    assert runtime.own_handle(other) == xpu.stream_handle(other) != 0
    with pytest.raises(ValueError, match="name the queue"):
        runtime.own_handle(0)
    runtime.release(handle)
    gc.collect()
    runtime.sweep()
    assert runtime.queue(handle, 0) == default
    assert runtime.abandoned([handle], 0) == []
    waited = []
    real_wait = xpu_backend._dpctl_api.wait_queue
    xpu_backend._dpctl_api.wait_queue = waited.append
    try:
        xpu.synchronize()
    finally:
        xpu_backend._dpctl_api.wait_queue = real_wait
    assert sum(queue == default for queue in waited) == 1


def test_a_host_block_may_be_recorded_on_a_queue_of_any_device(xpu):
    """The pinned pool is device 0's allocator and serves host USM of every
    queue of the context: its backend takes a queue of another device, where
    a device pool's refuses it."""
    from unimem._runtime.devices import get_type
    pinned = host.caching_allocator().backend
    handle = xpu.stream_handle(new_queue(xpu))
    pinned.check_stream(handle, 1)
    pinned.release_stream(handle, 1)
    with pytest.raises(ValueError, match="another device"):
        get_type("xpu").backend.check_stream(handle, 1)
