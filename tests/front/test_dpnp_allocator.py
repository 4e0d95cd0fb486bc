"""``unimem.xpu.set_allocator()``: every dpnp array from the pools, on the
real SYCL device (the OpenCL CPU device in CI). These tests must run, not skip."""
import sys
import threading
import time

import numpy as np
import pytest

import unimem
from unimem._integrations import dpnp as _dpnp_allocator, usm_memory as _usm_memory

from tests.helpers.clients import client_of

MiB = 1 << 20


@pytest.fixture(scope="module")
def dpm():
    import dpctl.memory
    return dpctl.memory


def allocated(xpu):
    return xpu.memory_stats(0).get("allocated_bytes.all.current", 0)


def pooled(xpu):
    return xpu.allocator_counters()["pooled.allocations"]


def settle(xpu, baseline, timeout=10.0):
    """Wait until the device pool is back at ``baseline`` allocated bytes."""
    xpu.synchronize()
    deadline = time.monotonic() + timeout
    while allocated(xpu) != baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return allocated(xpu)


def workload(dpnp):
    """Ordinary dpnp code: no out=, no unimem call."""
    rng = np.random.default_rng(7)
    a = dpnp.asarray(rng.random((256, 128), dtype=np.float32))
    w = dpnp.asarray(rng.random((128, 64), dtype=np.float32))
    index = dpnp.asarray([3, 1, 4, 1, 5, 9, 2, 6] * 8)
    h = dpnp.tanh(a[index] @ w)
    e = dpnp.exp(h - h.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    s = dpnp.sort(p[:, 0])
    return [dpnp.asnumpy(x) for x in (p, s, dpnp.cumsum(a, axis=0)[-1], dpnp.argmax(h, axis=1))]


def test_every_array_of_ordinary_dpnp_code_comes_from_the_pool(xpu, dpnp):
    plain = workload(dpnp)
    baseline = settle(xpu, allocated(xpu))
    with xpu.using_allocator():
        before = xpu.allocator_counters()
        hooked = workload(dpnp)
        after = xpu.allocator_counters()
    assert after["pooled.allocations"] - before["pooled.allocations"] >= 15
    assert after["bypassed.allocations"] == before["bypassed.allocations"]
    for a, b in zip(plain, hooked):
        np.testing.assert_array_equal(a, b)          # the same results, bit for bit
    assert settle(xpu, baseline) == baseline         # every block back


def test_results_of_operations_are_in_the_pool_statistics(hooked, dpnp):
    before = allocated(hooked)
    x = dpnp.ones((512, 512), dtype="f4")
    y = x @ x                                         # dpnp allocates the result itself
    z = y + 1                                         # (and a small block for the scalar)
    assert 3 * 512 * 512 * 4 <= allocated(hooked) - before <= 3 * 512 * 512 * 4 + 4096
    assert float(z[0, 0]) == 513.0
    del x, y, z
    assert settle(hooked, before) == before


def test_the_memory_is_dpctls_own_kind_held_by_a_smart_pointer(hooked, dpnp, dpm):
    x = dpnp.empty(1000, dtype="f4")
    memory = x.get_array().usm_data
    assert type(memory) is dpm._memory.MemoryUSMDevice
    assert isinstance(memory, dpm.MemoryUSMDevice) and not isinstance(memory, dpm.MemoryUSMShared)
    assert memory.reference_obj is None              # as for memory dpctl allocated itself
    assert _usm_memory.block_owner_use_count(memory) >= 1
    assert hooked.allocator_for("device", 0).owns(memory._pointer)
    assert memory.nbytes == 4000 and memory.sycl_queue == x.sycl_queue
    own = dpm._memory.MemoryUSMDevice(64)             # isinstance also holds for dpctl's own
    assert isinstance(own, dpm.MemoryUSMDevice) and issubclass(type(own), dpm.MemoryUSMDevice)
    with pytest.raises(TypeError):
        _usm_memory.block_owner_use_count(object())


def test_dpnps_arrays_are_dpnps_and_unimems_own_arrays_unimems(hooked, dpnp):
    pool = hooked.allocator_for("device", 0)
    theirs = dpnp.empty(1000, dtype="f4")
    ours = hooked.empty(1000, dtype="f4")
    assert client_of(pool, theirs.get_array().usm_data._pointer) == "dpnp"
    assert client_of(pool, ours.get_array().usm_data._pointer) == "unimem"
    by_client = hooked.memory_allocated_by_client(0)
    assert by_client["dpnp"] >= 4096 and by_client["unimem"] >= 4096
    assert sum(by_client.values()) == hooked.memory_allocated(0)
    del theirs, ours


@pytest.mark.parametrize("usm_type", ["shared", "host"])
def test_shared_and_host_arrays_come_from_their_pools(hooked, dpnp, usm_type):
    pool = hooked.allocator_for(usm_type, 0)
    before = pool.memory_stats().get("allocated_bytes.all.current", 0)
    x = dpnp.arange(1000, dtype="i4", usm_type=usm_type)
    assert x.usm_type == usm_type
    assert pool.owns(x.get_array().usm_data._pointer)
    assert int(x.sum()) == 499500
    if usm_type == "shared":
        assert hooked.memory_stats(0)["usm_shared.allocated_bytes.all.current"] >= 4000
        assert "XPU shared USM memory summary" in hooked.memory_summary(0)
    else:
        assert "XPU host USM memory summary" in hooked.memory_summary(0)
    del x
    hooked.synchronize()
    assert pool.memory_stats()["allocated_bytes.all.current"] == before


def test_another_queue_of_the_same_context_is_a_stream_of_the_pool(hooked, dpnp):
    import dpctl
    queue = dpctl.SyclQueue(hooked.default_queue().sycl_context, hooked.default_queue().sycl_device)
    x = dpnp.ones(10_000, dtype="f4", sycl_queue=queue)
    pool = hooked.allocator_for("device", 0)
    assert pool.owns(x.get_array().usm_data._pointer)
    handle = hooked.stream_handle(queue)
    assert handle != 0
    assert any(segment["stream"] == handle for segment in pool.snapshot())
    assert float(x.sum()) == 10_000.0


def test_what_the_pool_cannot_serve_goes_to_dpctl_and_is_counted(hooked, dpnp, dpm):
    import dpctl
    device = hooked.default_queue().sycl_device
    # a sub-device: a device (and a context) unimem does not serve
    sub_queue = dpctl.SyclQueue(device.create_sub_devices(partition=1)[0])
    before = hooked.allocator_counters()
    x = dpnp.empty(1000, dtype="f4", sycl_queue=sub_queue)
    aligned = dpm.MemoryUSMDevice(4096, alignment=4096, queue=hooked.default_queue())
    empty = dpnp.empty(0, dtype="f4")                          # no memory to ask for
    copied = dpm.MemoryUSMDevice(aligned)                      # a memory argument: dpctl's
    after = hooked.allocator_counters()
    assert not hooked.allocator_for("device", 0).owns(x.get_array().usm_data._pointer)
    x.fill(1)
    assert float(dpnp.asnumpy(x).sum()) == 1000.0
    assert aligned._pointer % 4096 == 0

    def grew(key):
        return after[key] - before[key]
    assert grew("bypassed.no_pool.allocations") == 1 and grew("bypassed.no_pool.bytes") == 4000
    assert grew("bypassed.alignment.allocations") == 1
    assert grew("bypassed.other_arguments.allocations") == 1
    assert grew("bypassed.allocations") == grew("bypassed.zero_size.allocations") + 3
    assert grew("bypassed.bytes") == 4000 + 4096 + grew("bypassed.other_arguments.bytes")
    del x, aligned, empty, copied


def test_a_queue_of_another_context_on_a_served_device_is_dpctls(xpu):
    """The route of a queue whose device unimem serves but whose context is
    not the pool's (the pool's memory would not be valid there)."""
    import dpctl
    default = xpu.default_queue()

    class QueueOfAnotherContext(dpctl.SyclQueue):
        sycl_context = object()

    queue = QueueOfAnotherContext(default.sycl_device)
    routes = _dpnp_allocator._Routes(dpctl, xpu._pool_for, xpu._keep_alive_guard)
    assert routes("device", queue) == _usm_memory.BYPASS_REASONS.index("foreign_context")
    assert routes("device", default)[1:4] == (0, default, True)


def test_alignments_the_pool_honours_are_served(hooked, dpm):
    before = pooled(hooked)
    memory = dpm.MemoryUSMDevice(1000, alignment=256, queue=hooked.default_queue())
    assert pooled(hooked) == before + 1 and memory._pointer % 256 == 0


def test_out_of_memory_is_both_errors_and_changes_no_statistic(hooked, dpnp, dpm):
    import dpctl.memory
    pool = hooked.allocator_for("device", 0)
    stats = dict(pool.memory_stats())
    with pytest.raises(unimem.OutOfMemoryError) as caught:
        dpnp.empty(1 << 60, dtype="u1")
    assert isinstance(caught.value, dpctl.memory.USMAllocationError)
    after = dict(pool.memory_stats())
    assert after.pop("num_ooms") == stats.pop("num_ooms", 0) + 1
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.current"):
        assert after[key] == stats[key]


def test_installing_twice_is_a_no_op_and_reset_restores_dpctls_classes(xpu, dpm):
    import dpnp.memory as dpnp_memory
    originals = (dpm.MemoryUSMDevice, dpm.MemoryUSMShared, dpm.MemoryUSMHost)
    dpnps_own = dpnp_memory.MemoryUSMDevice
    assert not xpu.allocator_installed()
    xpu.set_allocator()
    stand_in = dpm.MemoryUSMDevice
    xpu.set_allocator()
    assert dpm.MemoryUSMDevice is stand_in and stand_in is not originals[0]
    assert dpnp_memory.MemoryUSMDevice is dpnps_own           # dpnp.memory is left alone
    xpu.reset_allocator()
    xpu.reset_allocator()
    assert (dpm.MemoryUSMDevice, dpm.MemoryUSMShared, dpm.MemoryUSMHost) == originals


def test_using_allocator_restores_what_was_in_effect(xpu):
    with xpu.using_allocator():
        assert xpu.allocator_installed()
        with xpu.using_allocator():
            assert xpu.allocator_installed()
        assert xpu.allocator_installed()
    assert not xpu.allocator_installed()
    xpu.set_allocator()
    with xpu.using_allocator():
        pass
    assert xpu.allocator_installed()
    xpu.reset_allocator()


def test_using_allocator_blocks_of_two_threads_overlap(xpu, dpnp):
    """The first thread to leave its block uninstalled the allocator for a
    thread still inside its own: that thread's arrays came from dpctl. The
    allocator now stays until the last block ends."""
    second_inside, first_left = threading.Event(), threading.Event()
    seen = {}

    def first():
        with xpu.using_allocator():
            second_inside.wait(30)
        first_left.set()

    def second():
        with xpu.using_allocator():
            second_inside.set()
            first_left.wait(30)
            before = pooled(xpu)
            x = dpnp.empty(1000)
            seen["installed"], seen["pooled"] = xpu.allocator_installed(), pooled(xpu) - before
            del x

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    while not threads[0].is_alive():
        time.sleep(0.01)
    threads[1].start()
    for thread in threads:
        thread.join(60)
    assert seen["installed"] and seen["pooled"] >= 1, seen
    assert not xpu.allocator_installed()


def test_arrays_outlive_reset_allocator(xpu, dpnp):
    baseline = settle(xpu, allocated(xpu))
    xpu.set_allocator()
    x = dpnp.arange(100_000, dtype="f4")
    view = x[10:20]
    xpu.reset_allocator()
    del x
    assert float(view.sum()) == sum(range(10, 20))            # the view keeps the block
    assert allocated(xpu) > baseline
    del view
    assert settle(xpu, baseline) == baseline


def test_synchronize_waits_for_kernels_before_the_blocks_are_back(hooked, dpnp):
    before = settle(hooked, allocated(hooked))
    arrays = [dpnp.ones((256, 256), dtype="f4") for _ in range(4)]
    results = [a @ a for a in arrays]                          # kernels still queued
    del arrays, results
    hooked.synchronize()
    assert allocated(hooked) == before


def test_a_block_comes_back_from_a_thread_python_has_never_seen(hooked, dpnp):
    """dpnp keeps an argument alive with a host task holding a copy of its
    smart pointer; the last copy may go on a SYCL thread, which must return
    the block without the GIL. Here a native thread (pthread_create through
    ctypes: no Python thread state) lets go of the last copy while this
    thread holds the GIL throughout (the switch interval far beyond the
    wait): a free that needed the GIL could not happen before the wait ends."""
    import ctypes
    pool = hooked.allocator_for("device", 0)
    before = settle(hooked, allocated(hooked))
    x = dpnp.empty(1 << 20, dtype="u1")
    held = _usm_memory._hold_block(x.get_array().usm_data)
    del x
    assert pool.memory_allocated() == before + (1 << 20)      # the copy keeps the block
    libc = ctypes.CDLL(None)
    thread = ctypes.c_ulong()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        assert libc.pthread_create(ctypes.byref(thread), None,
                                   ctypes.c_void_p(_usm_memory._RELEASE_HELD_BLOCK), ctypes.c_void_p(held)) == 0
        deadline = time.perf_counter() + 20.0
        finished = False                 # the thread ran to its end (it never waited for the GIL)
        while time.perf_counter() < deadline and not finished:
            finished = libc.pthread_tryjoin_np(thread, None) == 0     # pure Python: the GIL is kept
        freed_while_the_gil_was_held = pool.memory_allocated() == before
    finally:
        sys.setswitchinterval(interval)
        if not finished:
            libc.pthread_join(thread, None)
    assert finished and freed_while_the_gil_was_held


def test_threads_allocate_while_the_allocator_comes_and_goes(xpu, dpnp):
    dpctl = pytest.importorskip("dpctl")
    baseline = settle(xpu, allocated(xpu))
    errors = []
    stop = threading.Event()

    # A queue per thread: the OpenCL CPU runtime itself crashes when two
    # threads finish one queue at once (float(x.sum()) waits on it), which
    # plain dpnp does too (see _dpctl_api.um_wait_queue); the pools are the
    # device's, shared by the three queues as by one.
    # Each queue is used here first: dpctl's order keeper (dpctl.utils)
    # initializes a C++ static at its first use and lets the GIL go inside
    # it, so that two threads' first uses at once deadlock (seen with gdb:
    # one thread in __cxa_guard_acquire holding the GIL, the other inside
    # the guard waiting for the GIL; dpctl's own, without unimem).
    device = xpu.default_queue().sycl_device
    queues = [dpctl.SyclQueue(device) for _ in range(3)]
    for queue in queues:
        assert float(dpnp.full(10, 2.0, dtype="f4", sycl_queue=queue).sum()) == 20.0

    def allocate(queue):
        try:
            while not stop.is_set():
                x = dpnp.full(1000, 2.0, dtype="f4", sycl_queue=queue)
                assert float(x.sum()) == 2000.0
        except BaseException as exc:       # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=allocate, args=(queue,)) for queue in queues]
    for t in threads:
        t.start()
    for _ in range(30):
        xpu.set_allocator()
        time.sleep(0.005)
        xpu.reset_allocator()
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert settle(xpu, baseline) == baseline


# ---------------------------------------------------------------------------
# refusals: clear, and nothing changed
# ---------------------------------------------------------------------------
def test_an_old_dpnp_is_refused_and_nothing_is_replaced(xpu, dpnp, dpm, monkeypatch):
    original = dpm.MemoryUSMDevice
    monkeypatch.setattr(dpnp, "__version__", "0.19.1")
    with pytest.raises(RuntimeError, match="dpnp 0.20 or later, found 0.19.1"):
        xpu.set_allocator()
    assert dpm.MemoryUSMDevice is original and not xpu.allocator_installed()


def test_a_class_replaced_by_someone_else_is_not_replaced_again(xpu, dpm, monkeypatch):
    class Theirs:
        pass
    monkeypatch.setattr(dpm, "MemoryUSMShared", Theirs)
    device = dpm.MemoryUSMDevice
    with pytest.raises(RuntimeError, match="was replaced by"):
        xpu.set_allocator()
    assert dpm.MemoryUSMShared is Theirs and dpm.MemoryUSMDevice is device
    assert not xpu.allocator_installed()


def test_a_dpnp_that_allocates_another_way_is_refused(xpu, dpnp, dpm, monkeypatch):
    import dpnp.tensor as dpt
    import unimem._integrations.dpnp as hook
    monkeypatch.setattr(hook, "_probed", False)      # the probe runs once per process
    monkeypatch.setattr(dpnp, "empty", lambda *args, **kwargs: dpt.usm_ndarray(
        1, dtype="u1", buffer=dpm._memory.MemoryUSMDevice(1)))
    device = dpm.MemoryUSMDevice
    with pytest.raises(RuntimeError, match="does not allocate its arrays through"):
        xpu.set_allocator()
    assert dpm.MemoryUSMDevice is device and not xpu.allocator_installed()


def test_a_memory_layout_other_than_dpctls_header_is_refused(xpu, dpm):
    class Other:
        pass
    with pytest.raises(TypeError):
        _usm_memory.check_layout(Other(), dpm._memory._Memory)
    probe = dpm._memory.MemoryUSMDevice(1)
    _usm_memory.check_layout(probe, dpm._memory._Memory)      # dpctl's own passes
    assert _usm_memory.layout_size() == type(probe).__basicsize__


def test_run_serves_a_plain_dpnp_script_and_reports_the_bytes(tmp_path, xpu):
    import json
    import subprocess
    script = tmp_path / "plain.py"
    script.write_text("import dpnp\n"
                      "x = dpnp.ones((1024, 1024), dtype='f4')\n"
                      "y = x @ x + 1\n"
                      "z = dpnp.sum(y, axis=0)\n")
    done = subprocess.run([sys.executable, "-m", "unimem", "stats", "--json", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    counters = view["dpnp_allocator"]
    assert counters["pooled.bytes"] >= 3 * 4 * MiB and counters["bypassed.allocations"] == 0
    assert view["memory_stats"]["allocated_bytes.all.peak"] >= 3 * 4 * MiB
    done = subprocess.run([sys.executable, "-m", "unimem", "run", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dpnp arrays:" in done.stderr and "from unimem's pools" in done.stderr     # the summary's lines


def test_set_allocator_raises_a_malformed_configuration(xpu):
    """set_allocator swallowed the ValueError of a malformed UNIMEM_ALLOC_CONF
    (taken for "no pool for host USM here"): the hook was installed and every
    dpnp array silently bypassed the pools."""
    import os
    import subprocess
    code = ("import unimem, dpnp\n"
            "try:\n"
            "    unimem.xpu.set_allocator()\n"
            "except ValueError as exc:\n"
            "    print('refused:', exc)\n"
            "print('installed:', unimem.xpu.allocator_installed())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, UNIMEM_ALLOC_CONF="max_split_size_mb:abc"))
    assert done.returncode == 0, done.stderr
    assert "refused: UNIMEM_ALLOC_CONF='max_split_size_mb:abc'" in done.stdout, done.stdout
    assert "installed: False" in done.stdout, done.stdout


def test_install_allocators_answers_with_what_is_in_effect(xpu):
    """install_allocators answered from its own undo list: after
    reset_allocator() it installed nothing yet returned ['dpnp'], and after
    the user's own set_allocator() it returned [] while dpnp was served."""
    from unimem._integrations.install import install_allocators, installed_allocators, uninstall_allocators
    assert not xpu.allocator_installed()
    try:
        assert "dpnp" in install_allocators() and xpu.allocator_installed()
        xpu.reset_allocator()                       # taken out by hand
        assert "dpnp" not in installed_allocators()
        assert "dpnp" in install_allocators() and xpu.allocator_installed()     # put back
        uninstall_allocators()
        assert not xpu.allocator_installed() and "dpnp" not in installed_allocators()
        xpu.set_allocator()                         # the user's own
        assert "dpnp" in install_allocators() and "dpnp" in installed_allocators()
        uninstall_allocators()                      # undoes only what install_allocators did
        assert xpu.allocator_installed()
    finally:
        uninstall_allocators()
        xpu.reset_allocator()


def test_dpctls_memory_classes_pickle_while_the_allocator_is_installed(hooked, dpm):
    """The stand-ins bear dpctl's module and qualified name, where pickle found
    dpctl's class instead and refused them (PicklingError): a dpctl class
    could not be sent to a Dask worker while the allocator was installed."""
    import copy
    import pickle
    for name in ("MemoryUSMDevice", "MemoryUSMShared", "MemoryUSMHost"):
        stand_in = getattr(dpm, name)
        assert pickle.loads(pickle.dumps(stand_in)) is stand_in
        assert copy.deepcopy({"kind": stand_in})["kind"] is stand_in
    hooked.reset_allocator()
    assert pickle.loads(pickle.dumps(stand_in)) is dpm.MemoryUSMHost     # loaded where it is not installed
