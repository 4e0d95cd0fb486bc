"""The XPU backend on a real SYCL device (the OpenCL CPU device in CI).

These tests must run, not skip: without a SYCL device the setup is broken
(``pip install -e ".[xpu,test]"`` brings dpctl, dpnp and the CPU runtime).
"""
import enum
import gc
import random
import time

import numpy as np
import pytest

import unimem
from tests.helpers.sycl_gate import Gate

MiB = 1 << 20


@pytest.fixture(scope="module")
def dpctl():
    import dpctl
    return dpctl


def stats(xpu):
    return xpu.memory_stats(0)


def test_pool_arrays_are_dpnp_arrays_counted_by_unimem_xpu_and_the_accelerator(xpu, dpnp):
    before = stats(xpu).get("active_bytes.all.current", 0)
    x = xpu.empty((1024, 1024), dtype="f4")
    y = xpu.zeros_like(x)
    x.fill(3)
    z = x @ y                                   # dpnp allocates results itself ...
    w = dpnp.matmul(x, y, out=xpu.empty_like(x))  # ... unless given a pool array as out=
    assert isinstance(x, dpnp.ndarray) and isinstance(x.get_array(), dpnp.tensor.usm_ndarray)
    active = stats(xpu)["active_bytes.all.current"]
    assert active == before + 3 * 4 * MiB
    assert float(w.sum()) == float(z.sum()) == 0.0
    assert unimem.accelerator.current_accelerator().type == "xpu"
    # on XPU unimem.accelerator's statistics are unimem.xpu's, with the shared
    # USM pool's (used by earlier tests), as torch.accelerator's are torch.xpu's
    assert unimem.accelerator.memory_stats(0) == stats(xpu)
    del x, y, z, w
    gc.collect()
    assert stats(xpu)["active_bytes.all.current"] == before


def test_dpnp_arithmetic_gives_numpy_answers(xpu, dpnp):
    rng = np.random.default_rng(0)
    a_host = rng.standard_normal((64, 48)).astype("f4")
    b_host = rng.standard_normal((48, 32)).astype("f4")
    a, b = xpu.asarray(a_host), xpu.asarray(b_host)
    np.testing.assert_allclose(dpnp.asnumpy(a @ b), a_host @ b_host, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dpnp.asnumpy(dpnp.exp(a) + 2 * a), np.exp(a_host) + 2 * a_host,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(a.sum()), float(a_host.sum()), rtol=1e-4)
    ints = xpu.asarray(np.arange(100, dtype="i8"))
    assert int((ints * ints).sum()) == int((np.arange(100) ** 2).sum())
    assert dpnp.asnumpy(xpu.full((3, 2), 7, dtype="i4")).tolist() == [[7, 7]] * 3
    assert dpnp.asnumpy(xpu.ones(4, dtype="f8")).tolist() == [1.0] * 4
    f = xpu.empty((3, 4), dtype="f4", order="F")
    assert f.flags.f_contiguous


def test_data_survives_thousands_of_allocations_and_frees(xpu, dpnp):
    keep_host = np.arange(250_000, dtype="f4")
    keep = xpu.asarray(keep_host)
    rng = random.Random(7)
    live = []
    for step in range(3000):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live)))
        else:
            arr = xpu.empty(rng.choice([1, 100, 1000, 70_000, 300_000]), dtype="f4")
            if step % 50 == 0:
                arr.fill(-1)
            live.append(arr)
    live.clear()
    np.testing.assert_array_equal(dpnp.asnumpy(keep), keep_host)


def test_a_freed_size_is_served_from_the_cache(xpu):
    x = xpu.empty(100_000, dtype="f4")
    del x
    before = stats(xpu)
    for _ in range(50):
        y = xpu.empty(100_000, dtype="f4")
        del y
    after = stats(xpu)
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["allocated_bytes.all.allocated"] == before["allocated_bytes.all.allocated"] + 50 * 400_384
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"] + 50


def block_of(array):
    return array.get_array().usm_data._pointer


def test_a_view_keeps_its_block_alive(xpu, dpnp):
    pool = xpu.allocator_for("device")
    x = xpu.asarray(np.arange(1000, dtype="f4"))
    ptr = block_of(x)
    view = x[100:200]
    del x
    gc.collect()
    assert pool.owns(ptr), "the block went back while a view of it lived"
    other = xpu.empty(1000, dtype="f4")
    assert block_of(other) != ptr
    np.testing.assert_array_equal(dpnp.asnumpy(view), np.arange(100, 200, dtype="f4"))
    del view
    gc.collect()
    assert not pool.owns(ptr)
    again = xpu.empty(1000, dtype="f4")
    assert block_of(again) == ptr, "the block is reused once every view is gone"


def test_a_queue_named_again_before_its_release_was_told_keeps_its_handle(xpu, dpctl):
    """A stream the pool dropped (the last use of queue Q ended) and named again
    (record_stream on Q) before the backend was told of the drop: the late
    release let go of Q's hold while a live block was recorded on it; once the
    caller dropped Q, its handle went to a new queue, the block's event was
    recorded on that idle queue, and the block was reused while Q's kernel
    still ran. A release is now told only for a stream still out of the table."""
    from unimem.backends import xpu as xpu_backend
    runtime = xpu_backend._SyclRuntime.get()
    pool = xpu.allocator_for("device")
    device = xpu.default_queue().sycl_device
    queue = dpctl.SyclQueue(device, property="in_order")
    handle = xpu.stream_handle(queue)
    x = xpu.empty(4096, dtype="u1")
    y = xpu.empty(4096, dtype="u1")
    ptr = block_of(y)
    xpu.record_stream(x, queue)
    del x                                          # the stream use ends: the stream is dropped, not yet told
    gc.collect()
    xpu.record_stream(y, queue)                    # named again
    gate = Gate(dpctl, queue, xpu.default_queue())  # and busy (the gate does not hold the queue)
    try:
        pool.empty_cache()                         # tells the backend what was dropped
        del queue
        gc.collect()
        other = dpctl.SyclQueue(device, property="in_order")
        assert xpu.stream_handle(other) != handle, "the busy queue's handle went to another queue"
        assert runtime.queues[handle] is not None
        del y
        gc.collect()
        pool.process_events()
        state = {b["address"]: b["state"] for s in pool.snapshot() for b in s["blocks"]}
        assert state.get(ptr) == "active_pending_free", state.get(ptr)
        assert ptr not in [block_of(xpu.empty(4096, dtype="u1")) for _ in range(3)]
    finally:
        gate.open()


def test_blocks_are_reused_only_on_their_own_queue(xpu, dpctl):
    device = xpu.default_queue().sycl_device
    queue_a = dpctl.SyclQueue(device, property="in_order")
    queue_b = dpctl.SyclQueue(device, property="in_order")
    x = xpu.empty(4096, dtype="u1", sycl_queue=queue_a)
    ptr = block_of(x)
    del x
    y = xpu.empty(4096, dtype="u1", sycl_queue=queue_b)
    assert block_of(y) != ptr, "a block freed on queue A was handed to queue B"
    z = xpu.empty(4096, dtype="u1", sycl_queue=queue_a)
    assert block_of(z) == ptr
    assert xpu.stream_handle(queue_a) != xpu.stream_handle(queue_b) != 0


def test_recorded_work_on_another_queue_delays_reuse(xpu, dpctl):
    device = xpu.default_queue().sycl_device
    queue_a = dpctl.SyclQueue(device, property="in_order")
    queue_b = dpctl.SyclQueue(device, property="in_order")
    x = xpu.empty(8192, dtype="u1", sycl_queue=queue_a)
    ptr = block_of(x)
    gate = Gate(dpctl, queue_b)                    # queue B is busy ...
    try:
        xpu.record_stream(x, queue_b)              # ... and uses x
        del x
        gc.collect()
        state = {b["address"]: b["state"] for s in xpu.memory_snapshot() for b in s["blocks"]}
        assert state[ptr] == "active_pending_free"
        y = xpu.empty(8192, dtype="u1", sycl_queue=queue_a)
        assert block_of(y) != ptr, "reused while queue B's recorded work was pending"
    finally:
        gate.open()                                # a spinning kernel would hang the process
    deadline = time.monotonic() + 10
    while True:
        z = xpu.empty(8192, dtype="u1", sycl_queue=queue_a)
        if block_of(z) == ptr or time.monotonic() > deadline:
            break
        del z
    assert block_of(z) == ptr, "not reused after queue B's work completed"


def test_empty_cache_waits_for_recorded_work(xpu, dpctl):
    device = xpu.default_queue().sycl_device
    queue_b = dpctl.SyclQueue(device, property="in_order")
    x = xpu.empty(3 * MiB, dtype="u1")
    xpu.record_stream(x, queue_b)
    queue_b.submit_barrier()
    syncs = stats(xpu)["num_sync_all_streams"]
    del x
    xpu.empty_cache()
    assert stats(xpu)["num_sync_all_streams"] == syncs + 1
    assert not [b for s in xpu.memory_snapshot() for b in s["blocks"] if b["state"] == "active_pending_free"]


def test_bad_input_is_a_clear_error_and_leaves_the_pool(xpu, dpctl):
    keep = xpu.empty(10)
    before = stats(xpu)
    with pytest.raises(ValueError, match="out of range"):
        xpu.empty(10, device=5)
    with pytest.raises(ValueError, match="doesn't match"):
        xpu.empty(10, device="cuda:0")
    with pytest.raises(TypeError, match="dpctl.SyclQueue"):
        xpu.empty(10, sycl_queue="not a queue")
    with pytest.raises(TypeError, match="cannot hold"):
        xpu.empty(10, dtype=object)
    with pytest.raises(TypeError, match="cannot hold"):
        xpu.empty(10, dtype="U10")
    with pytest.raises(TypeError, match="not understood"):
        xpu.empty(10, dtype="float128x")
    with pytest.raises(ValueError, match="negative"):
        xpu.empty((3, -1))
    with pytest.raises(TypeError, match="shape"):
        xpu.empty("ten")
    with pytest.raises(ValueError, match="usm_type"):
        xpu.empty(10, usm_type="texture")
    with pytest.raises(TypeError):
        xpu.record_stream(keep, "queue")
    assert stats(xpu) == before
    del keep


def test_host_and_shared_usm_come_from_pools(xpu, dpnp):
    host_before = unimem.host_memory_stats().get("allocation.current", 0)
    h = xpu.full(1000, 2.0, usm_type="host")
    s = xpu.ones(1000, usm_type="shared")
    assert h.usm_type == "host" and s.usm_type == "shared"
    assert float((h + h).sum()) == 4000.0 and float(s.sum()) == 1000.0
    assert unimem.host.backend_name() == "sycl"
    assert unimem.host_memory_stats()["allocated.current"] >= host_before + 1
    shared = xpu.allocator_for("shared")
    assert shared.owns(block_of(s))
    del h, s


def test_the_reset_functions_and_empty_cache_reach_the_shared_pools_statistics(xpu, dpnp):
    """memory_stats shows the shared USM pool under "usm_shared."; the reset
    functions left its peaks and accumulated counts as they were, and
    empty_cache left its free segments reserved."""
    s = xpu.ones(1 << 20, usm_type="shared")
    del s
    xpu.synchronize()
    xpu.reset_peak_memory_stats()
    xpu.reset_accumulated_memory_stats()
    xpu.empty_cache()
    stats = xpu.memory_stats()
    assert stats["usm_shared.allocated_bytes.all.peak"] == 0, stats["usm_shared.allocated_bytes.all.peak"]
    assert stats["usm_shared.allocation.all.allocated"] == 0
    assert stats["usm_shared.reserved_bytes.all.current"] == 0
    s = xpu.ones(1 << 20, usm_type="shared")
    assert xpu.memory_stats()["usm_shared.allocated_bytes.all.peak"] >= 4 << 20
    del s


def test_the_accelerators_functions_on_xpu_reach_the_shared_pools_too(xpu, dpnp):
    """torch.accelerator's functions are torch.xpu's on XPU; unimem.accelerator
    made its own memory functions for XPU, which left the shared USM pools
    out of empty_cache, the reset functions and memory_stats."""
    acc = unimem.accelerator
    if str(acc.current_accelerator()) != "xpu":
        pytest.skip("XPU is not the current accelerator")
    s = xpu.ones(1 << 20, usm_type="shared")
    del s
    xpu.synchronize()
    assert acc.memory_stats()["usm_shared.reserved_bytes.all.current"] > 0
    acc.reset_peak_memory_stats()
    acc.reset_accumulated_memory_stats()
    acc.empty_cache()
    stats = xpu.memory_stats()
    assert stats["usm_shared.reserved_bytes.all.current"] == 0
    assert stats["usm_shared.allocated_bytes.all.peak"] == 0
    assert stats["usm_shared.allocation.all.allocated"] == 0
    assert acc.memory_stats() == xpu.memory_stats()


def test_out_of_memory_names_the_usm_kind(xpu):
    """The pinned pool's out-of-memory error said "XPU out of memory ... host 0"
    (the device's words for host memory); shared USM's said the same."""
    assert unimem.host.backend_name() == "sycl"
    for allocate, words in ((lambda: unimem.host.caching_host_alloc(1 << 50), "XPU host USM out of memory"),
                            (lambda: xpu.allocator_for("shared").malloc(1 << 50), "XPU shared USM out of memory"),
                            (lambda: xpu.caching_allocator_alloc(1 << 50), "XPU out of memory")):
        with pytest.raises(unimem.OutOfMemoryError) as raised:
            allocate()
        assert str(raised.value).startswith(words), str(raised.value)


def test_the_host_pool_of_an_xpu_program_does_not_import_cupy(xpu):
    """The first host USM array of an XPU program chooses the host pool's
    backend: from the SYCL runtime already up, without importing CuPy to
    ask CUDA first. A fresh interpreter, since this one may have imported
    CuPy already."""
    import subprocess
    import sys
    code = ("import sys, unimem, unimem.xpu\n"
            "unimem.xpu.device_count()\n"                 # the SYCL runtime is up
            "print(unimem.host.backend_name(), 'cupy' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sycl", "False"], done.stdout + done.stderr


def test_memory_info_and_device_strings(xpu, dpctl):
    free, total = xpu.get_memory_info(0)
    assert total == xpu.default_queue().sycl_device.global_mem_size and 0 < free <= total
    x = xpu.empty(100, device="xpu:0")
    assert x.sycl_queue == xpu.default_queue(0)
    assert xpu.device_count() >= 1 and xpu.is_available()


def test_more_than_one_sycl_allocation_allows_is_refused_at_once(xpu):
    """The OpenCL CPU device allows half its memory in one allocation: a
    request between that and its capacity is an OutOfMemoryError saying so,
    and the cache is not released for it."""
    cap = xpu.default_queue(0).sycl_device.max_mem_alloc_size
    assert xpu.caching_allocator(0).max_allocation_size == cap
    xpu.caching_allocator_delete(xpu.caching_allocator_alloc(8 * MiB))   # something cached
    before = dict(stats(xpu))
    with pytest.raises(unimem.OutOfMemoryError, match="in one allocation"):
        xpu.empty(cap // 4 + MiB, dtype="f4")
    after = dict(stats(xpu))
    assert after.pop("num_ooms") == before.pop("num_ooms") + 1
    assert after == before


def test_zero_size_arrays(xpu):
    z = xpu.empty((0, 5))
    assert z.shape == (0, 5)


# ---------------------------------------------------------------------------
# Runtime threads. A SYCL runtime drops the last reference to an array on one
# of its host-task threads (dpctl's keep-alive tasks), while dpnp may wait on
# an event holding the GIL. These tests pin the rules that keep that from
# deadlocking (see CachingAllocator's locking notes and
# unimem.xpu._keep_alive_guard).
# ---------------------------------------------------------------------------
BLOCKED_HOST_TASKS = """
import threading, time
import dpnp
from dpctl.utils import SequentialOrderManager
import unimem

queue = unimem.xpu.default_queue()
release, entered = threading.Event(), threading.Event()

class Blocker:
    def __del__(self):              # runs in the keep-alive host task, which then stays busy
        entered.set()
        release.wait(60)            # lets the GIL go

events = []
for _ in range(4):                  # more than any bound on pending keep-alive tasks
    event = queue._submit_keep_args_alive((Blocker(),), [])
    SequentialOrderManager[queue].add_event_pair(event, event)
    events.append(event)
assert entered.wait(30), "the keep-alive host task did not start"
start = time.perf_counter()
for _ in range(3):
    array = unimem.xpu.empty(1024, dtype="f4")
with unimem.xpu.using_allocator():
    for _ in range(3):
        array = dpnp.empty(1024, dtype="f4")
print("allocated in", time.perf_counter() - start)
release.set()
for event in events:
    event.wait()
"""


def test_an_allocation_does_not_wait_for_keep_alive_host_tasks(tmp_path):
    """Host tasks that keep arrays alive run after their kernels: waiting for
    any of them on the allocation path makes an allocation wait for the
    device. Here they are blocked on purpose (until the script lets them go,
    after its allocations): unimem.xpu.empty and dpnp.empty through the pool
    must return at once; waiting for them blocked for the full 60 s."""
    import subprocess
    import sys
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_HOST_TASKS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=45)
    assert done.returncode == 0 and "allocated in" in done.stdout, done.stdout + done.stderr[-3000:]
    assert float(done.stdout.split("allocated in")[1]) < 10, done.stdout


def test_a_finalizers_free_runs_no_python(xpu):
    import threading
    pool = xpu.allocator_for("device")
    threads = []
    pool.set_trace_hook(lambda events: threads.append(threading.current_thread().name))
    try:
        block = pool.allocate(4096)
        holder = [block]
        del block
        worker = threading.Thread(target=holder.clear, name="runtime-thread")   # drops the last reference
        worker.start()
        worker.join(30)
        assert "runtime-thread" not in threads, "the history hook ran inside a finalizer"
        pool.flush_history()             # the buffered free arrives from a Python call
        assert threads[-1] == threading.current_thread().name
    finally:
        pool.set_trace_hook(None)


def test_training_with_history_recorded_does_not_hang(tmp_path):
    """The configuration that deadlocked before the rules above (about one
    run in six): dpnp training through the pool with history recorded."""
    script = tmp_path / "train.py"
    script.write_text(
        "import unimem\n"
        "from unimem.cli import demo\n"
        "work = demo.default_workload()\n"
        "work.memory_api._record_memory_history(max_entries=100000)\n"
        "seconds, loss = demo.train(work, work.pooled, 60)\n"
        "print('trained', loss)\n")
    import subprocess
    import sys
    for attempt in range(4):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "trained" in done.stdout, done.stderr


# ---------------------------------------------------------------------------
# temporary queues are not kept alive by unimem
# ---------------------------------------------------------------------------
def test_temporary_queues_are_let_go_of_after_empty_cache(xpu, dpctl):
    import weakref
    from unimem.backends import xpu as xpu_backend

    class TemporaryQueue(dpctl.SyclQueue):      # dpctl's queues take no weak reference; a subclass does
        pass

    runtime = xpu_backend._SyclRuntime.get()
    device = xpu.default_queue().sycl_device
    xpu.empty_cache()
    held_before = sum(q is not None for q in runtime.queues)
    reserved_before = stats(xpu).get("reserved_bytes.all.current", 0)
    active_before = stats(xpu).get("active_bytes.all.current", 0)

    def churn(count):
        """Make, use and drop ``count`` queues; weak references to them."""
        refs, handles = [], set()
        for i in range(count):
            queue = TemporaryQueue(device, property="in_order")
            refs.append(weakref.ref(queue))
            for usm_type in ("device", "shared"):
                x = xpu.full(1000, i, dtype="i4", sycl_queue=queue, usm_type=usm_type)
                assert int(x[999]) == i
                del x
            handles.add(xpu.stream_handle(queue))
        del queue
        gc.collect()
        assert stats(xpu)["active_bytes.all.current"] == active_before
        # dpctl itself keeps every queue dpnp (or unimem's keep-alive bound)
        # ran work on, in its SequentialOrderManager, until told to let go
        dpctl.utils.SequentialOrderManager.clear()
        xpu.empty_cache()
        xpu.allocator_for("shared").empty_cache()
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} of {count} temporary queues are still referenced after empty_cache"
        assert sum(q is not None for q in runtime.queues) <= held_before     # earlier tests' queues may go too
        assert stats(xpu)["reserved_bytes.all.current"] == reserved_before
        return handles

    first = churn(300)
    table_size = len(runtime.queues)
    second = churn(300)
    # handles are reused: the table does not grow with every queue ever seen
    # (a dropped queue's cache goes back at the next queue's first miss, so
    # its handle serves the queue after it: the table stays a few entries)
    assert len(runtime.queues) == table_size and len(second) < 300
    # and a reused handle serves its new queue: data and bookkeeping stay right
    queue = dpctl.SyclQueue(device, property="in_order")
    y = xpu.full(4096, 7, dtype="u1", sycl_queue=queue)
    assert int(y.sum()) == 7 * 4096 and xpu.stream_handle(queue) < table_size
    assert stats(xpu)["active_bytes.all.current"] == active_before + 4096
    del y


def test_a_queue_still_held_by_its_caller_keeps_its_handle(xpu, dpctl):
    device = xpu.default_queue().sycl_device
    queue = dpctl.SyclQueue(device, property="in_order")
    x = xpu.empty(4096, dtype="u1", sycl_queue=queue)
    handle = xpu.stream_handle(queue)
    del x
    xpu.empty_cache()
    assert xpu.stream_handle(queue) == handle          # still registered: the caller holds it
    y = xpu.full(4096, 3, dtype="u1", sycl_queue=queue)
    assert int(y.sum()) == 3 * 4096
    del y


def test_a_queue_named_by_record_stream_outlives_its_segments(xpu, dpctl):
    """A queue the caller dropped, whose segments went with empty_cache, is
    still needed while a live block names it in record_stream: freeing that
    block records an event on it."""
    device = xpu.default_queue().sycl_device
    other = dpctl.SyclQueue(device, property="in_order")
    y = xpu.empty(4096, dtype="u1", sycl_queue=other)        # a segment on the other queue
    del y
    x = xpu.empty(4096, dtype="u1")
    xpu.record_stream(x, other)
    del other
    dpctl.utils.SequentialOrderManager.clear()
    xpu.empty_cache()
    gc.collect()
    before = stats(xpu)["active_bytes.all.current"]
    del x                                                     # records an event on the other queue
    gc.collect()
    xpu.empty_cache()
    assert stats(xpu)["active_bytes.all.current"] == before - 4096


def test_record_stream_with_a_handle_that_names_no_queue_is_refused(xpu, dpctl):
    """The handle was taken, and every later free of the block
    raised IndexError, so it could never be freed."""
    pool = xpu.allocator_for("device")
    ptr = pool.malloc(4096)
    for bad in (1000000, 1 << 40):
        with pytest.raises(ValueError, match="names no SYCL queue"):
            pool.record_stream(ptr, bad)
    other_queue = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
    pool.record_stream(ptr, xpu.stream_handle(other_queue))    # a real queue's handle is fine
    pool.free(ptr)
    xpu.empty_cache()
    assert pool.memory_stats()["active.all.current"] == 0
    pool._check_invariants()


def test_record_memory_history_takes_torch_xpus_arguments_in_its_order(xpu):
    """torch.xpu's _record_memory_history has no ``device``: its fifth
    argument is ``clear_history`` (it went into an ignored ``device`` before)."""
    xpu._record_memory_history("all")
    try:
        xpu.caching_allocator_delete(xpu.caching_allocator_alloc(1000))
        assert len(xpu._snapshot()["device_traces"][0]) >= 2
        xpu._record_memory_history("all", "all", "all", 1000, True)
        assert xpu._snapshot()["device_traces"][0] == []
        xpu.caching_allocator_delete(xpu.caching_allocator_alloc(1000))
        xpu._record_memory_history("all", "all", "all", 1000, False, ["free_requested", "free_completed"])
        xpu.caching_allocator_delete(xpu.caching_allocator_alloc(1000))
        actions = [event["action"] for event in xpu._snapshot()["device_traces"][0]]
        assert actions.count("alloc") == 2 and actions.count("free_requested") == 1   # not cleared, then skipped
    finally:
        xpu._record_memory_history(None, clear_history=True)


@pytest.mark.parametrize("order, fortran", [("K", True), ("A", True), ("C", False), ("F", True), (None, True)])
def test_like_functions_keep_the_layout_as_dpnp_does(xpu, dpnp, order, fortran):
    """empty_like of a Fortran-ordered array lost its layout, and order="K"
    (dpnp's default) was refused."""
    source = dpnp.ones((3, 4), dtype="f4", order="F")
    kwargs = {} if order is None else {"order": order}
    for like in (xpu.empty_like, xpu.zeros_like, xpu.ones_like):
        made = like(source, **kwargs)
        expected = dpnp.empty_like(source, **kwargs)
        assert made.flags.f_contiguous == expected.flags.f_contiguous == fortran
        assert made.flags.c_contiguous == expected.flags.c_contiguous
    assert xpu.full_like(source, 2.0, **kwargs).flags.f_contiguous == fortran
    if order != "F":
        assert xpu.empty_like(dpnp.ones((3, 4), dtype="f4"), **kwargs).flags.c_contiguous


def test_like_refuses_an_order_dpnp_refuses(xpu, dpnp):
    before = stats(xpu)["allocated_bytes.all.current"]
    with pytest.raises(ValueError, match="order must be"):
        xpu.empty_like(dpnp.ones(4), order="X")
    assert stats(xpu)["allocated_bytes.all.current"] == before


@pytest.mark.parametrize("shape, dtype", [((2**40, 2**40), "f4"), ((2**61,), "f8")])
def test_an_impossible_shape_is_a_value_error_as_in_dpnp(xpu, dpnp, shape, dtype):
    """It was an OverflowError, "Python int too large to convert to C ssize_t"
    (dpnp says "Number of bytes of request allocation must be positive")."""
    before = stats(xpu)
    for make in (xpu.empty, xpu.zeros, xpu.ones):
        with pytest.raises(ValueError, match="array is too big"):
            make(shape, dtype=dtype)
    assert stats(xpu) == before


def test_like_functions_keep_the_stride_order_of_a_strided_source(xpu, dpnp):
    """order="K" (the default, or None) of a source neither C- nor
    F-contiguous: dpnp orders the new array's axes as the source's strides."""
    fortran = dpnp.ones((3, 4, 5), dtype="f4", order="F")
    c_order = dpnp.ones((3, 4, 5), dtype="f4")
    for source in (fortran[:, ::2], c_order.transpose(2, 0, 1), fortran[::-1], c_order[:, ::2]):
        for kwargs in ({}, {"order": "K"}, {"order": None}):
            expected = dpnp.empty_like(source, **kwargs).strides
            for like in (xpu.empty_like, xpu.zeros_like, xpu.ones_like):
                assert like(source, **kwargs).strides == expected, (like, source.strides, kwargs)
    filled = xpu.full_like(fortran[:, ::2], 3.0)
    assert filled.strides == dpnp.empty_like(fortran[:, ::2]).strides and float(filled.sum()) == 90.0


def test_asarray_keeps_a_usm_arrays_queue_and_usm_type_as_dpnp_does(xpu, dpnp, dpctl):
    """dpnp.asarray's usm_type and queue default to the input's; unimem's
    asarray made every copy device USM on the default queue."""
    other = dpctl.SyclQueue(xpu.default_queue().sycl_context, xpu.default_queue().sycl_device)
    for usm_type in ("device", "shared", "host"):
        source = dpnp.arange(6.0, usm_type=usm_type, sycl_queue=other)
        for made, expected in ((xpu.asarray(source), dpnp.asarray(source)),
                               (xpu.asarray(source, usm_type=None), dpnp.asarray(source, usm_type=None)),
                               (xpu.asarray(source, usm_type="device"), dpnp.asarray(source, usm_type="device")),
                               (xpu.asarray([1.0, 2.0]), dpnp.asarray([1.0, 2.0]))):
            assert made.usm_type == expected.usm_type
            assert made.sycl_queue == expected.sycl_queue
        assert (xpu.asarray(source).asnumpy() == source.asnumpy()).all()
        like = xpu.empty_like(source, usm_type=None)
        assert like.usm_type == usm_type == dpnp.empty_like(source, usm_type=None).usm_type


ASARRAY_LAYOUTS = {
    "fortran": lambda: np.asfortranarray(np.arange(24.0).reshape(2, 3, 4)),
    "axes swapped": lambda: np.arange(24.0).reshape(2, 3, 4).transpose(1, 0, 2),
    "fortran, every other column": lambda: np.asfortranarray(np.arange(24.0).reshape(4, 6))[:, ::2],
    "backwards": lambda: np.arange(6.0).reshape(2, 3)[:, ::-1],
    "backwards, strided, swapped": lambda: np.arange(24.0).reshape(2, 3, 4)[::-1, :, ::2].transpose(2, 0, 1),
    "a length-1 axis, backwards": lambda: np.arange(4.0).reshape(2, 1, 2)[:, :, ::-1],
    "a length-1 axis, swapped": lambda: np.arange(8.0).reshape(2, 1, 4)[:, :, ::2].transpose(2, 1, 0),
    "C": lambda: np.arange(6.0).reshape(2, 3),
    "0-d": lambda: np.float64(3.0),
    "nested list": lambda: [[1, 2], [3, 4]],
}


@pytest.mark.parametrize("layout", list(ASARRAY_LAYOUTS))
def test_asarray_lays_out_its_copy_as_dpnp_asarray_does(xpu, dpnp, layout):
    """dpnp.asarray's order defaults to None ("K", the source's layout);
    unimem's defaulted to "C" and made None "C": a Fortran array came back
    C-contiguous. Every order, from host data and from a dpnp array, gives
    dpnp's strides and values, in memory from the pool. (unimem's asarray
    always copies: against dpnp's copy, since dpnp hands back a dpnp source
    that needs no copy as it is.) dpctl lets go of an array once the kernels
    using it are done: the counts are read after synchronize()."""
    gc.collect()
    xpu.synchronize()
    before = xpu.memory_allocated()
    for order in (None, "K", "A", "C", "F", "k", "a", "Cx"):     # dpnp reads the first letter
        for source in (ASARRAY_LAYOUTS[layout](), dpnp.asarray(ASARRAY_LAYOUTS[layout]())):
            made, expected = xpu.asarray(source, order=order), dpnp.asarray(source, order=order, copy=True)
            assert (made.shape, made.strides, made.dtype) == (expected.shape, expected.strides, expected.dtype), \
                (order, type(source))
            np.testing.assert_array_equal(made.asnumpy(), expected.asnumpy())
            assert xpu.memory_allocated() > before or made.size == 0
            del made, expected
            gc.collect()
    xpu.synchronize()
    assert xpu.memory_allocated() == before


@pytest.mark.parametrize("obj, dtype", [
    (300, "u1"), ([300], "u1"), ([-1], "u4"), (1 + 2j, "f4"), ([1 + 2j], "i4"), ([1.5], "i4"),
    (3.7, "i2"), (np.array([300]), "u1"), (np.array([1 + 2j]), "f4"), (np.int64(300), "u1"),
    (2**64, "f8"), ([1, 2**70], "f8"), (2**64, "u8"), (None, "f4"), ("1.5", "f4")])
def test_asarray_converts_values_as_dpnp_asarray_does(xpu, dpnp, obj, dtype):
    """A Python value that does not fit the dtype is dpnp's error (NumPy's:
    300 as uint8 is an OverflowError, 1+2j as float32 a TypeError); unimem
    cast it, wrapping 300 to 44 and dropping the imaginary part. One that
    NumPy holds as an object without the dtype (2**64, None) is converted
    with it, as dpnp does. A NumPy array or scalar is cast as dpnp casts it.
    Nothing is left allocated."""
    import warnings
    xpu.synchronize()
    before = xpu.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        try:
            expected = dpnp.asarray(obj, dtype=dtype).asnumpy()
        except Exception as exc:                                # noqa: BLE001 - dpnp's error is the answer
            with pytest.raises(type(exc)):
                xpu.asarray(obj, dtype=dtype)
        else:
            made = xpu.asarray(obj, dtype=dtype)
            assert made.dtype == expected.dtype
            np.testing.assert_array_equal(made.asnumpy(), expected)
            del made
    gc.collect()
    xpu.synchronize()
    assert xpu.memory_allocated() == before


@pytest.mark.parametrize("dtype", [np.dtype(t).newbyteorder("S").str for t in ("i4", "f8", "u2", "c8")]
                         + ["U4", "f16", "i4,i4", np.dtype([("a", "i4")])])
def test_a_data_type_dpnp_cannot_hold_is_dpnps_error(xpu, dpnp, dtype):
    """One of dpnp's types in the other byte order is a ValueError in dpnp
    ("can only have native byteorder"), and so is a structured type ("not
    understood"), where unimem raised a TypeError; a type dpnp has no kind
    of stays a TypeError. The same for empty, for asarray with the dtype,
    and for a NumPy array of that type. Nothing is left allocated."""
    xpu.synchronize()
    before = xpu.memory_allocated()
    calls = [(lambda m: m.empty(3, dtype=dtype)), (lambda m: m.asarray([1], dtype=dtype))]
    if np.dtype(dtype).kind != "U":            # dpnp refuses a string array for another reason
        calls.append(lambda m: m.asarray(np.ones(2, dtype=dtype)))
    for call in calls:
        with pytest.raises(Exception) as dpnps:
            call(dpnp)
        with pytest.raises(dpnps.type):
            call(xpu)
    gc.collect()
    xpu.synchronize()
    assert xpu.memory_allocated() == before


@pytest.mark.parametrize("fill_value", [1, 1.0, True, 1j, np.int8(1), np.uint16(7), np.int64(-3), np.bool_(True),
                                        np.float16(1.5), np.float32(2.5), np.complex64(1 + 2j), np.clongdouble(2j),
                                        np.longdouble(0.5), 2**63, -2**63 - 1])
def test_full_without_a_dtype_takes_dpnps_type_for_the_value(xpu, dpnp, fill_value):
    """dpnp.full takes the device's default type of the value's kind:
    numpy.int8(1) gives int64 and numpy.complex64 complex128, where unimem
    kept the NumPy scalar's own type (and refused clongdouble); a value no
    int64 holds is dpnp's error."""
    try:
        expected = dpnp.full(3, fill_value).asnumpy()
    except Exception as exc:                                    # noqa: BLE001 - dpnp's error is the answer
        with pytest.raises(type(exc)):
            xpu.full(3, fill_value)
    else:
        made = xpu.full(3, fill_value)
        assert made.dtype == expected.dtype
        np.testing.assert_array_equal(made.asnumpy(), expected)


class _Colour(enum.IntEnum):
    BIG = 300


@pytest.mark.parametrize("make", ["full", "full_like"])
@pytest.mark.parametrize("value, dtype, error", [
    (300, "u1", OverflowError), (-1, "u1", OverflowError), (np.int64(300), "u1", OverflowError),
    (np.uint64(2**64 - 1), "i8", OverflowError), (_Colour.BIG, "u1", OverflowError),
    (float("nan"), "u1", ValueError), (float("inf"), "i4", OverflowError), (1e300, "i8", OverflowError),
    (np.float32(3e9), "i4", OverflowError),
    pytest.param(2**1100, "f4", OverflowError, id="2**1100-f4-OverflowError")])
def test_a_fill_value_the_type_cannot_hold_is_refused_before_a_block_is_taken(xpu, dpnp, make, value, dtype,
                                                                               error):
    """dpnp.full(3, 300, dtype="u1") raises OverflowError; unimem raised it
    from fill, after taking a block, so the pool's counters moved (and for
    a NumPy integer, an int subclass or a float out of range fill raised a
    RuntimeError, as dpnp's does). Now the value is checked first: NumPy's
    OverflowError for an integer out of range, float's ValueError for NaN
    and OverflowError for infinity or a float past the type, and nothing
    taken from the pool. full_like gives the same errors (dpnp.full_like
    wraps 300 to 44 instead, but refuses -1 with an OverflowError)."""
    like = xpu.empty(3, dtype=dtype)
    calls = {"full": lambda: xpu.full(3, value, dtype=dtype), "full_like": lambda: xpu.full_like(like, value)}
    xpu.synchronize()
    before = xpu.memory_stats()
    with pytest.raises(error):
        calls[make]()
    xpu.synchronize()
    assert xpu.memory_stats() == before


def test_full_refuses_an_int_out_of_range_as_dpnp_full_does(xpu, dpnp):
    with pytest.raises(OverflowError):
        dpnp.full(3, 300, dtype="u1")
    with pytest.raises(OverflowError):
        xpu.full(3, 300, dtype="u1")


def test_asarray_of_a_sequence_of_dpnp_arrays_is_built_as_dpnp_builds_it(xpu, dpnp):
    """dpnp arrays refuse to become NumPy arrays: unimem handed a list of
    them to NumPy and raised its TypeError ("Implicit conversion ... not
    allowed"), where dpnp.asarray stacks them on their device. Now the same
    array as dpnp's (shape, dtype, USM type, values, and dpnp's errors), in
    memory from the pool, and nothing left allocated afterwards."""
    single, pair = dpnp.asarray([300]), dpnp.asarray([1.5, 2.5])
    on_host = dpnp.asarray([1.0], usm_type="host")
    gc.collect()
    xpu.synchronize()
    before = xpu.memory_allocated()
    for obj, options in [([single], {}), ((pair, pair), {}), ([np.array([1]), single], {}),
                         ([[single, single]], {}), ([single], {"dtype": "f4"}), ([single], {"dtype": "u1"}),
                         ([on_host], {}), ([single], {"usm_type": "shared"})]:
        made, expected = xpu.asarray(obj, **options), dpnp.asarray(obj, **options)
        assert (made.shape, made.dtype, made.usm_type) == (expected.shape, expected.dtype, expected.usm_type)
        np.testing.assert_array_equal(made.asnumpy(), expected.asnumpy())
        if made.usm_type == "device":                            # (host and shared: pools of their own)
            assert xpu.memory_allocated() > before               # the copy is a pool block
        del made, expected
    with pytest.raises(ValueError, match="Inconsistent dimensions"):
        dpnp.asarray([[1, 2], single[:0]])
    with pytest.raises(ValueError, match="Inconsistent dimensions"):
        xpu.asarray([[1, 2], single[:0]])
    gc.collect()
    xpu.synchronize()
    assert xpu.memory_allocated() == before


@pytest.mark.parametrize("order, error", [("X", ValueError), ("", ValueError), (1, TypeError),
                                          (b"C", TypeError)])
def test_asarray_refuses_an_order_dpnp_refuses(xpu, dpnp, order, error):
    before = xpu.memory_allocated()
    with pytest.raises(error):
        dpnp.asarray([1.0, 2.0], order=order)
    with pytest.raises(error, match="order must be"):
        xpu.asarray([1.0, 2.0], order=order)
    assert xpu.memory_allocated() == before


def test_none_is_the_default_order_and_usm_type_of_empty_as_in_dpnp(xpu, dpnp):
    made = xpu.empty((2, 3), order=None, usm_type=None)
    expected = dpnp.empty((2, 3), order=None, usm_type=None)
    assert (made.usm_type, made.flags.c_contiguous) == (expected.usm_type, expected.flags.c_contiguous)

