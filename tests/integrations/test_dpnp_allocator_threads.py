"""``unimem.xpu.set_allocator()`` and dpnp code on several threads: arrays
made and memory objects dropped while another thread installs and removes
the allocator every millisecond, and a known deadlock between dpnp's parts
that the pool makes likelier."""
import subprocess
import sys
import threading
import time

import numpy
import pytest

dpnp = pytest.importorskip("dpnp")
dpctl = pytest.importorskip("dpctl")
import dpctl.memory as dpm  # noqa: E402

import unimem  # noqa: E402,F401
import unimem.xpu as xpu  # noqa: E402
from unimem._runtime import devices  # noqa: E402

if not devices.is_available("xpu"):
    pytest.skip(f"no SYCL device: {devices.unavailable_reason('xpu')}", allow_module_level=True)

from tests.helpers import REPO_ROOT  # noqa: E402
from tests.helpers.dpnp_hook import allocated, counters_delta  # noqa: E402


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

