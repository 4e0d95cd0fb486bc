"""Queue waits from many threads at once on the XPU backend.

The Intel OpenCL CPU runtime crashes (SIGSEGV in
``QueueEvent::DoneWithDependencies``) when two threads finish one queue at
once. unimem waits on queues from any thread: each segment given back waits
first, outside the core's lock and without the GIL, and ``synchronize``
waits on every queue. CI's run of ``test_concurrency`` died that way (eight
threads emptying the cache). Every wait of unimem's now takes its turn; each
check runs in a fresh interpreter, so that a crash is a failed test."""
import pytest

from tests.helpers.crash_guard import run_python
from unimem._runtime import devices

pytestmark = pytest.mark.skipif(not devices.is_available("xpu"), reason="no SYCL device")

SECONDS = 8.0     # the unserialized waits crashed within 2-6 s here


def test_eight_threads_synchronizing_one_device():
    run_python(f"""
import threading, time
from unimem.backends.xpu import XPUBackend
backend = XPUBackend("device")
errors = []
def synchronize_until(deadline):
    try:
        while time.monotonic() < deadline:
            backend.synchronize(0)
    except BaseException as exc:
        errors.append(exc)
deadline = time.monotonic() + {SECONDS}
threads = [threading.Thread(target=synchronize_until, args=(deadline,)) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
print("PASSED")
""", timeout=120)


def test_segments_given_back_from_eight_threads_beside_synchronize():
    """Releases (a wait, then ``sycl::free``, without the GIL) race with
    ``synchronize`` and with allocations; the allocator's bytes held by the
    raw allocator come back to 0 (its per-device count is atomic)."""
    run_python(f"""
import threading, time
from unimem import _core
from unimem.backends.xpu import XPUBackend
backend = XPUBackend("device")
allocator = _core.CachingAllocator(backend, 0)
errors = []
def churn(deadline, index):
    try:
        while time.monotonic() < deadline:
            if index % 4 == 0:
                backend.synchronize(0)
            else:
                allocator.free(allocator.malloc((2 + index) << 20))   # a segment of its own
                allocator.empty_cache()                                 # given back outside the lock
    except BaseException as exc:
        errors.append(exc)
deadline = time.monotonic() + {SECONDS}
threads = [threading.Thread(target=churn, args=(deadline, i)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
allocator.empty_cache()
assert allocator.memory_reserved() == 0
assert backend.raw.held(0) == 0, backend.raw.held(0)
assert allocator.memory_stats()["num_device_free"] > 100
print("PASSED")
""", timeout=120)


def test_held_refuses_a_device_that_does_not_exist():
    backend_code = """
from unimem.backends.xpu import XPUBackend
backend = XPUBackend("device")
for bad in (-1, backend.device_count()):
    try:
        backend.raw.held(bad)
    except ValueError as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError(f"held({bad}) did not raise")
print("PASSED")
"""
    run_python(backend_code)
