"""Memory history recorded while several threads allocate and free: the
trace keeps the order of the allocator's own operations.

Each thread hands its buffered events to the history after letting the
allocator lock go; without an order kept between those hand-overs, two of
them could swap: an address allocated twice with no free between, a
free_requested after its free_completed, time going backwards.
"""
import gc
import random
import threading

import unimem

from tests.helpers.crash_guard import run_python

THREADS = 4
OPERATIONS = 1500
SIZES = (512, 4096, 70_000, 1 << 20, 3 << 20)

# What may follow each action for one address of the trace.
NEXT = {None: {"alloc"}, "alloc": {"free_requested"}, "free_requested": {"free_completed"},
        "free_completed": {"alloc"}}


def churn(seed, barrier, errors):
    rng = random.Random(seed)
    live = []
    try:
        barrier.wait()
        for _ in range(OPERATIONS):
            if live and (len(live) > 8 or rng.random() < 0.5):
                unimem.cpu.caching_allocator_delete(live.pop(rng.randrange(len(live))))
            else:
                live.append(unimem.cpu.caching_allocator_alloc(rng.choice(SIZES)))
        for p in live:
            unimem.cpu.caching_allocator_delete(p)
    except BaseException as exc:          # reported by the test, not lost in the thread
        errors.append(exc)


def test_history_of_several_threads_is_in_the_allocators_order():
    # A block an earlier failed test left in a reference cycle (its frame,
    # held by the traceback) must not be freed in the middle of the trace.
    gc.collect()
    unimem.cpu._record_memory_history(max_entries=1_000_000, clear_history=True)
    try:
        barrier = threading.Barrier(THREADS)
        errors = []
        threads = [threading.Thread(target=churn, args=(seed, barrier, errors)) for seed in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        trace = unimem.cpu._snapshot()["device_traces"][0]
    finally:
        unimem.cpu._record_memory_history(None, clear_history=True)
        unimem.cpu.empty_cache()
    blocks = [e for e in trace if e["action"] in ("alloc", "free_requested", "free_completed")]
    assert len(blocks) >= THREADS * OPERATIONS
    last = {}
    wrong = []
    for i, entry in enumerate(blocks):
        before = last.get(entry["addr"])
        if entry["action"] not in NEXT[before]:
            wrong.append((i, hex(entry["addr"]), before, entry["action"]))
        last[entry["addr"]] = entry["action"]
    assert not wrong, f"{len(wrong)} impossible per-address sequences, the first: {wrong[:5]}"
    backwards = [i for i in range(1, len(trace)) if trace[i]["time_us"] < trace[i - 1]["time_us"]]
    assert not backwards, f"time_us goes backwards at {len(backwards)} entries, the first at {backwards[:5]}"


REENTERED_HOOK = """
import gc, signal
import unimem.cpu as c
c._record_memory_history(context="all", max_entries=1000)

class Owner:                      # frees its block in __del__; only the collector frees it
    def __init__(self):
        self.ptr = c.caching_allocator_alloc(4096)
        self.me = self
    def __del__(self):
        c.caching_allocator_delete(self.ptr)

gc.set_threshold(1)               # the hook's own allocations start the collector
for i in range(300):
    Owner()
    c.caching_allocator_delete(c.caching_allocator_alloc(1024))
gc.set_threshold(700)

snapshots = []
running = True
def on_signal(signum, frame):     # "dump a snapshot on a signal"
    snapshots.append(c._snapshot())
    if running:                   # not after the loop: a late one would outlive the script
        signal.setitimer(signal.ITIMER_REAL, 0.0002)
signal.signal(signal.SIGALRM, on_signal)
signal.setitimer(signal.ITIMER_REAL, 0.0002)
for i in range(30000):
    c.caching_allocator_delete(c.caching_allocator_alloc(4096))
running = False
signal.setitimer(signal.ITIMER_REAL, 0)
signal.signal(signal.SIGALRM, signal.SIG_IGN)
assert snapshots
c._record_memory_history(None)
print("PASSED")
"""


def test_a_finalizer_or_a_signal_handler_reentering_the_history_hook_does_not_hang():
    """The history hook runs Python (the stack walk, its entries) that may
    start the cyclic collector, whose finalizer frees a block, or run a
    signal handler that takes a snapshot: both come back to the history on
    the same thread. Its lock was not reentrant: the process hung."""
    run_python(REENTERED_HOOK, timeout=60)
