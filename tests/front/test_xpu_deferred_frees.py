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
import subprocess
import sys
import textwrap

import pytest

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
    code = textwrap.dedent(LOOP.format(install=install, make=make))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert done.stdout.split()[-2:] == ["done", "0"], done.stdout
