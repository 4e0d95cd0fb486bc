"""A block used on other queues (``record_stream``) and let go of by dpctl's
keep-alive host task: its free records an event on each of those queues,
which submits a barrier. Submitted from the host task's thread, the barrier
waited for the SYCL scheduler while holding the GIL, and the main thread,
submitting the next kernel, waited for the GIL: the process hung within a
few iterations (adversarial pass, /tmp/adv_thr/rec_deadlock_min*.py). Such a
free is now kept for the next call from Python's side (_free_deferred).

Run in a child process: the failure is a hang. The child also checks that
synchronize() does the kept frees: every byte allocated in the loop is free
after it."""
import textwrap

import pytest

from tests.helpers.crash_guard import run_python

LOOP = """
import faulthandler, sys
faulthandler.dump_traceback_later(90, exit=True)
import dpctl, dpnp
import unimem.xpu as xpu
{install}
dev = xpu.default_queue().sycl_device
q1 = dpctl.SyclQueue(dev, property="in_order")
q2 = dpctl.SyclQueue(dev, property="in_order")
before = xpu.memory_allocated()
for i in range(100):
    a = {make}(1 << 18, dtype="f4", sycl_queue=q1)
    b = a * 2                      # a kernel on q1: dpctl's keep-alive host task holds a and b
    xpu.record_stream(a, q2)       # a used on q2 too
    del a, b                       # the last references drop in the host task
xpu.synchronize()
q1.wait(); q2.wait()
xpu.synchronize()                  # the deferred frees are done here
allocator = xpu.allocator_for("device")
allocator._check_invariants()
print("done", xpu.memory_allocated() - before)
"""


@pytest.mark.parametrize("install, make", [("", "xpu.ones"),
                                           ("xpu.set_allocator()", "dpnp.ones")],
                         ids=["unimem.xpu.ones", "dpnp.ones, allocator installed"])
def test_a_recorded_block_freed_by_a_host_task_does_not_hang(xpu, install, make):
    out = run_python(textwrap.dedent(LOOP.format(install=install, make=make)), marker="done", timeout=150)
    assert out.split()[-2:] == ["done", "0"], out


def test_the_event_of_record_stream_is_a_barrier_submitted_without_the_gil(xpu):
    """dpctl's SyclQueue.submit_barrier keeps the GIL while it waits for the
    SYCL scheduler, which a thread waiting for the GIL may hold: the XPU
    backend submits its barriers through a ctypes foreign function (CFUNCTYPE
    lets the GIL go during the call; PYFUNCTYPE would not)."""
    import ctypes

    import dpctl
    backend = xpu.allocator_for("device").backend
    submit = backend.runtime._submit_barrier
    assert not submit._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    q = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
    x = xpu.ones(1 << 16, dtype="f4", sycl_queue=q)
    y = x * 2
    event = backend.record_event(xpu.stream_handle(q), 0)
    assert isinstance(event, dpctl.SyclEvent)
    backend.event_synchronize(event)
    assert backend.event_done(event)
    assert float(y[-1]) == 2.0
    for _ in range(2000):          # each barrier's reference is given back (no growth, no crash)
        backend.event_done(backend.record_event(0, 0))
    del x, y


SHARED_LOOP = """
import faulthandler
faulthandler.dump_traceback_later(90, exit=True)
import dpctl
import unimem.accelerator as acc
import unimem.xpu as xpu
dev = xpu.default_queue().sycl_device
q1 = dpctl.SyclQueue(dev, property="in_order")
q2 = dpctl.SyclQueue(dev, property="in_order")
shared = xpu.allocator_for("shared")
before = shared.memory_allocated()
for i in range(50):
    a = xpu.ones(1 << 18, dtype="f4", sycl_queue=q1, usm_type="shared")
    b = a * 2
    xpu.record_stream(a, q2)
    del a, b                       # the host task lets go: the frees are kept
q1.wait(); q2.wait()
acc.synchronize()
print("done", shared.memory_allocated() - before)
"""


def test_accelerator_synchronize_does_the_kept_frees_of_the_shared_pool(xpu):
    """unimem.accelerator.synchronize on XPU did the kept frees of the
    device's pool only: blocks of the shared USM pool freed by a host task
    stayed allocated (2 MiB of 50 loops) until that pool's next allocation.
    It now does what unimem.xpu.synchronize does."""
    out = run_python(textwrap.dedent(SHARED_LOOP), marker="done", timeout=150)
    assert out.split()[-2:] == ["done", "0"], out


def test_accelerator_synchronize_loads_no_dpnp(xpu):
    """Doing the shared pool's kept frees must not make accelerator.synchronize
    load dpnp (the review of the first fix, which went through unimem.xpu's
    context): a later install_allocators(sycl_interpose=True) then refused,
    dpnp's extensions being loaded, and without dpnp it raised."""
    code = ("import sys, unimem.accelerator as acc\n"
            "assert acc.current_accelerator().type == 'xpu'\n"
            "acc.synchronize()\n"
            "print('loaded', sorted(m for m in ('dpnp', 'unimem.xpu') if m in sys.modules))")
    out = run_python(code, marker="loaded", timeout=150)
    assert out.split()[-1] == "[]", out


UNCACHED_LOOP = """
import faulthandler, time
faulthandler.dump_traceback_later(90, exit=True)
import dpnp
import unimem.xpu as xpu
{install}
xpu.caching_allocator_enable(False)
allocator = xpu.allocator_for("device")
end, rounds = time.perf_counter() + 3.0, 0
while rounds < 20 or time.perf_counter() < end:
    a = {make}(65536)
    b = dpnp.tanh(a)               # dpnp's keep-alive host task holds a and b ...
    c = b + 1
    del a                          # ... and lets go of a on a SYCL thread: its segment goes back
    rounds += 1
del b, c
xpu.synchronize()                  # the frees kept for Python's side are done here
allocator._check_invariants()
stats = allocator.memory_stats()
print("done", stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"],
      stats["num_device_alloc"] - stats["num_device_free"])
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("install, make", [("", "xpu.ones"),
                                           ("xpu.set_allocator()", "dpnp.ones")],
                         ids=["unimem.xpu.ones", "dpnp.ones, allocator installed"])
def test_dpnp_work_with_the_cache_off_does_not_hang(xpu, install, make):
    """With the cache off, a free made by dpnp's keep-alive host task gave
    its segment back on the SYCL thread, whose backend free waits for the
    queue: the main thread, freeing an array, waited inside DPCTLQueue_Wait
    (holding unimem's turn to wait) for that host task, which waited for
    the same turn, and would have waited for its own queue even without it.
    The process hung within the first few operations. Such a free is now
    kept for the next call from Python's side; every segment goes back."""
    out = run_python(textwrap.dedent(UNCACHED_LOOP.format(install=install, make=make)),
                     marker="done", timeout=150)
    assert out.split()[-4:] == ["done", "0", "0", "0"], out


RECORDED_UNCACHED = """
import dpctl
import unimem.xpu as xpu
xpu.caching_allocator_enable(False)
other = dpctl.SyclQueue(xpu.default_queue().sycl_device, property="in_order")
for i in range(5):
    a = xpu.empty(1 << 20, dtype="f4")
    xpu.record_stream(a, other)
    del a                          # its segment waits for other's work ...
    xpu.synchronize()              # ... which is done: it goes back
stats = xpu.memory_stats()
print("done", stats["segment.all.current"], stats["reserved_bytes.all.current"],
      stats["allocated_bytes.all.current"])
"""


def test_with_the_cache_off_a_block_used_on_another_queue_gives_its_segment_back(xpu):
    """The stream-ordered free only cached the block: 5 segments, 20 MiB
    reserved and 0 allocated after the loop, and nothing reused them."""
    out = run_python(textwrap.dedent(RECORDED_UNCACHED), marker="done", timeout=150)
    assert out.split()[-4:] == ["done", "0", "0", "0"], out
