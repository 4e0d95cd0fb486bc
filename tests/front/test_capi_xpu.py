"""unimem's C ABI on XPU (``unimem_xpu_malloc``/``free``, what PyTorch's
XPUPluggableAllocator calls) with real ``sycl::queue*`` pointers (dpctl's
queue references) on the SYCL device: device USM from unimem.xpu's pool that
a dpnp array views, writes and reads, keyed by queue as unimem.xpu keys it."""
import ctypes

import numpy as np
import pytest

from tests.helpers.capi import XPU, last_error, library
from tests.helpers.clients import client_of

MiB = 1 << 20


@pytest.fixture(scope="module")
def lib():
    return library()


@pytest.fixture(scope="module")
def dpctl(xpu):
    import dpctl
    return dpctl


class USMView:
    """Raw device USM as dpctl takes it (``__sycl_usm_array_interface__``)."""

    def __init__(self, ptr, nbytes, queue):
        self.__sycl_usm_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "strides": None,
                                             "typestr": "|u1", "version": 1, "syclobj": queue}


def ref(queue):
    return ctypes.c_void_p(queue.addressof_ref())


def stream_of(xpu, ptr):
    return xpu.caching_allocator(0).live_allocations()[ptr][2]


def test_a_dpnp_array_views_writes_and_reads_the_block(lib, xpu, dpnp, dpctl):
    queue = xpu.default_queue(0)
    n = 1 << 16
    before = xpu.memory_stats(0).get("allocation.all.current", 0)
    ptr = lib.unimem_xpu_malloc(n * 4, 0, ref(queue))
    assert ptr, last_error(lib)
    try:
        assert xpu.memory_stats(0)["allocation.all.current"] == before + 1
        assert lib.unimem_memory_allocated(XPU, 0) == xpu.memory_allocated(0)
        memory = dpctl.memory.as_usm_memory(USMView(ptr, n * 4, queue))
        assert memory.get_usm_type() == "device"
        array = dpnp.ndarray((n,), dtype="f4", buffer=memory)
        array[:] = dpnp.arange(n, dtype="f4", sycl_queue=queue)
        array *= 2
        assert np.array_equal(dpnp.asnumpy(array), np.arange(n, dtype="f4") * 2)
        assert stream_of(xpu, ptr) == 0                      # the default queue: key 0, as unimem.xpu's
        del array, memory
        queue.wait()
    finally:
        lib.unimem_xpu_free(ptr, n * 4, 0, ref(queue))
    assert xpu.memory_stats(0)["allocation.all.current"] == before


def test_c_and_pytorch_through_the_abi_are_told_apart(lib, xpu, dpctl):
    queue = xpu.default_queue(0)
    from_c = lib.unimem_xpu_malloc(4096, 0, ref(queue))
    from_torch = lib.unimem_torch_xpu_malloc(4096, 0, ref(queue))
    allocator = xpu.caching_allocator(0)
    try:
        assert [client_of(allocator, p) for p in (from_c, from_torch)] == ["c", "torch"]
    finally:
        lib.unimem_xpu_free(from_c, 4096, 0, ref(queue))
        lib.unimem_torch_xpu_free(from_torch, 4096, 0, ref(queue))
    assert not allocator.owns(from_c) and not allocator.owns(from_torch)


def test_a_queue_is_keyed_as_unimem_xpu_keys_it(lib, xpu, dpctl):
    from unimem import _xpu_pools
    queue = dpctl.SyclQueue(xpu.default_queue(0).sycl_device)      # the same context, another queue
    ptr = lib.unimem_xpu_malloc(4096, 0, ref(queue))
    assert ptr, last_error(lib)
    key = stream_of(xpu, ptr)
    assert key == xpu.stream_handle(queue) == _xpu_pools._stream_for("device", 0, queue) != 0
    lib.unimem_xpu_free(ptr, 4096, 0, ref(queue))
    on_default = lib.unimem_xpu_malloc(4096, 0, None)        # NULL: the default queue
    assert on_default != ptr, "a block freed on one queue went to another"
    assert lib.unimem_xpu_malloc(4096, 0, ref(queue)) == ptr
    # a copy of the queue (another sycl::queue object, the same queue) is the same stream
    copy = dpctl.SyclQueue(queue._get_capsule())
    assert copy.addressof_ref() != queue.addressof_ref()
    lib.unimem_xpu_free(ptr, 4096, 0, ref(queue))
    assert lib.unimem_xpu_malloc(4096, 0, ref(copy)) == ptr
    lib.unimem_xpu_free(ptr, 4096, 0, ref(copy))
    lib.unimem_xpu_free(on_default, 4096, 0, None)


def test_another_queue_at_the_same_address_is_told_apart(lib, xpu, dpctl):
    """A caller's sycl::queue object replaced by another one at the same
    address (a queue freed, a new one allocated there): the new queue's
    stream, not the old one's. The bytes of two dpctl queues are copied into
    one buffer in turn (a sycl::queue is a shared pointer to its queue_impl)."""
    device = xpu.default_queue(0).sycl_device
    first, second = dpctl.SyclQueue(device), dpctl.SyclQueue(device)
    runtime = xpu._runtime()
    functions = runtime.c_functions(("DPCTLQueue_AreEq", "DPCTLQueue_Hash"))
    are_equal = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)(functions["DPCTLQueue_AreEq"])
    place = ctypes.create_string_buffer(64)
    ctypes.memmove(place, first.addressof_ref(), 16)
    if not are_equal(ctypes.addressof(place), first.addressof_ref()):
        pytest.skip("a sycl::queue here is not a 16-byte shared pointer")
    at = ctypes.c_void_p(ctypes.addressof(place))
    ptr = lib.unimem_xpu_malloc(4096, 0, at)
    assert ptr and stream_of(xpu, ptr) == xpu.stream_handle(first)
    lib.unimem_xpu_free(ptr, 4096, 0, at)
    ctypes.memmove(place, second.addressof_ref(), 16)
    assert are_equal(ctypes.addressof(place), second.addressof_ref())
    other = lib.unimem_xpu_malloc(4096, 0, at)
    assert other and stream_of(xpu, other) == xpu.stream_handle(second) != xpu.stream_handle(first)
    assert other != ptr, "the old queue's block went to a new queue at its address"
    lib.unimem_xpu_free(other, 4096, 0, at)


def test_a_queue_of_another_context_is_refused(lib, xpu, dpctl):
    device = xpu.default_queue(0).sycl_device
    foreign = dpctl.SyclQueue(dpctl.SyclContext([device]), device)
    assert foreign.sycl_context != xpu.default_queue(0).sycl_context
    assert lib.unimem_xpu_malloc(4096, 0, ref(foreign)) is None
    assert "SYCL context" in last_error(lib) and last_error(lib).startswith("ValueError")


def test_bad_xpu_requests(lib, xpu):
    assert lib.unimem_xpu_malloc(64, 3, None) is None
    assert "InvalidDeviceError" in last_error(lib)
    assert lib.unimem_xpu_malloc(0, 0, None) is None
    assert lib.unimem_xpu_malloc(1 << 62, 0, None) is None
    assert last_error(lib).startswith("OutOfMemoryError")
