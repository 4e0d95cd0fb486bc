"""Trying to break ``unimem.xpu.set_allocator()`` from ordinary dpnp code.

Each test says what it expects.
"""
import gc
import subprocess
import sys
import threading
import time

import numpy
import pytest

from tests.helpers import REPO_ROOT

dpnp = pytest.importorskip("dpnp")
dpctl = pytest.importorskip("dpctl")
import dpctl.memory as dpm  # noqa: E402

import unimem  # noqa: E402,F401
import unimem.xpu as xpu  # noqa: E402
from unimem._runtime import devices  # noqa: E402

if not devices.is_available("xpu"):
    pytest.skip(f"no SYCL device: {devices.unavailable_reason('xpu')}", allow_module_level=True)


def counters_delta(before):
    after = xpu.allocator_counters()
    return {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def allocated():
    gc.collect()
    xpu.synchronize()
    return xpu.memory_stats(0).get("allocated_bytes.all.current", 0)


@pytest.fixture
def hooked():
    with xpu.using_allocator():
        yield


@pytest.mark.parametrize("usm_type", ["device", "shared", "host"])
def test_every_usm_type_is_pooled_and_computes_right(hooked, usm_type):
    before = xpu.allocator_counters()
    a = dpnp.arange(1000, dtype="f4", usm_type=usm_type)
    delta = counters_delta(before)
    assert delta.get("pooled.allocations", 0) >= 1 and "bypassed.allocations" not in delta, delta
    assert a.usm_type == usm_type and a.get_array().usm_data.get_usm_type() == usm_type
    assert a.get_array().usm_data.reference_obj is None
    assert float((a + 1).sum()) == 500500.0
    assert numpy.array_equal(dpnp.asnumpy(a[::7]), numpy.arange(1000, dtype="f4")[::7])


def test_another_queue_of_the_default_context_is_pooled(hooked):
    queue = dpctl.SyclQueue()
    before = xpu.allocator_counters()
    a = dpnp.ones(1000, sycl_queue=queue)
    assert counters_delta(before).get("pooled.allocations") == 1
    assert a.sycl_queue == queue and float(a.sum()) == 1000.0


def test_a_queue_with_its_own_context_is_pooled_exactly_when_sycl_says_it_is_the_same_context(hooked):
    """On Intel's OpenCL CPU runtime ``dpctl.SyclContext(dev)`` compares equal
    to the device's default context (the same SYCL context), so it is pooled;
    a context SYCL calls different must be passed to dpctl."""
    device = dpctl.SyclDevice()
    queue = dpctl.SyclQueue(dpctl.SyclContext(device), device)
    before = xpu.allocator_counters()
    a = dpnp.ones(1000, sycl_queue=queue)
    delta = counters_delta(before)
    if queue.sycl_context == xpu.default_queue().sycl_context:
        assert delta.get("pooled.allocations") == 1, delta
    else:
        assert delta.get("bypassed.foreign_context.allocations") == 1, delta
    assert float((a * 2).sum()) == 2000.0


def test_a_queue_on_a_sub_device_goes_to_dpctl(hooked):
    try:
        sub_devices = dpctl.SyclDevice().create_sub_devices(partition=1)
    except Exception as exc:   # a device that cannot be partitioned
        pytest.skip(f"no sub-devices: {exc}")
    queue = dpctl.SyclQueue(sub_devices[0])
    before = xpu.allocator_counters()
    a = dpnp.ones(100, sycl_queue=queue)
    assert counters_delta(before).get("bypassed.no_pool.allocations") == 1
    assert float(a.sum()) == 100.0


def test_zero_size_arrays_work_and_a_zero_byte_request_fails_as_dpctls_does(hooked):
    a, b = dpnp.empty(0), dpnp.empty((0, 5), usm_type="shared")
    assert a.shape == (0,) and b.shape == (0, 5) and dpnp.asnumpy(a).size == 0
    before = xpu.allocator_counters()
    with pytest.raises(ValueError, match="must be positive"):
        dpm.MemoryUSMDevice(0)
    assert counters_delta(before).get("bypassed.zero_size.allocations") == 1


def test_views_keep_the_block_after_the_base_and_reset_allocator():
    base = allocated()
    xpu.set_allocator()
    try:
        a = dpnp.arange(1 << 20, dtype="i4")
        view, row = a[100:200], a.reshape(1024, 1024)[3]
    finally:
        xpu.reset_allocator()
    del a
    assert allocated() - base == 4 << 20          # the views hold the whole block
    assert int(view.sum()) == sum(range(100, 200)) and int(row[0]) == 3072
    assert numpy.array_equal(dpnp.asnumpy(view)[:3], [100, 101, 102])
    del view
    assert allocated() - base == 4 << 20
    del row
    assert allocated() == base


def test_memory_shared_through_dlpack_outlives_its_source(hooked):
    x = dpnp.arange(10.0)
    y = dpnp.from_dlpack(x)
    del x
    dpnp.full(10, -1.0)                           # would take the block if it were back in the pool
    assert numpy.array_equal(dpnp.asnumpy(y), numpy.arange(10.0))


def test_inputs_deleted_while_their_kernels_run_are_not_reused_too_early(hooked):
    n = 1 << 20
    for _ in range(10):
        a = dpnp.full(n, 1.0)
        b = dpnp.sin(a) + dpnp.cos(a) * a
        del a
        dpnp.full(n, 5.0), dpnp.full(n, 7.0)      # new arrays that could take a's block
        values = dpnp.asnumpy(b)
        assert numpy.all(values == numpy.sin(1.0) + numpy.cos(1.0))


@pytest.mark.parametrize("count", [1 << 45, 1 << 50])
def test_out_of_memory_is_a_memory_error_and_leaves_the_statistics_exact(hooked, count):
    keys = ["allocated_bytes.all.current", "reserved_bytes.all.current", "allocation.all.current",
            "segment.all.current"]
    keep = dpnp.ones(1000)
    before = {key: xpu.memory_stats(0)[key] for key in keys}
    ooms = xpu.memory_stats(0)["num_ooms"]
    with pytest.raises(MemoryError) as raised:
        dpnp.empty(count, dtype="u1")
    assert isinstance(raised.value, dpm.USMAllocationError)
    assert {key: xpu.memory_stats(0)[key] for key in keys} == before
    assert xpu.memory_stats(0)["num_ooms"] == ooms + 1
    assert float(keep.sum()) == 1000.0 and float(dpnp.ones(10).sum()) == 10.0


def _warm_up_dpnp():
    """Run once, on one thread, every dpnp operation the threads below use:
    dpnp's extensions build their kernels' tables in C++ static initializers
    on first use, and threads meeting there can deadlock whatever allocates
    (plain dpnp does too: four threads' first ``a * 2`` hang in them)."""
    for usm_type in ("device", "shared", "host"):
        y = (dpnp.arange(10, dtype="i8", usm_type=usm_type) * 2 + 1)[::3]
        assert int(y.sum()) == 40
        assert float(dpnp.ones(5, usm_type=usm_type).sum()) == 5


def run_while_installing_and_removing(work, stop, seconds=3):
    """``work(seed)`` on four threads while this one installs and removes the
    allocator every millisecond (set/reset and the context manager), then
    ``stop`` and wait for them."""
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        xpu.set_allocator()
        time.sleep(0.001)
        xpu.reset_allocator()
        with xpu.using_allocator():
            time.sleep(0.001)
    stop.set()
    for thread in threads:
        thread.join()


def test_threads_allocate_while_the_allocator_is_installed_and_removed():
    """Arrays made and computed on while another thread installs and removes
    the allocator every millisecond: right results, nothing left held.

    The workers take turns to run dpnp (a lock): dpnp's kernels submitted
    from several threads at once on one queue crash the OpenCL CPU runtime
    (a segmentation fault inside clEnqueueMemcpyINTEL, seen with the
    allocator never installed), which is dpnp's to fix, not ours. The
    installing thread does not take the lock: names are swapped in the middle
    of the workers' allocations, which is what this test is about."""
    errors, stop, turn = [], threading.Event(), threading.Lock()
    _warm_up_dpnp()
    with xpu.using_allocator():
        _warm_up_dpnp()

    def work(seed):
        rng = numpy.random.default_rng(seed)
        try:
            while not stop.is_set():
                n = int(rng.integers(1, 50_000))
                with turn:
                    y = (dpnp.arange(n, dtype="i8") * 2 + 1)[::3]
                    if int(y.sum()) != int((numpy.arange(n, dtype="i8") * 2 + 1)[::3].sum()):
                        errors.append(("sum", n))
                    if rng.random() < 0.2:
                        usm_type = ("shared", "host", "device")[int(rng.integers(3))]
                        if float(dpnp.ones(n, usm_type=usm_type).sum()) != n:
                            errors.append((usm_type, n))
                    del y
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc))

    base = allocated()
    run_while_installing_and_removing(work, stop)
    assert not errors
    assert not xpu.allocator_installed()
    assert allocated() == base
    assert type(dpm.MemoryUSMDevice(8)) is dpm.MemoryUSMDevice     # dpctl's own class is back


def test_threads_never_share_a_block_while_the_allocator_is_installed_and_removed():
    """Memory objects made and dropped by four threads at once (no kernels,
    so dpnp's own limits do not come in), while another thread installs and
    removes the allocator: no two live objects ever overlap, each keeps what
    was written to it, and every pool block comes back."""
    errors, stop = [], threading.Event()
    live = {}                        # start address -> (end, owner thread)
    live_lock = threading.Lock()

    def work(seed):
        rng = numpy.random.default_rng(seed)
        held = []
        try:
            while not stop.is_set():
                size = int(rng.choice([8, 512, 4000, 70_000, 1 << 20]))
                memory = dpm.MemoryUSMShared(size)        # host-readable: its bytes can be checked
                start = memory._pointer
                with live_lock:
                    for other, (end, owner) in live.items():
                        if other < start + size and start < end:
                            errors.append(("overlap", hex(start), size, hex(other), owner, seed))
                    live[start] = (start + size, seed)
                view = numpy.frombuffer(memory, dtype=numpy.uint8)
                view[:] = seed + 1
                held.append((memory, view, start))
                if len(held) > 6 or rng.random() < 0.5:
                    memory, view, start = held.pop(int(rng.integers(len(held))))
                    if not (view == view[0]).all():
                        errors.append(("overwritten", hex(start)))
                    with live_lock:
                        del live[start]
                    del memory, view
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc))
        finally:
            with live_lock:
                for _, _, start in held:
                    live.pop(start, None)
            held.clear()

    base = allocated()
    before = xpu.allocator_counters()
    run_while_installing_and_removing(work, stop)
    assert not errors, errors[:10]
    assert counters_delta(before).get("pooled.allocations", 0) > 100    # the pools did serve them
    assert allocated() == base


def test_a_subclass_made_while_installed_makes_its_own_instances(hooked):
    class Mine(dpm.MemoryUSMDevice):
        pass
    before = xpu.allocator_counters()
    mine = Mine(64)
    # the subclass is dpctl's to allocate: the pools' counters do not move for it
    assert counters_delta(before) == {}
    assert type(mine) is Mine and mine.nbytes == 64
    assert isinstance(mine, Mine) and isinstance(mine, dpm.MemoryUSMDevice)
    # dpctl's own memory, pooled or not, is not an instance of the user's class
    assert not isinstance(dpm.MemoryUSMDevice(64), Mine)
    assert not isinstance(dpnp.empty(16).get_array().usm_data, Mine)
    assert not issubclass(type(dpm.MemoryUSMDevice(64)), Mine)


DEADLOCK = """
import faulthandler, sys
faulthandler.dump_traceback_later(25, exit=True)
import unimem, unimem.xpu as xpu, dpnp as dp, numpy as np
xpu.set_allocator()
rng = np.random.default_rng(0)
x = dp.asarray(rng.standard_normal((4096, 64), dtype=np.float32))
w = dp.asarray(rng.standard_normal((64, 10), dtype=np.float32))
for i in range(1000):
    xb = x[dp.asarray(rng.integers(0, 4096, 64))]
    logits = xb @ w
    e = dp.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
x.sycl_queue.wait()
print("finished")
"""


# An open defect, not fixed: a deadlock between dpnp's own parts that the
# pool makes likelier. gdb on a hung run (SYCL_QUEUE_THREAD_POOL_SIZE=6, what
# `import dpnp` sets and this child inherits): the main thread is in dpnp's
# vm extension, oneapi::mkl::vm::exp -> sycl::event::wait_and_throw(depends),
# waiting on its dependencies with the GIL held; every SYCL host-task thread
# is in a dpnp.tensor keep-alive task (keep_args_alive's Python-object path,
# taken for arguments that are views rather than arrays owning smart-pointer
# memory) waiting for the GIL. Plain dpnp has the same wait, but dpctl's
# allocation lets the GIL go around sycl::malloc_device, which lets those
# tasks finish first; a pool hit keeps the GIL. This stop (a51a0e8): 1 hung
# run in 23 with the allocator, 0 in 60 without (it was about half the runs
# in an earlier, busier measurement).
@pytest.mark.xfail(strict=False, reason="known deadlock: dpnp's MKL VM call waits for host tasks that need "
                                        "the GIL it holds (open defect, likelier with the pool)")
def test_a_softmax_loop_does_not_deadlock():
    done = subprocess.run([sys.executable, "-c", DEADLOCK], cwd=str(REPO_ROOT), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "finished" in done.stdout, done.stdout + done.stderr[-3000:]
