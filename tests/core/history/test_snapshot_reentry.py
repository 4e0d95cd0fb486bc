"""A snapshot and the garbage collector: making a snapshot's Python objects
may run finalizers that free blocks of the same allocator, or empty its
cache, on the same thread (the lock is recursive). The snapshot must still
be one consistent state, and nothing may read memory they gave back."""
import pytest

from tests.helpers.crash_guard import run_python

# The child makes 200 blocks held only by cyclic garbage, between free gaps,
# and lets the collector run at every allocation while a snapshot is made.
SNAPSHOT_WHILE_FINALIZERS_FREE = r'''
import gc
from unimem import _core
from unimem.backends.simulated import SimulatedBackend

core = _core.CachingAllocator(SimulatedBackend())
EMPTY_CACHE = %(empty_cache)r

class Holder:
    def __init__(self, allocation):
        self.allocation = allocation
        self.me = self                   # a cycle: only the collector ends it
    def __del__(self):
        self.allocation.release()
        if EMPTY_CACHE:
            core.empty_cache()

plain = []
for i in range(400):
    if i %% 2 == 0:
        plain.append(core.malloc(512))
    else:
        Holder(core.allocate(512))
for ptr in plain:
    core.free(ptr)
gc.set_threshold(1)
snapshot = %(call)s
gc.set_threshold(700)
gc.collect()
core._check_invariants()
for segment in snapshot:
    addresses = [block["address"] for block in segment["blocks"]]
    assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"], segment["total_size"]
    assert addresses == sorted(set(addresses))
    assert all(segment["address"] <= a < segment["address"] + segment["total_size"] for a in addresses)
print("PASSED")
'''

CRASH_ENV = {"MALLOC_PERTURB_": "165", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}


@pytest.mark.parametrize("empty_cache", [False, True], ids=["finalizers-free", "finalizers-empty-the-cache"])
def test_a_snapshot_made_while_finalizers_free_blocks_is_one_state(empty_cache):
    run_python(SNAPSHOT_WHILE_FINALIZERS_FREE % {"empty_cache": empty_cache, "call": "core.snapshot()"},
               env=CRASH_ENV)

