"""What becomes of a pool block under ordinary dpnp code with
``unimem.xpu.set_allocator()``: views and DLPack keep it (after the base is
gone, and after reset_allocator), a kernel still reading it keeps it from
being handed out again, and a request beyond the device takes none and
moves no statistic but ``num_ooms``."""
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

from tests.helpers.dpnp_hook import allocated, hooked  # noqa: E402,F401  (fixture)


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

