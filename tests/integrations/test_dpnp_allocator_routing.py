"""Which allocations of ordinary dpnp code ``unimem.xpu.set_allocator()``
serves from the pools and which it leaves to dpctl (counted by reason in
``allocator_counters()``): every USM type, the queues of the default context
(and of a context SYCL calls the same), not a sub-device's, not a zero-byte
request, not a subclass of dpctl's memory classes a user makes."""
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

from tests.helpers.dpnp_hook import counters_delta, hooked  # noqa: E402,F401  (fixture)


@pytest.mark.parametrize("usm_type", ["device", "shared", "host"])
def test_every_usm_type_is_pooled_and_computes_right(hooked, usm_type):
    before = xpu.allocator_counters()
    a = dpnp.arange(1000, dtype="f4", usm_type=usm_type)
    delta = counters_delta(before)
    assert delta.get("pooled.allocations", 0) >= 1 and "bypassed.allocations" not in delta, delta
    assert a.usm_type == usm_type and a.get_array().usm_data.get_usm_type() == usm_type
    assert a.get_array().usm_data.reference_obj is None
    assert float((a + 1).sum()) == 500500.0
    assert numpy.array_equal(dpnp.asnumpy(a[::7]), numpy.arange(1000, dtype="f4")[::7])


def test_another_queue_of_the_default_context_is_pooled(hooked):
    queue = dpctl.SyclQueue()
    before = xpu.allocator_counters()
    a = dpnp.ones(1000, sycl_queue=queue)
    assert counters_delta(before).get("pooled.allocations") == 1
    assert a.sycl_queue == queue and float(a.sum()) == 1000.0


def test_a_queue_with_its_own_context_is_pooled_exactly_when_sycl_says_it_is_the_same_context(hooked):
    """On Intel's OpenCL CPU runtime ``dpctl.SyclContext(dev)`` compares equal
    to the device's default context (the same SYCL context), so it is pooled;
    a context SYCL calls different must be passed to dpctl."""
    device = dpctl.SyclDevice()
    queue = dpctl.SyclQueue(dpctl.SyclContext(device), device)
    before = xpu.allocator_counters()
    a = dpnp.ones(1000, sycl_queue=queue)
    delta = counters_delta(before)
    if queue.sycl_context == xpu.default_queue().sycl_context:
        assert delta.get("pooled.allocations") == 1, delta
    else:
        assert delta.get("bypassed.foreign_context.allocations") == 1, delta
    assert float((a * 2).sum()) == 2000.0


def test_a_queue_on_a_sub_device_goes_to_dpctl(hooked):
    try:
        sub_devices = dpctl.SyclDevice().create_sub_devices(partition=1)
    except Exception as exc:   # a device that cannot be partitioned
        pytest.skip(f"no sub-devices: {exc}")
    queue = dpctl.SyclQueue(sub_devices[0])
    before = xpu.allocator_counters()
    a = dpnp.ones(100, sycl_queue=queue)
    assert counters_delta(before).get("bypassed.no_pool.allocations") == 1
    assert float(a.sum()) == 100.0


def test_zero_size_arrays_work_and_a_zero_byte_request_fails_as_dpctls_does(hooked):
    a, b = dpnp.empty(0), dpnp.empty((0, 5), usm_type="shared")
    assert a.shape == (0,) and b.shape == (0, 5) and dpnp.asnumpy(a).size == 0
    before = xpu.allocator_counters()
    with pytest.raises(ValueError, match="must be positive"):
        dpm.MemoryUSMDevice(0)
    assert counters_delta(before).get("bypassed.zero_size.allocations") == 1


def test_a_subclass_made_while_installed_makes_its_own_instances(hooked):
    class Mine(dpm.MemoryUSMDevice):
        pass
    before = xpu.allocator_counters()
    mine = Mine(64)
    # the subclass is dpctl's to allocate: the pools' counters do not move for it
    assert counters_delta(before) == {}
    assert type(mine) is Mine and mine.nbytes == 64
    assert isinstance(mine, Mine) and isinstance(mine, dpm.MemoryUSMDevice)
    # dpctl's own memory, pooled or not, is not an instance of the user's class
    assert not isinstance(dpm.MemoryUSMDevice(64), Mine)
    assert not isinstance(dpnp.empty(16).get_array().usm_data, Mine)
    assert not issubclass(type(dpm.MemoryUSMDevice(64)), Mine)

