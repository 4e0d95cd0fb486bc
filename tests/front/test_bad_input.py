"""Every public function, called with bad input.

Each call either works or raises a documented exception (TypeError,
ValueError, unimem.OutOfMemoryError; RuntimeError only to say a device type
is not available; OverflowError where dpnp raises it, for a value its data
type cannot hold), and after a raise every allocator is exactly as before:
no statistic moved (but num_ooms, which counts refused sizes), no block
appeared or went.
"""
import gc
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import unimem
import unimem.cuda
import unimem.xpu
from unimem import _core, _xpu_pools, accelerator, cpu, host, xpu
from unimem._runtime import devices as _devices
from unimem._runtime.config import parse_alloc_conf
from unimem.backends.simulated import SimulatedBackend

from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

DOCUMENTED = (TypeError, ValueError, unimem.OutOfMemoryError)
# dpnp.asarray(300, dtype="u1") and dpnp.full(3, 2**63) raise OverflowError
# (NumPy's conversion), and so do unimem's (tests/front/test_xpu.py).
OVERFLOWS_AS_DPNP = {"xpu.asarray", "xpu.full"}

garbage = st.one_of(
    st.none(), st.booleans(),
    st.integers(-3, 3), st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -0.0, 1e300, 0.5, 2.0]),
    st.text(max_size=10),
    st.sampled_from(["cpu", "cpu:0", "xpu", "xpu:0", "xpu:7", "cuda:0", "xpu:-1", "tpu:0", "xpu:0:1", ":", "",
                     "0", "f4", "object", "device", "host", "all", "state"]),
    st.binary(max_size=4), st.lists(st.integers(-5, 5), max_size=3), st.tuples(st.integers(-5, 5)),
    st.just(object()), st.builds(lambda: id(object())),          # a foreign pointer
    st.builds(lambda: lambda *a: None),
)

SIMULATED = _core.CachingAllocator(SimulatedBackend(capacity=1 << 30), 0)
SIMULATED.set_capacity(1 << 30)


def allocators():
    found = [SIMULATED]
    for name in _devices.KNOWN_TYPES:
        dtype = _devices._types.get(name)
        if dtype is not None:
            found += list(dtype.registry.initialized().values())
    if host._registry is not None:
        found += list(host._registry.initialized().values())
    shared = _xpu_pools.shared_registry()
    if shared is not None:
        found += list(shared.initialized().values())
    return found


def wait_for_pending_frees():
    """On each XPU device, wait for the arrays deleted while their kernels
    ran: dpctl keeps them until the kernels are done, then frees them from a
    runtime thread at a moment of its own (or when xpu.empty lets its host
    tasks through). Unwaited, those frees land between two snapshots and
    look like the work of the call between them."""
    xpu_type = _devices._types.get("xpu")        # set up already: never probed here
    if xpu_type is not None:
        for index in range(xpu_type.device_count):
            xpu.synchronize(index)


@pytest.fixture(scope="module", autouse=True)
def no_garbage_from_earlier_files():
    """Pool memory held by the garbage of earlier test files goes back before
    this file's first snapshot, not at the first gc.collect() between two.
    (Each call here collects its own garbage: once per file is enough, and
    once per example would double the property test's time.)"""
    gc.collect()


def state():
    """Every allocator's statistics, live blocks, fraction and limit, with
    the frees already under way landed."""
    wait_for_pending_frees()
    out = {}
    for a in allocators():
        stats = dict(a.memory_stats())
        stats.pop("num_ooms", None)
        out[id(a)] = (stats, sorted(a.live_allocations()), a.get_memory_fraction(), a.get_memory_limit())
    return out


def pristine(entry):
    """An allocator that holds nothing and never did (created lazily, as
    PyTorch initializes its allocator at the first request, even a refused one)."""
    stats, live, fraction, limit = entry
    return (not live and fraction == 1.0 and limit == 0
            and all(v == 0 for k, v in stats.items() if k != "max_split_size"))


def unchanged(before, after):
    return all(after.get(key) == value for key, value in before.items()) and all(
        pristine(entry) for key, entry in after.items() if key not in before)


CALLS = {
    # the facade
    "accelerator.memory_stats": (accelerator.memory_stats, 1),
    "accelerator.memory_stats_as_nested_dict": (accelerator.memory_stats_as_nested_dict, 1),
    "accelerator.memory_allocated": (accelerator.memory_allocated, 1),
    "accelerator.memory_allocated_by_client": (accelerator.memory_allocated_by_client, 1),
    "accelerator.max_memory_allocated": (accelerator.max_memory_allocated, 1),
    "accelerator.memory_reserved": (accelerator.memory_reserved, 1),
    "accelerator.max_memory_reserved": (accelerator.max_memory_reserved, 1),
    "accelerator.reset_peak_memory_stats": (accelerator.reset_peak_memory_stats, 1),
    "accelerator.reset_accumulated_memory_stats": (accelerator.reset_accumulated_memory_stats, 1),
    "accelerator.get_memory_info": (accelerator.get_memory_info, 1),
    "accelerator.mem_get_info": (accelerator.mem_get_info, 1),
    "accelerator.current_stream": (accelerator.current_stream, 1),
    "accelerator.get_device_capability": (accelerator.get_device_capability, 1),
    "accelerator.memory_summary": (accelerator.memory_summary, 2),
    "accelerator.set_device_index": (accelerator.set_device_index, 1),
    "accelerator.caching_allocator_alloc": (accelerator.caching_allocator_alloc, 3),
    "accelerator.caching_allocator_delete": (accelerator.caching_allocator_delete, 1),
    "accelerator.set_per_process_memory_fraction": (accelerator.set_per_process_memory_fraction, 2),
    "accelerator.get_per_process_memory_fraction": (accelerator.get_per_process_memory_fraction, 1),
    "accelerator.record_stream": (accelerator.record_stream, 2),
    "accelerator._record_memory_history": (accelerator._record_memory_history, 4),
    # the namespaces
    "cpu.caching_allocator_alloc": (cpu.caching_allocator_alloc, 3),
    "cpu.memory_stats": (cpu.memory_stats, 1),
    "cpu.memory_allocated_by_client": (cpu.memory_allocated_by_client, 1),
    "cpu.empty": (cpu.empty, 2),
    "cpu.zeros": (cpu.zeros, 2),
    "cpu.set_device": (cpu.set_device, 1),
    "cpu.change_current_allocator": (cpu.change_current_allocator, 1),
    "xpu.empty": (xpu.empty, 2),
    "xpu.empty(kw)": (lambda a, b, c: xpu.empty(a, device=b, usm_type=c), 3),
    "xpu.empty(queue)": (lambda a, b: xpu.empty(a, sycl_queue=b), 2),
    "xpu.zeros": (xpu.zeros, 2),
    "xpu.full": (xpu.full, 3),
    "xpu.asarray": (xpu.asarray, 2),
    "xpu.record_stream": (xpu.record_stream, 2),
    "xpu.allocator_for": (xpu.allocator_for, 2),
    "xpu.stream_handle": (xpu.stream_handle, 1),
    "xpu.default_queue": (xpu.default_queue, 1),
    "cuda.allocator": (unimem.cuda.allocator, 1),
    "cuda.memory_stats": (unimem.cuda.memory_stats, 1),
    "host.caching_host_alloc": (host.caching_host_alloc, 1),
    "host.caching_host_delete": (host.caching_host_delete, 1),
    "unimem.device": (unimem.device, 2),
    "unimem.PluggableAllocator": (unimem.PluggableAllocator, 2),
    "unimem.change_current_allocator": (unimem.change_current_allocator, 1),
    "unimem.attach_out_of_memory_observer": (lambda f: unimem.attach_out_of_memory_observer(f), 1),
    "parse_alloc_conf": (parse_alloc_conf, 1),
    # a caching allocator itself
    "CachingAllocator.malloc": (SIMULATED.malloc, 2),
    "CachingAllocator.allocate": (SIMULATED.allocate, 2),
    "CachingAllocator.free": (SIMULATED.free, 1),
    "CachingAllocator.record_stream": (SIMULATED.record_stream, 2),
    "CachingAllocator.set_memory_fraction": (SIMULATED.set_memory_fraction, 1),
    "CachingAllocator.set_memory_limit": (SIMULATED.set_memory_limit, 1),
    "CachingAllocator.round_size": (SIMULATED.round_size, 1),
    "CachingAllocator.empty_cache": (SIMULATED.empty_cache, 1),
}


def undo_success(name, result):
    """Put back what a successful call changed, so the next example starts clean."""
    if isinstance(result, int) and result > 0 and name.endswith("caching_allocator_alloc"):
        (cpu if name.startswith("cpu") else accelerator).caching_allocator_delete(result)
    elif isinstance(result, int) and result > 0 and name == "CachingAllocator.malloc":
        SIMULATED.free(result)
    elif isinstance(result, int) and result > 0 and name == "host.caching_host_alloc":
        host.caching_host_delete(result)
    elif name == "accelerator._record_memory_history":
        accelerator._record_memory_history(None, clear_history=True)
    elif name == "unimem.attach_out_of_memory_observer":
        unimem._observe.history._oom_observers.clear()
    for a in allocators():
        if a.get_memory_limit():
            a.set_memory_limit(0)
        if a.get_memory_fraction() != 1.0:
            a.set_memory_limit(0)


# 1,000 examples, each with two full collections (gc.collect): about 100 s
# alone, but a full collection costs more as the heap of a whole suite run
# grows, and one fresh-clone run passed 300 s here (no example hung: the
# timeout fired inside the collector).
@pytest.mark.timeout(900)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CALLS)), args=st.lists(garbage, min_size=3, max_size=3))
# Found by this test before: a limit beyond size_t (OverflowError), zeros of a
# dtype fill(0) refuses (block kept by the traceback), and a request above
# the SYCL device's largest single allocation (the cache flushed for nothing).
@example(name="CachingAllocator.set_memory_limit", args=[1 << 64, None, None])
@example(name="cpu.zeros", args=[True, b"\x15", None])
@example(name="xpu.empty", args=[b"|\xca\xfa\xfd", None, None])
@example(name="xpu.asarray", args=[-1, b"\x02", None])     # -1 as uint8 (b"\x02" is its code)
@example(name="xpu.full", args=[3, 1 << 63, None])          # int64: refused before a block is taken
@example(name="xpu.full", args=[3, 300, "u1"])
@example(name="xpu.full", args=[3, float("nan"), b"\x02"])   # NaN as uint8: refused before a block is taken
@example(name="xpu.full", args=[3, 1e300, b"i"])
@example(name="xpu.full", args=[3, 5, b","])                  # NumPy's SyntaxError for b",": a TypeError
def test_every_public_function_either_works_or_raises_a_documented_error(name, args):
    check_call(name, args)


def check_call(name, args):
    """Call ``CALLS[name]`` with ``args``: it works (and is undone) or raises
    a documented error with every allocator as before."""
    function, arity = CALLS[name]
    before = state()
    try:
        result = function(*args[:arity])
    except (*DOCUMENTED, *((OverflowError,) if name in OVERFLOWS_AS_DPNP else ())):
        del function
        gc.collect()
        assert unchanged(before, state()), f"{name}{tuple(args[:arity])!r} raised, but the allocators changed"
        return
    except RuntimeError as error:
        # A device type this machine lacks (cuda here, xpu on a GPU machine without dpctl).
        assert re.search(r"no (cuda|xpu) device is available", str(error)), f"{name}{tuple(args[:arity])!r}: {error!r}"
        assert unchanged(before, state())
        return
    undo_success(name, result)
    del result
    gc.collect()


def test_frees_still_pending_from_earlier_tests_are_not_blamed_on_the_call():
    """Pool arrays deleted while their kernels run come back to the pool when
    dpctl's keep-alive host tasks let go of them, asynchronously, and
    ``xpu.empty`` lets those tasks through before it allocates. Left by an
    earlier test file (test_xpu.py, test_dpnp_allocator_blocks.py), such frees
    landed between the snapshots of the test above and failed it."""
    dpnp = pytest.importorskip("dpnp")
    if not _devices.is_available("xpu"):
        pytest.skip(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
    with xpu.using_allocator():
        x = dpnp.ones((500, 500), dtype="f4")
        for _ in range(4):
            x = x + 1                  # kernels, each array kept alive by a host task
        del x
    check_call("xpu.empty", [1 << 50, None, None])         # out of memory, after letting the tasks through


def test_double_free_and_foreign_pointers_change_nothing():
    p = accelerator.caching_allocator_alloc(4096)
    accelerator.caching_allocator_delete(p)
    before = state()
    for bad in (p, id(object()), p + 1, 1 << 60, 1):
        with pytest.raises(ValueError):
            accelerator.caching_allocator_delete(bad)
        with pytest.raises(ValueError):
            SIMULATED.free(bad)
    assert unchanged(before, state())


# ---------------------------------------------------------------------------
# caching_allocator_delete of an address the allocator does not hold: torch's
# allocator raises RuntimeError("invalid device pointer: ...")
# ---------------------------------------------------------------------------
def _namespaces_with_delete():
    return [pytest.param("cpu", id="cpu"), pytest.param("accelerator", id="accelerator"),
            pytest.param("cuda", id="cuda")]


@pytest.mark.parametrize("name", _namespaces_with_delete())
def test_freeing_what_the_allocator_does_not_hold_is_torchs_runtime_error(name, request):
    if name == "cuda":
        pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
        request.getfixturevalue("fake")
        import unimem.cuda as ns
    else:
        ns = getattr(unimem, name)
    ptr = ns.caching_allocator_alloc(4096)
    before = dict(ns.memory_stats())
    for bad in (ptr + 512, 0x7F00_0000_1000):
        with pytest.raises(RuntimeError) as caught:
            ns.caching_allocator_delete(bad)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, unimem.InvalidPointerError)
    ns.caching_allocator_delete(ptr)
    with pytest.raises(unimem.InvalidPointerError):
        ns.caching_allocator_delete(ptr)                 # freed already
    after = dict(ns.memory_stats())
    assert after["allocation.all.current"] == before["allocation.all.current"] - 1


@pytest.mark.parametrize("name", ["cpu", "accelerator", "xpu"])
def test_record_stream_of_an_address_not_handed_out_is_torchs_runtime_error(name):
    """torch: RuntimeError, "No allocated block can be found"; the namespaces
    raised a plain ValueError (the core's record_stream already raised
    InvalidPointerError)."""
    ns = getattr(unimem, name)
    before = dict(ns.memory_stats())
    with pytest.raises(unimem.InvalidPointerError) as caught:
        ns.record_stream(0x7F00_0000_1000, 0)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)
    assert dict(ns.memory_stats()) == before


def test_the_cores_own_free_raises_it_too():
    from unimem import _core
    from unimem.backends.simulated import SimulatedBackend
    core = _core.CachingAllocator(SimulatedBackend(), 0)
    with pytest.raises(unimem.InvalidPointerError):
        core.free(0x1000)


@pytest.mark.parametrize("namespace", [cpu, xpu])
def test_a_dtype_numpy_cannot_parse_is_a_type_error(namespace):
    """NumPy parses b"," with ast.literal_eval and raised its SyntaxError out
    of unimem.cpu/xpu.zeros (found by the hypothesis test above)."""
    before = state()
    with pytest.raises(TypeError, match="not understood"):
        namespace.zeros(3, b",")
    assert unchanged(before, state())


@pytest.mark.parametrize("call", [
    lambda: cpu.memory_stats(7), lambda: cpu.memory_allocated("cpu:3"), lambda: cpu.reset_peak_memory_stats(7),
    lambda: cpu.set_per_process_memory_fraction(0.5, 7), lambda: cpu.caching_allocator_alloc(64, 7),
    lambda: cpu.caching_allocator_alloc(64, -5), lambda: cpu.caching_allocator_alloc(64, 1 << 30),
    lambda: accelerator.memory_stats(99), lambda: cpu.memory_allocated_by_client(7),
    lambda: accelerator.memory_allocated_by_client(99),
], ids=["memory_stats", "device string", "reset", "fraction", "alloc", "negative", "huge", "accelerator",
        "by client", "accelerator by client"])
def test_a_device_index_naming_no_device_is_a_runtime_error_as_in_pytorch(call):
    """PyTorch's "Invalid device argument" is a RuntimeError; unimem's stays a
    ValueError as well (InvalidDeviceError is both), and changes nothing."""
    before = cpu.memory_stats()
    with pytest.raises(unimem.InvalidDeviceError, match="device index") as raised:
        call()
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, ValueError)
    assert cpu.memory_stats() == before


def _raised_by(function, device):
    """The type of what ``function(device)`` raises (None: it answered)."""
    try:
        function(device)
    except Exception as error:            # noqa: BLE001 (the type is the answer)
        return type(error)
    return None


@pytest.mark.parametrize("namespace", [cpu, xpu, unimem.cuda, accelerator], ids=["cpu", "xpu", "cuda", "accelerator"])
@pytest.mark.parametrize("device", [7, "cpu:3", "cuda:1", "xpu:0", -1, 1 << 70, 1.5, True, "gpu", object()],
                         ids=lambda device: repr(device) if not type(device) is object else "object")
def test_memory_allocated_by_client_refuses_a_device_as_memory_allocated_does(namespace, device):
    """memory_allocated reads the registry's counter, memory_allocated_by_client
    the allocator's blocks: a device argument either answers both or raises
    the same error type from both (cuda here has no device: only its default
    device reads as never used), and neither changes an allocator."""
    before = state()
    assert _raised_by(namespace.memory_allocated_by_client, device) is _raised_by(namespace.memory_allocated, device)
    assert unchanged(before, state())
