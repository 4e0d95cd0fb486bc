"""Issue 26, defect 5: unimem keeps no SYCL queue a user made and dropped.

Counted as a user's program sees them: every live ``dpctl.SyclQueue`` the
garbage collector knows of (dpctl's queues take no weak reference). The
queues these tests make enable profiling, which neither dpctl nor dpnp nor
unimem asks for on its own queues, so they can be told apart from the
default queues that live for the whole process."""
import contextlib
import gc

import pytest


def live_test_queues(dpctl):
    return sum(isinstance(o, dpctl.SyclQueue) and o.has_enable_profiling for o in gc.get_objects())


def live_queues(dpctl):
    return sum(isinstance(o, dpctl.SyclQueue) for o in gc.get_objects())


@pytest.fixture(scope="module")
def dpctl():
    import dpctl
    import dpctl.utils
    return dpctl


def task(make, queue, value):
    """Ordinary dpnp code on a pool array (so dpctl's SequentialOrderManager
    holds the queue too), waited for."""
    x = make(256, dtype="i4", sycl_queue=queue)
    x.fill(value)
    assert int(x[255]) == value
    queue.wait()                 # the keep-alive host tasks too: no block is freed later


@pytest.mark.parametrize("made_by", ["unimem.xpu.empty", "dpnp.empty, allocator installed"])
@pytest.mark.parametrize("order_manager_cleared", ["after empty_cache", "before empty_cache"])
def test_no_queue_a_user_dropped_stays_alive(xpu, dpnp, dpctl, order_manager_cleared, made_by):
    """300 tasks, each making a queue (in order or not) and a pool array on
    it, then dropping both; then empty_cache, SequentialOrderManager.clear()
    and gc.collect(), in either order: as with dpnp.empty, no queue the tasks
    made is alive. (Before the fix, all 300 were, held by the XPU runtime's
    queue table, when clear() came after empty_cache.)"""
    device = xpu.default_queue().sycl_device
    make = xpu.empty if made_by == "unimem.xpu.empty" else dpnp.empty
    task(make, xpu.default_queue(), 0)      # what dpctl and dpnp set up once, at first use
    xpu.empty_cache()
    dpctl.utils.SequentialOrderManager.clear()
    gc.collect()
    assert live_test_queues(dpctl) == 0
    before = live_queues(dpctl)
    with xpu.using_allocator() if made_by != "unimem.xpu.empty" else contextlib.nullcontext():
        for number in range(300):
            properties = ["enable_profiling", "in_order"] if number % 2 else ["enable_profiling"]
            queue = dpctl.SyclQueue(device, property=properties)
            task(make, queue, number)
            del queue
    if order_manager_cleared == "before empty_cache":
        dpctl.utils.SequentialOrderManager.clear()
        xpu.empty_cache()
    else:
        xpu.empty_cache()
        dpctl.utils.SequentialOrderManager.clear()
    gc.collect()
    assert live_test_queues(dpctl) == 0, "queues the user dropped are still alive"
    assert live_queues(dpctl) <= before


def test_dpnp_alone_keeps_none_either(dpnp, dpctl):
    """The reference behaviour the test above holds unimem to."""
    device = dpctl.SyclDevice()
    for task in range(20):
        queue = dpctl.SyclQueue(device, property=["enable_profiling"])
        x = dpnp.empty(256, dtype="i4", sycl_queue=queue)
        x.fill(task)
        del x, queue
    dpctl.utils.SequentialOrderManager.clear()
    gc.collect()
    assert live_test_queues(dpctl) == 0
