"""What the tests of ``unimem.xpu.set_allocator()`` under ordinary dpnp code
share (tests/integrations/test_dpnp_allocator_*.py): the pools' counters and
allocated bytes, and the allocator installed for one test. Imported after
the tests' own skip without dpnp or a SYCL device."""
import gc

import pytest

import unimem.xpu as xpu


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

