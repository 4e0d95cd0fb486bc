"""The history hook never runs under the allocator's lock, and no thread
waits for another's hook: a free (or an allocation) that Python run by a
backend call makes while the lock is held leaves its events to the outer
call, and a thread whose batch is not next in turn leaves its commit to the
thread committing the batch before (_core_history.pxi)."""
from tests.helpers.crash_guard import run_python

# Thread B delivers history (holding the delivery) and its hook waits until
# thread A holds the lock in a backend call, then asks for the lock; that
# backend call frees a block of the same allocator.
FREE_IN_A_BACKEND_CALL_WHILE_ANOTHER_THREAD_DELIVERS = r'''
import threading, time
from unimem import _core
from unimem.backends.simulated import SimulatedBackend

a_holds_the_lock = threading.Event()
b_delivers = threading.Event()
delivered = []

class Backend(SimulatedBackend):
    to_free = None
    def malloc(self, size, device=0, stream=0):
        if self.to_free is not None and threading.current_thread().name == "A":
            ptr, self.to_free = self.to_free, None
            a_holds_the_lock.set()
            time.sleep(0.2)
            core.free(ptr)              # its events wait for A's own allocation to end
        return super().malloc(size, device, stream)

backend = Backend()
core = _core.CachingAllocator(backend)

def hook(events):
    delivered.extend(events)
    if threading.current_thread().name == "B":
        b_delivers.set()
        a_holds_the_lock.wait(5)
        core.memory_stats()             # the lock, which A holds

core.set_trace_hook(hook)
victim = core.malloc(512)

def thread_a():
    backend.to_free = victim
    b_delivers.wait(5)
    core.free(core.malloc(50 << 20))    # a miss: the backend's malloc runs under the lock

def thread_b():
    core.free(core.malloc(1024))

threads = [threading.Thread(target=thread_a, name="A", daemon=True),
           threading.Thread(target=thread_b, name="B", daemon=True)]
for t in threads:
    t.start()
for t in threads:
    t.join(20)
assert not any(t.is_alive() for t in threads), "deadlock"
core.flush_history()
freed = [e for e in delivered if e[0] == "free_completed" and e[1] == victim]
assert len(freed) == 1, delivered
print("PASSED")
'''


def test_a_free_made_under_the_lock_does_not_wait_for_another_threads_delivery():
    run_python(FREE_IN_A_BACKEND_CALL_WHILE_ANOTHER_THREAD_DELIVERS, timeout=60)


# Two threads allocate with history recorded while the main thread takes
# snapshots: each thread delivers its own events (with its own frames), none
# is left delivering others' for ever, and a snapshot returns.
EVERY_THREAD_DELIVERS_ITS_OWN = r'''
import threading, time
import unimem.cpu as dev
dev._record_memory_history(max_entries=100000)
stop = False
progress = {}
def churn(name):
    n = 0
    while not stop:
        dev.caching_allocator_delete(dev.caching_allocator_alloc(4096, 0))
        n += 1
        progress[name] = n
threads = [threading.Thread(target=churn, args=(f"T{i}",), daemon=True) for i in range(2)]
for t in threads:
    t.start()
time.sleep(1.0)
first = dict(progress)
time.sleep(1.0)
second = dict(progress)
snapshot = dev._snapshot()
stop = True
for t in threads:
    t.join(10)
assert not any(t.is_alive() for t in threads), "a thread never returned"
assert all(second.get(k, 0) > first.get(k, 0) for k in ("T0", "T1")), (first, second)
assert snapshot["device_traces"][0], "no history delivered"
print("PASSED")
'''


def test_with_history_recorded_every_thread_goes_on_and_a_snapshot_returns():
    run_python(EVERY_THREAD_DELIVERS_ITS_OWN, timeout=60, env={"UNIMEM_DEVICE": "cpu"})
