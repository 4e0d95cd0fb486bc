"""CUDA virtual memory (expandable segments) through the driver API.

Without a GPU the real backend (``CUDABackend`` + ``cuda_vmm.CudaVMM``) runs
against a simulated driver (``fake_cuda.FakeCudaDriver``) that refuses what
the real one refuses; the simulated driver is itself checked against
``cuda.bindings.driver`` (names, enum values, call arities) where that is
installed, and the last test drives the real driver on a GPU.
"""
import inspect
import re
import sys

import pytest

from unimem import _core
from unimem.backends import cuda_vmm
from unimem.backends.cuda import CUDABackend
from unimem.backends.cuda_vmm import CudaVMM, DriverError

from tests.helpers import fake_cuda
from tests.helpers.fake_cuda import FakeCudaDriver, FakeCudaRuntime
from tests.helpers.gpu import requires_gpu_and_driver_bindings

MiB = 1 << 20
PAGE = 2 * MiB


@pytest.fixture
def runtime():
    return FakeCudaRuntime(devices=2, capacity=64 * MiB)


@pytest.fixture
def driver(runtime):
    return FakeCudaDriver(runtime)


@pytest.fixture
def backend(runtime, driver):
    return CUDABackend(runtime)


def calls(driver, name):
    return [args for call, args in driver.calls if call == name]


# ---------------------------------------------------------------------------
# the backend over the simulated driver
# ---------------------------------------------------------------------------
def test_granularity_is_2_mib_or_the_drivers_recommendation_if_larger(runtime):
    assert CUDABackend(runtime, driver=FakeCudaDriver(runtime)).virtual_memory_granularity(0) == PAGE
    assert CUDABackend(runtime, driver=FakeCudaDriver(runtime, granularity=64 << 10)).virtual_memory_granularity(0) == PAGE
    big = FakeCudaDriver(runtime, granularity=2 * MiB, recommended=8 * MiB)
    assert CUDABackend(runtime, driver=big).virtual_memory_granularity(1) == 8 * MiB


def test_reserve_map_unmap_release(backend, runtime, driver):
    base = backend.reserve_address_range(32 * MiB, 0)
    assert base % PAGE == 0 and driver.reservations == {base: 32 * MiB}
    assert runtime.memGetInfo() == (64 * MiB, 64 * MiB)            # address space costs no memory
    backend.map_pages(base + 4 * MiB, 6 * MiB, 0)
    assert driver.physical_bytes(0) == 6 * MiB and runtime.memGetInfo()[0] == 58 * MiB
    assert len(calls(driver, "cuMemCreate")) == len(calls(driver, "cuMemMap")) == 3   # one handle per page
    assert calls(driver, "cuMemSetAccess")[0][:2] == (base + 4 * MiB, 6 * MiB)        # one grant for the span
    assert all(driver.accessible(base + 4 * MiB + i * MiB, 0) for i in range(6))
    assert not driver.accessible(base + 4 * MiB, 1) and not driver.accessible(base, 0)
    backend.unmap_pages(base + 6 * MiB, PAGE, 0)                    # the middle page alone
    assert driver.physical_bytes(0) == 4 * MiB and not driver.accessible(base + 6 * MiB, 0)
    assert driver.accessible(base + 4 * MiB, 0) and driver.accessible(base + 8 * MiB, 0)
    backend.unmap_pages(base + 4 * MiB, PAGE, 0)
    backend.unmap_pages(base + 8 * MiB, PAGE, 0)
    backend.release_address_range(base, 32 * MiB, 0)
    assert driver.reservations == {} and driver.handles == {} and driver.mappings == {}
    assert runtime.memGetInfo() == (64 * MiB, 64 * MiB)
    assert driver.refused == []                   # never relied on the driver to refuse anything


def test_pages_mapped_together_unmap_one_by_one_and_the_reverse(backend, driver):
    base = backend.reserve_address_range(16 * MiB, 0)
    for page in range(4):
        backend.map_pages(base + page * PAGE, PAGE, 0)
    backend.unmap_pages(base, 8 * MiB, 0)          # pages mapped by four calls, unmapped by one
    backend.map_pages(base, 8 * MiB, 0)
    for page in (2, 0, 3, 1):
        backend.unmap_pages(base + page * PAGE, PAGE, 0)
    assert driver.handles == {} and driver.refused == []
    backend.release_address_range(base, 16 * MiB, 0)


def test_each_device_maps_its_own_memory_and_the_current_device_is_kept(backend, runtime, driver):
    runtime.setDevice(0)
    base = backend.reserve_address_range(8 * MiB, 1)
    backend.map_pages(base, 4 * MiB, 1)
    assert driver.physical_bytes(1) == 4 * MiB and driver.physical_bytes(0) == 0
    assert driver.accessible(base, 1) and not driver.accessible(base, 0)
    assert runtime.getDevice() == 0
    with pytest.raises(ValueError, match="not inside an address range"):
        backend.unmap_pages(base, 4 * MiB, 0)       # device 1's range, named on device 0
    backend.unmap_pages(base, 4 * MiB, 1)
    backend.release_address_range(base, 8 * MiB, 1)
    assert driver.refused == []


def test_unmap_waits_for_the_work_queued_on_the_device(backend, runtime, driver):
    base = backend.reserve_address_range(4 * MiB, 0)
    backend.map_pages(base, PAGE, 0)
    runtime.launch(stream=7)                        # a kernel still using the memory
    event = runtime.eventCreateWithFlags(0)
    runtime.eventRecord(event, 7)
    assert runtime.eventQuery(event) != 0
    backend.unmap_pages(base, PAGE, 0)
    assert runtime.eventQuery(event) == 0           # done before the pages went
    runtime.eventDestroy(event)


def misuse(base):
    """(call, arguments, expected error) for a 16 MiB range at ``base`` of
    device 0 whose pages 2-3 (4-8 MiB) are mapped."""
    return [
        ("reserve_address_range", (0,), ValueError),
        ("reserve_address_range", (MiB,), ValueError),               # not a multiple of 2 MiB
        ("reserve_address_range", (-PAGE,), ValueError),
        ("reserve_address_range", (2.0 * PAGE,), TypeError),
        ("map_pages", (base + MiB, PAGE), ValueError),               # misaligned
        ("map_pages", (base, MiB), ValueError),
        ("map_pages", (base + 4 * MiB, PAGE), ValueError),            # mapped already
        ("map_pages", (base + 2 * MiB, 4 * MiB), ValueError),         # overlaps
        ("map_pages", (base + 14 * MiB, 4 * MiB), ValueError),        # past the range
        ("map_pages", (base - PAGE, PAGE), ValueError),
        ("map_pages", (1 << 46, PAGE), ValueError),                  # never reserved
        ("map_pages", (str(base), PAGE), TypeError),
        ("unmap_pages", (base, PAGE), ValueError),                    # not mapped
        ("unmap_pages", (base + 2 * MiB, 4 * MiB), ValueError),       # partly mapped
        ("unmap_pages", (base + 4 * MiB, MiB), ValueError),
        ("unmap_pages", (base + 5 * MiB, PAGE), ValueError),
        ("unmap_pages", (None, PAGE), TypeError),
        ("release_address_range", (base, 16 * MiB), ValueError),      # pages mapped
        ("release_address_range", (base, 8 * MiB), ValueError),       # not as reserved
        ("release_address_range", (base + PAGE, 14 * MiB), ValueError),
        ("release_address_range", (base, 16.0 * MiB), TypeError),
    ]


def test_misuse_is_refused_before_the_driver_and_changes_nothing(backend, runtime, driver):
    base = backend.reserve_address_range(16 * MiB, 0)
    backend.map_pages(base + 4 * MiB, 4 * MiB, 0)
    state = (dict(driver.reservations), dict(driver.mappings), dict(driver.handles), len(driver.calls),
             runtime.memGetInfo())
    for name, args, error in misuse(base):
        with pytest.raises(error):
            getattr(backend, name)(*args, 0)
        assert (dict(driver.reservations), dict(driver.mappings), dict(driver.handles), len(driver.calls),
                runtime.memGetInfo()) == state, (name, args)
    assert driver.refused == []


@pytest.mark.parametrize("device", [2, -1, True, "0", 0.0])
def test_a_bad_device_is_refused(backend, driver, device):
    error = ValueError if type(device) is int else TypeError
    for call in (lambda: backend.virtual_memory_granularity(device),
                 lambda: backend.reserve_address_range(PAGE, device),
                 lambda: backend.map_pages(0, PAGE, device)):
        with pytest.raises(error):
            call()
    assert driver.reservations == {}


def test_out_of_memory_while_mapping_leaves_nothing_mapped(backend, runtime, driver):
    base = backend.reserve_address_range(128 * MiB, 0)
    backend.map_pages(base, 8 * MiB, 0)
    with pytest.raises(MemoryError):
        backend.map_pages(base + 8 * MiB, 64 * MiB, 0)        # 56 MiB free: runs out at page 29
    assert driver.physical_bytes(0) == 8 * MiB and runtime.memGetInfo()[0] == 56 * MiB
    assert set(driver.mappings) == {base, base + PAGE, base + 2 * PAGE, base + 3 * PAGE}
    assert backend._vmm.ranges(0).mapped(base) == [(base, 8 * MiB)]
    backend.map_pages(base + 8 * MiB, 56 * MiB, 0)             # what is there can still be mapped
    assert runtime.memGetInfo()[0] == 0
    assert driver.refused == []


@pytest.mark.parametrize("call, status, error", [
    ("cuMemCreate", None, MemoryError),
    ("cuMemMap", None, MemoryError),
    ("cuMemSetAccess", fake_cuda._Enums.CUresult.CUDA_ERROR_INVALID_DEVICE, DriverError),
])
def test_a_failing_driver_call_while_mapping_is_undone(backend, runtime, driver, call, status, error):
    base = backend.reserve_address_range(16 * MiB, 0)
    # let two pages through, then fail (cuMemSetAccess comes once, after every page)
    if call != "cuMemSetAccess":
        driver.failures[call] = [driver.CUresult.CUDA_SUCCESS] * 2
    driver.fail_next(call, status)
    with pytest.raises(error) as raised:
        backend.map_pages(base, 8 * MiB, 0)
    if error is DriverError:
        assert isinstance(raised.value, RuntimeError)
        assert "cuMemSetAccess failed: CUDA_ERROR_INVALID_DEVICE (101)" in str(raised.value)
    assert driver.mappings == {} and driver.handles == {} and runtime.memGetInfo()[0] == 64 * MiB
    assert backend._vmm.ranges(0).mapped(base) == []
    backend.map_pages(base, 8 * MiB, 0)
    assert driver.refused == []


def test_no_address_space_left_is_a_memory_error(runtime):
    backend = CUDABackend(runtime, driver=FakeCudaDriver(runtime, address_space=64 * MiB))
    base = backend.reserve_address_range(64 * MiB, 0)
    with pytest.raises(MemoryError):
        backend.reserve_address_range(PAGE, 0)
    backend.release_address_range(base, 64 * MiB, 0)
    backend.release_address_range(backend.reserve_address_range(PAGE, 0), PAGE, 0)


def test_an_unmap_the_driver_refuses_midway_keeps_the_record_exact(backend, driver):
    base = backend.reserve_address_range(8 * MiB, 0)
    backend.map_pages(base, 8 * MiB, 0)
    driver.failures["cuMemUnmap"] = [driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_NOT_SUPPORTED]
    with pytest.raises(DriverError, match="cuMemUnmap"):
        backend.unmap_pages(base, 8 * MiB, 0)
    assert sorted(driver.mappings) == [base + PAGE, base + 2 * PAGE, base + 3 * PAGE]
    assert backend._vmm.ranges(0).mapped(base) == [(base + PAGE, 6 * MiB)]
    backend.unmap_pages(base + PAGE, 6 * MiB, 0)
    backend.release_address_range(base, 8 * MiB, 0)
    assert driver.handles == {}


# ---------------------------------------------------------------------------
# when virtual memory cannot be had: said, and refused by the core
# ---------------------------------------------------------------------------
def test_without_cuda_bindings_the_reason_says_what_to_install(monkeypatch, runtime):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)       # import fails as if not installed
    monkeypatch.setitem(sys.modules, "cuda", None)
    with pytest.raises(ImportError, match=r"pip install cuda-bindings.*pip install -e \"\.\[cuda\]\""):
        cuda_vmm.load_driver()
    monkeypatch.setattr("unimem.backends.cuda._default_runtime", lambda: runtime)
    backend = CUDABackend()                    # the default: the real driver, imported when needed
    with pytest.raises(NotImplementedError, match="pip install cuda-bindings"):
        backend.virtual_memory_granularity(0)
    with pytest.raises(RuntimeError, match="GPU 0 cannot map virtual memory: .*cuda-bindings"):
        backend.reserve_address_range(PAGE, 0)
    with pytest.raises(NotImplementedError, match=r"cuda-bindings.*on device 0|on device 0.*cuda-bindings"):
        _core.CachingAllocator(backend, 0, expandable_segments=True)


def test_the_cuda_device_type_over_cupys_runtime_maps_with_the_real_driver(monkeypatch):
    """``unimem.cuda`` over CuPy's own runtime must use the real driver for
    expandable segments. It passed that runtime on as if given by the user,
    so every real GPU refused ``expandable_segments:True`` ("given without a
    driver"): found on the first GPU run."""
    from unimem._runtime.devices import make_cuda_type
    real_like = FakeCudaRuntime(devices=1, capacity=64 * MiB)       # stands for cupy's runtime module
    driver = FakeCudaDriver(real_like)
    real_like.vmm_driver = None                 # a real runtime brings no stand-in driver (the fake's attaches)
    monkeypatch.setattr("unimem.backends.cuda._default_runtime", lambda: real_like)
    monkeypatch.setattr("unimem.backends.cuda.load_driver", lambda: driver)
    pytest.importorskip("cupy")
    device_type = make_cuda_type()
    assert device_type.backend.virtual_memory_unavailable_reason(0) == ""
    allocator = _core.CachingAllocator(device_type.backend, 0, expandable_segments=True)
    allocator.free(allocator.malloc(3 * MiB))
    assert calls(driver, "cuMemMap")


def test_a_given_runtime_without_a_driver_offers_none(runtime):
    backend = CUDABackend(runtime)              # no FakeCudaDriver attached
    assert "without a driver" in backend.virtual_memory_unavailable_reason(0)
    with pytest.raises(NotImplementedError, match="without a driver"):
        _core.CachingAllocator(backend, 0, expandable_segments=True)


def test_a_gpu_without_vmm_or_a_missing_driver_library_is_said(runtime):
    no_vmm = CUDABackend(runtime, driver=FakeCudaDriver(runtime, vmm_supported=False))
    with pytest.raises(NotImplementedError, match="GPU 1 does not support virtual memory management"):
        no_vmm.virtual_memory_granularity(1)

    class NoLibrary(FakeCudaDriver):
        def cuInit(self, flags):                 # what cuda-bindings raises without libcuda.so
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')
    backend = CUDABackend(runtime, driver=NoLibrary(runtime))
    assert backend.virtual_memory_unavailable_reason(0).startswith(
        "the CUDA driver cannot be used (RuntimeError: \"cuda\" is an NVIDIA driver library")


# ---------------------------------------------------------------------------
# the caching core over it
# ---------------------------------------------------------------------------
def test_a_hole_unmapped_on_the_allocation_path_waits_for_no_kernel(backend, runtime, driver, monkeypatch):
    """With max_reserved_ratio a miss unmaps a hole; while a kernel still
    uses it, the allocation neither calls cudaDeviceSynchronize nor unmaps
    it: its pages go once the kernel has finished (at a later allocation)."""
    waits = []
    synchronize = runtime.deviceSynchronize
    monkeypatch.setattr(runtime, "deviceSynchronize", lambda: (waits.append(1), synchronize())[1])
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True, max_reserved_ratio=1.0)
    allocator.set_capacity(64 * MiB)
    first, hole, last = (allocator.malloc(size) for size in (2 * MiB, 8 * MiB, 2 * MiB))
    runtime.launch(0)                                    # a kernel using the hole
    allocator.free(hole)
    allocator.malloc(10 * MiB)
    assert waits == [] and driver.physical_bytes(0) == 22 * MiB     # the hole is still mapped
    runtime.complete(0)
    allocator.process_events()                           # as the next allocation does
    assert waits == [] and driver.physical_bytes(0) == 14 * MiB     # now it is not
    assert not any(hole <= at < hole + 8 * MiB for at in driver.mappings)
    allocator._check_invariants()


def test_the_core_grows_and_shrinks_an_expandable_segment_through_the_driver(backend, runtime, driver):
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True)
    allocator.set_capacity(64 * MiB)
    blocks = [allocator.malloc(3 * MiB) for _ in range(4)]
    assert len(driver.reservations) == 1                    # one range, grown page by page
    assert driver.physical_bytes(0) == allocator.memory_reserved() == 12 * MiB
    assert all(driver.accessible(b, 0) for b in blocks)
    with pytest.raises(Exception, match="out of memory"):
        allocator.malloc(60 * MiB)
    for b in blocks:
        allocator.free(b)
    allocator.empty_cache()
    assert driver.physical_bytes(0) == 0 and driver.mappings == {}
    allocator.empty_virt_addr_cache()
    assert driver.reservations == {} and driver.handles == {} and driver.refused == []


# ---------------------------------------------------------------------------
# the simulated driver refuses what the real one refuses
# ---------------------------------------------------------------------------
def test_the_simulated_driver_refuses_misuse(runtime):
    d = FakeCudaDriver(runtime)
    R = d.CUresult
    assert d.cuMemAddressReserve(PAGE, 0, 0, 0)[0] == R.CUDA_ERROR_NOT_INITIALIZED
    assert d.cuInit(0) == (R.CUDA_SUCCESS,)
    prop = d.CUmemAllocationProp()
    assert d.cuMemCreate(PAGE, prop, 0)[0] == R.CUDA_ERROR_INVALID_VALUE        # no type, no location
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    status, base = d.cuMemAddressReserve(8 * MiB, PAGE, 0, 0)
    assert status == R.CUDA_SUCCESS and base % PAGE == 0
    assert d.cuMemAddressReserve(PAGE + 1, 0, 0, 0)[0] == R.CUDA_ERROR_INVALID_VALUE
    assert d.cuMemCreate(MiB, prop, 0)[0] == R.CUDA_ERROR_INVALID_VALUE          # below the granularity
    _, h1 = d.cuMemCreate(PAGE, prop, 0)
    _, h2 = d.cuMemCreate(PAGE, prop, 0)
    assert d.cuMemMap(1 << 40, PAGE, 0, h1, 0) == (R.CUDA_ERROR_INVALID_VALUE,)   # not reserved
    assert d.cuMemMap(base + MiB, PAGE, 0, h1, 0) == (R.CUDA_ERROR_INVALID_VALUE,)  # misaligned
    assert d.cuMemMap(base, 4 * MiB, 0, h1, 0) == (R.CUDA_ERROR_INVALID_VALUE,)   # past the handle
    assert d.cuMemMap(base, PAGE, 0, h1, 0) == (R.CUDA_SUCCESS,)
    assert d.cuMemMap(base, PAGE, 0, h2, 0) == (R.CUDA_ERROR_INVALID_VALUE,)      # mapped already
    assert not d.accessible(base, 0)                                           # no access until granted
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert d.cuMemSetAccess(base, 4 * MiB, [access], 1) == (R.CUDA_ERROR_INVALID_VALUE,)  # not all mapped
    assert d.cuMemSetAccess(base, PAGE, [access], 1) == (R.CUDA_SUCCESS,) and d.accessible(base, 0)
    assert d.cuMemUnmap(base + PAGE, PAGE) == (R.CUDA_ERROR_INVALID_VALUE,)      # not mapped
    assert d.cuMemAddressFree(base, 8 * MiB) == (R.CUDA_ERROR_INVALID_VALUE,)    # still mapped
    assert d.cuMemAddressFree(base, 4 * MiB) == (R.CUDA_ERROR_INVALID_VALUE,)    # not the reservation
    # releasing a mapped handle is allowed: the memory goes with its last mapping
    assert d.cuMemRelease(h1) == (R.CUDA_SUCCESS,) and d.physical_bytes(0) == 4 * MiB
    with pytest.raises(AssertionError, match="undefined behaviour"):
        d.cuMemRelease(h1)
    assert d.cuMemMap(base + PAGE, PAGE, 0, h1, 0) == (R.CUDA_ERROR_INVALID_VALUE,)  # released
    assert d.cuMemUnmap(base, PAGE) == (R.CUDA_SUCCESS,) and d.physical_bytes(0) == PAGE
    assert d.cuMemRelease(h2) == (R.CUDA_SUCCESS,) and d.physical_bytes(0) == 0
    assert d.cuMemAddressFree(base, 8 * MiB) == (R.CUDA_SUCCESS,)
    _, big = d.cuMemAddressReserve(8 * MiB, PAGE, 0, 0)
    handles = [d.cuMemCreate(PAGE, prop, 0) for _ in range(33)]
    assert [s for s, _ in handles].count(R.CUDA_ERROR_OUT_OF_MEMORY) == 1        # 64 MiB: 32 pages
    assert len(d.refused) == 13


def driver_names_cuda_vmm_uses():
    """Every ``driver.<name>`` (and ``.<member>``) and every called name in
    cuda_vmm.py, read from its source."""
    source = inspect.getsource(cuda_vmm)
    called = set(re.findall(r'_call\("(\w+)"', source))
    attributes = set(re.findall(r"\b(?:d|self\.driver)\.(\w+(?:\.\w+)?)", source))
    return called | attributes | {"cuGetErrorName"}


def test_the_simulated_driver_has_every_name_cuda_vmm_uses(runtime):
    d = FakeCudaDriver(runtime)
    names = driver_names_cuda_vmm_uses()
    assert {"cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
            "cuMemAddressFree", "cuMemGetAllocationGranularity", "CUresult.CUDA_ERROR_OUT_OF_MEMORY"} <= names
    for name in names:
        obj = d
        for part in name.split("."):
            obj = getattr(obj, part)


def test_the_simulated_driver_matches_cuda_bindings(runtime):
    """Names, enum values and argument counts of the simulated driver are
    cuda.bindings.driver's, so code that runs against it calls the real one right."""
    real = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is in the cuda and test extras")
    fake = FakeCudaDriver(runtime)
    for name in driver_names_cuda_vmm_uses():
        real_obj, fake_obj = real, fake
        for part in name.split("."):
            real_obj, fake_obj = getattr(real_obj, part), getattr(fake_obj, part)
        if isinstance(fake_obj, int):
            assert int(real_obj) == int(fake_obj), name
        elif callable(fake_obj) and name.startswith("cu"):
            signature = real_obj.__doc__.strip().splitlines()[0]        # "cuMemMap(ptr, size_t size, ...)"
            real_arity = signature[signature.index("(") + 1:signature.rindex(")")].count(",") + 1
            assert real_arity == len(inspect.signature(fake_obj).parameters), (name, signature)
    for cls, fields in (("CUmemAllocationProp", {"type", "location"}), ("CUmemAccessDesc", {"location", "flags"})):
        assert fields <= set(dir(getattr(real, cls)())), cls
        assert {"type", "id"} <= set(dir(getattr(real, cls)().location)), cls


# ---------------------------------------------------------------------------
# on a real GPU, with cuda-bindings
# ---------------------------------------------------------------------------
@requires_gpu_and_driver_bindings
def test_gpu_real_driver_maps_memory_cupy_can_use():
    import cupy
    backend = CUDABackend()
    granularity = backend.virtual_memory_granularity(0)
    assert granularity >= PAGE and granularity & (granularity - 1) == 0
    free_before = backend.memory_info(0)[0]
    base = backend.reserve_address_range(64 * granularity, 0)
    backend.map_pages(base, 4 * granularity, 0)
    backend.map_pages(base + 4 * granularity, granularity, 0)
    assert backend.memory_info(0)[0] <= free_before - 5 * granularity + 64 * MiB
    n = 5 * granularity // 4
    memory = cupy.cuda.UnownedMemory(base, 5 * granularity, backend, 0)
    array = cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(memory, 0))
    array[:] = cupy.arange(n, dtype=cupy.float32)          # across pages mapped by two calls
    assert float(array[-1]) == n - 1 and float(array.sum(dtype=cupy.float64)) == float(n) * (n - 1) / 2
    del array, memory
    backend.unmap_pages(base + 2 * granularity, granularity, 0)
    backend.unmap_pages(base, 2 * granularity, 0)
    backend.unmap_pages(base + 3 * granularity, 2 * granularity, 0)
    backend.release_address_range(base, 64 * granularity, 0)
    assert backend.memory_info(0)[0] >= free_before - 64 * MiB
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True)
    ptr = allocator.malloc(100 * MiB)
    cupy.ndarray((25 * MiB,), cupy.float32, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(ptr, 100 * MiB, allocator, 0), 0)).fill(1.0)
    allocator.free(ptr)
    allocator.empty_cache()
    allocator.empty_virt_addr_cache()
