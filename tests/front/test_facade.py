"""unimem.accelerator: torch.accelerator's functions, names and semantics."""
import collections
import ctypes
import inspect

import pytest

import unimem
import unimem.cpu
import unimem.xpu
from unimem import accelerator as acc
from unimem._runtime.registry import DeviceRegistry

from tests.helpers.fresh import run_fresh

MiB = 1 << 20


def current_type():
    return acc.current_accelerator().type


def test_1000_bytes_count_1024_allocated_and_1000_requested():
    before = acc.memory_stats(0)
    p = acc.caching_allocator_alloc(1000)
    s = acc.memory_stats(0)
    assert s["allocated_bytes.all.current"] - before.get("allocated_bytes.all.current", 0) == 1024
    assert s["requested_bytes.all.current"] - before.get("requested_bytes.all.current", 0) == 1000
    acc.caching_allocator_delete(p)
    assert acc.max_memory_allocated(0) >= 1024
    assert acc.memory_reserved(0) >= 2 * MiB
    acc.empty_cache()
    assert isinstance(acc.memory_stats(0), collections.OrderedDict)


def test_memory_allocated_by_client_is_the_current_accelerators():
    namespace = getattr(unimem, current_type())
    before = acc.memory_allocated_by_client(0).get("unimem", 0)
    p = acc.caching_allocator_alloc(5000)
    try:
        by_client = acc.memory_allocated_by_client(0)
        assert by_client == namespace.memory_allocated_by_client(0)
        assert by_client["unimem"] - before == 5120                     # unimem's own function
        assert sum(by_client.values()) == acc.memory_allocated(0)
    finally:
        acc.caching_allocator_delete(p)
    assert acc.memory_allocated_by_client(0).get("unimem", 0) == before


def test_functions_agree_with_memory_stats():
    p = acc.caching_allocator_alloc(3 * MiB)
    s = acc.memory_stats()
    assert acc.memory_allocated() == acc.memory_allocated(0) == s["allocated_bytes.all.current"]
    assert acc.max_memory_allocated(0) == s["allocated_bytes.all.peak"]
    assert acc.memory_reserved(0) == s["reserved_bytes.all.current"]
    assert acc.max_memory_reserved(0) == s["reserved_bytes.all.peak"]
    nested = acc.memory_stats_as_nested_dict(0)
    assert nested["allocated_bytes"]["all"]["current"] == s["allocated_bytes.all.current"]
    with pytest.warns(FutureWarning):
        assert acc.memory_cached(0) == s["reserved_bytes.all.current"]
    with pytest.warns(FutureWarning):
        assert acc.max_memory_cached(0) == s["reserved_bytes.all.peak"]
    acc.caching_allocator_delete(p)
    acc.reset_peak_memory_stats(0)
    assert acc.max_memory_allocated(0) == acc.memory_allocated(0)
    acc.reset_accumulated_memory_stats(0)
    assert acc.memory_stats(0)["allocation.all.allocated"] == 0
    with pytest.warns(FutureWarning):
        acc.reset_max_memory_allocated(0)
    with pytest.warns(FutureWarning):
        acc.reset_max_memory_cached(0)


def test_device_arguments_as_torch_reads_them():
    kind = current_type()
    p = acc.caching_allocator_alloc(512)
    expected = acc.memory_stats(0)
    assert acc.memory_stats(f"{kind}:0") == expected
    assert acc.memory_stats(unimem.device(kind, 0)) == expected
    assert acc.memory_stats(kind) == expected                     # no index: the current device
    other = "cuda" if kind != "cuda" else "xpu"
    with pytest.raises(ValueError, match=f"{other} doesn't match the current accelerator {kind}"):
        acc.memory_stats(f"{other}:0")
    with pytest.raises(ValueError, match="out of range"):
        acc.memory_stats(acc.device_count())
    with pytest.raises(ValueError, match="Expected one of"):
        acc.memory_stats("tpu:0")
    with pytest.raises(TypeError):
        acc.memory_stats(1.5)
    with pytest.raises(TypeError):
        acc.memory_stats(True)
    with pytest.raises(TypeError):
        acc.memory_stats(device=0)        # positional-only, as in torch.accelerator
    assert acc.memory_stats(0) == expected
    acc.caching_allocator_delete(p)


def test_devices():
    assert acc.device_count() >= 1 and acc.is_available()
    assert acc.current_device_index() == 0
    acc.set_device_index(0)
    with acc.device_index(0):
        assert acc.current_device_index() == 0
    with pytest.raises(ValueError):
        acc.set_device_index(acc.device_count())
    assert str(acc.current_accelerator()) == current_type()
    assert acc.current_accelerator(check_available=True) is not None


def test_bad_input_changes_nothing():
    p = acc.caching_allocator_alloc(4096)
    before = acc.memory_stats(0)
    for bad, error in ((-1, ValueError), (2.5, TypeError), ("10", TypeError), (None, TypeError)):
        with pytest.raises(error):
            acc.caching_allocator_alloc(bad)
    for bad_ptr, error in ((p + 512, ValueError), (12345, ValueError), ("p", TypeError),
                           (None, TypeError), (-1, ValueError)):
        with pytest.raises(error):
            acc.caching_allocator_delete(bad_ptr)
    for fraction, error in ((1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                            ("0.5", TypeError), (None, TypeError)):
        with pytest.raises(error):
            acc.set_per_process_memory_fraction(fraction)
    with pytest.raises(ValueError):
        acc.caching_allocator_alloc(16, device=99)
    with pytest.raises(TypeError):
        acc.caching_allocator_alloc(16, stream="default")
    assert acc.memory_stats(0) == before
    acc.caching_allocator_delete(p)
    with pytest.raises(ValueError, match="already freed"):
        acc.caching_allocator_delete(p)


def test_caching_allocator_alloc_takes_a_device_as_every_accelerator_function_does():
    """``"xpu:0"`` or a device object, as memory_allocated and the namespaces
    take them (it was a TypeError on the accelerator's function alone)."""
    kind = current_type()
    acc.caching_allocator_delete(acc.caching_allocator_alloc(1000))
    before = acc.memory_stats(0)
    for device in (f"{kind}:0", kind, acc.current_accelerator(), unimem.device(kind, 0)):
        p = acc.caching_allocator_alloc(1000, device)
        assert acc.memory_stats(0)["requested_bytes.all.current"] == before["requested_bytes.all.current"] + 1000
        acc.caching_allocator_delete(p)
    before = acc.memory_stats(0)
    other = next(t for t in ("cuda", "xpu", "cpu") if t != kind)
    for bad, error in ((f"{other}:0", ValueError), (f"{kind}:99", RuntimeError), ("junk", ValueError),
                       (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error):
            acc.caching_allocator_alloc(16, bad)
    assert acc.memory_stats(0) == before


def test_size_beyond_the_device_is_an_oom_counted_once():
    before = acc.memory_stats(0)
    total = acc.get_memory_info(0)[1]
    with pytest.raises(unimem.OutOfMemoryError) as info:
        acc.caching_allocator_alloc(total * 4)
    assert isinstance(info.value, MemoryError)
    after = acc.memory_stats(0)
    assert after["num_ooms"] == before.get("num_ooms", 0) + 1
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]


def test_size_zero_gives_null():
    assert acc.caching_allocator_alloc(0) == 0
    acc.caching_allocator_delete(0)


def test_memory_info():
    free, total = acc.get_memory_info()
    assert 0 <= free <= total and total > 0


def test_summary_and_snapshot_run():
    p = acc.caching_allocator_alloc(5000)
    text = acc.memory_summary()
    assert "Allocated memory" in text and text.count("\n") > 30
    segments = acc.memory_snapshot()
    assert any(b["address"] == p and b["state"] == "active_allocated"
               for seg in segments for b in seg["blocks"])
    acc.caching_allocator_delete(p)


def test_memory_stats_is_empty_before_the_first_allocation():
    out = run_fresh("""
        import unimem
        acc = unimem.accelerator
        print(len(acc.memory_stats(0)), acc.memory_allocated(0), acc.max_memory_reserved(0))
        acc.reset_peak_memory_stats(0); acc.empty_cache()
        p = acc.caching_allocator_alloc(1)
        print(len(acc.memory_stats(0)) > 100)
    """)
    assert out.split() == ["0", "0", "0", "True"]


def test_the_cpu_pool_when_asked_for():
    out = run_fresh("""
        import unimem
        p = unimem.accelerator.caching_allocator_alloc(100)
        print(unimem.accelerator.current_accelerator(), unimem.cpu.memory_allocated(0))
    """, UNIMEM_DEVICE="cpu")
    assert out.split() == ["cpu", "512"]


def test_malformed_alloc_conf_is_a_clear_value_error():
    out = run_fresh("""
        import unimem
        try:
            unimem.accelerator.caching_allocator_alloc(100)
        except ValueError as e:
            print("ValueError", e)
        print(len(unimem.accelerator.memory_stats(0)))
    """, UNIMEM_ALLOC_CONF="max_split_size_mb:abc")
    assert "ValueError UNIMEM_ALLOC_CONF='max_split_size_mb:abc'" in out
    assert out.strip().endswith("0")


def test_alloc_conf_applies_to_the_allocators():
    out = run_fresh("""
        import unimem
        p = unimem.accelerator.caching_allocator_alloc(100)
        print(unimem.accelerator.memory_stats(0)["max_split_size"] >> 20)
    """, UNIMEM_ALLOC_CONF="max_split_size_mb:64")
    assert out.split() == ["64"]


def test_pluggable_allocator_gets_caching_and_statistics():
    out = run_fresh("""
        import ctypes, unimem
        calls = []
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        def my_malloc(size, device, stream):
            calls.append(("malloc", size, device, stream))
            return libc.malloc(size)
        def my_free(ptr, size, device, stream):
            calls.append(("free", size))
            libc.free(ptr)
        unimem.change_current_allocator(unimem.PluggableAllocator(my_malloc, my_free))
        acc = unimem.accelerator
        for _ in range(100):
            acc.caching_allocator_delete(acc.caching_allocator_alloc(1000))
        s = acc.memory_stats(0)
        print(len(calls), calls[0], s["num_device_alloc"], s["allocation.all.allocated"])
        try:
            unimem.change_current_allocator(unimem.PluggableAllocator(my_malloc, my_free))
        except RuntimeError as e:
            print("RuntimeError:", e)
        acc.empty_cache()
        print(calls[-1])
    """, UNIMEM_DEVICE="cpu")
    lines = out.strip().splitlines()
    assert lines[0] == "1 ('malloc', 2097152, 0, 0) 1 100"
    assert lines[1] == "RuntimeError: Can't swap an already initialized allocator"
    assert lines[2] == "('free', 2097152)"


def test_change_current_allocator_wants_a_backend():
    with pytest.raises(TypeError):
        unimem.change_current_allocator(lambda size: 0)
    with pytest.raises(TypeError):
        unimem.PluggableAllocator("malloc", "free")


@pytest.mark.parametrize("conf", ["expandable_segments:True", "per_process_memory_fraction:0.001",
                                  "max_split_size_mb:20,roundup_power2_divisions:4"])
def test_the_pinned_host_pool_takes_none_of_the_device_options(conf):
    """The pinned pool was made with UNIMEM_ALLOC_CONF's device options:
    expandable_segments:True made every pinned allocation raise
    NotImplementedError (host USM has no virtual memory), and a memory
    fraction limited it as if it were a device. PyTorch's CachingHostAllocator
    takes none of them."""
    out = run_fresh("""
        import unimem, unimem.cpu, unimem.host as host
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(1 << 20))
        p = host.caching_host_alloc(64 << 20)
        host.caching_host_delete(p)
        pinned, device = host.caching_allocator().settings, unimem.cpu.caching_allocator().settings
        print(host.host_memory_stats()["allocations.allocated"])
        print(pinned["expandable_segments"], pinned["memory_fraction"], pinned["max_split_size"],
              set(pinned["roundup_power2_divisions"]))
        print(device != pinned)
    """, UNIMEM_DEVICE="cpu", UNIMEM_ALLOC_CONF=conf)
    assert out.split() == ["1", "False", "None", "-1", "{0}", "True"]


def test_host_memory_stats_keys():
    from unimem import host
    ptr = host.caching_host_alloc(10_000)
    s = unimem.host_memory_stats()
    for name in ("allocated", "allocated_bytes", "segment", "reserved_bytes",
                 "active_requests", "active_bytes", "allocations"):
        for metric in ("current", "peak", "allocated", "freed"):
            assert f"{name}.{metric}" in s
    for name in ("host_alloc_time", "host_free_time"):
        for field in ("total", "max", "min", "count", "avg"):
            assert f"{name}.{field}" in s
    assert s["allocated_bytes.current"] >= 10_240 and s["num_host_alloc"] >= 1
    assert s["host_alloc_time.count"] == s["num_host_alloc"]
    assert list(s) == sorted(s)
    host.caching_host_delete(ptr)
    unimem.reset_peak_host_memory_stats()
    unimem.reset_accumulated_host_memory_stats()
    s = unimem.host_memory_stats()
    assert s["allocated_bytes.peak"] == s["allocated_bytes.current"] and s["num_host_alloc"] == 0
    acc.empty_host_cache()
    # every segment without a live block goes back; live blocks of others
    # (dpctl's extensions keep a 1-byte host USM buffer for the process's
    # life, from the pool when they first ran with the dpnp allocator) stay
    for segment in host.caching_allocator().snapshot():
        assert any(block["state"] != "inactive" for block in segment["blocks"]), segment
    assert host.backend_name() in ("cuda", "sycl", "page-aligned")


@pytest.fixture
def cpu_type_swapped():
    """A two-device cpu type swapped into the device table (through
    install_type, the one way the table changes, as change_current_allocator
    does), and the type before put back after."""
    from unimem._runtime import devices as _devices
    from unimem.backends.simulated import SimulatedBackend
    unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(1))   # the fast functions' registry found
    swapped = _devices.DeviceType("cpu", SimulatedBackend(capacity=1 << 30, devices=2, name="CPU"))
    previous = _devices.types_by_name().get("cpu")
    _devices.install_type("cpu", swapped)
    yield swapped
    _devices.install_type("cpu", previous)


def test_namespace_alloc_and_delete_follow_the_device_table(cpu_type_swapped):
    """unimem.cpu.caching_allocator_alloc/delete (typed in the core) follow
    the device table: a type swapped in is used at the next call, and a
    device argument still goes through the checks."""
    swapped = cpu_type_swapped
    ptr = unimem.cpu.caching_allocator_alloc(1000)
    assert swapped.registry.peek(0).memory_stats()["allocated_bytes.all.current"] == 1024
    assert unimem.cpu.memory_allocated(0) == 1024
    on_second = unimem.cpu.caching_allocator_alloc(1000, device=1)
    assert swapped.registry.peek(1).memory_stats()["allocated_bytes.all.current"] == 1024
    with pytest.raises(ValueError, match="out of range"):
        unimem.cpu.caching_allocator_alloc(1000, device=2)
    with pytest.raises(TypeError):
        unimem.cpu.caching_allocator_alloc("1000")
    unimem.cpu.caching_allocator_delete(ptr)
    unimem.cpu.caching_allocator_delete(on_second)
    with pytest.raises(ValueError, match="already freed"):
        unimem.cpu.caching_allocator_delete(ptr)
    assert unimem.cpu.memory_allocated(0) == unimem.cpu.memory_allocated(1) == 0


def test_device_registries_come_and_go():
    """A process may make (and drop) any number of device registries, as
    change_current_allocator does; a new one never inherits the current
    device another one set, and there is no limit on how many live at once
    (CuPy has none)."""
    import gc

    from unimem import _core
    from unimem.backends.simulated import SimulatedBackend

    def make():
        return DeviceRegistry("cpu", 4, lambda i: _core.CachingAllocator(SimulatedBackend(devices=4), i))
    for _ in range(500):
        registry = make()
        assert registry.current_index() == 0
        registry.set_current_index(3)
        assert registry.current_index() == 3
        del registry
    alive = [make() for _ in range(100)]
    for number, registry in enumerate(alive):
        registry.set_current_index(number % 4)
    assert [registry.current_index() for registry in alive] == [n % 4 for n in range(100)]
    del alive
    gc.collect()
    assert make().current_index() == 0


@pytest.mark.parametrize("dtype", ["f8", "i2", "c16", "M8", "m8[s]", "?", [("a", "i4"), ("b", "f2")],
                                   ("f4", (2, 2)),                     # a subarray dtype: more dimensions
                                   {"names": ["a", "b"], "formats": ["i1", "f8"], "aligned": True}])
def test_cpu_zeros_is_numpy_zeros_from_the_pool(dtype):
    """Also the dtypes an __array_interface__'s typestr and descr do not carry:
    a subarray dtype came back as shape (3, 5) of V16, an aligned structure
    with an extra padding field."""
    import numpy as np
    before = unimem.cpu.memory_allocated(0)
    dirty = unimem.cpu.empty((7, 5), dtype="u1")
    dirty.fill(0xAB)                       # leave garbage where the next block may land
    del dirty
    out = unimem.cpu.zeros((3, 5), dtype=dtype, order="F")
    expected = np.zeros((3, 5), dtype=dtype, order="F")
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.flags.f_contiguous
    # The memory itself, padding included: tobytes() of an F-order array
    # copies a padded structure field by field and leaves the copy's padding
    # as whatever was in NumPy's new buffer (the test failed at random so).
    assert ctypes.string_at(out.ctypes.data, out.nbytes) == bytes(expected.nbytes)
    assert ctypes.string_at(expected.ctypes.data, expected.nbytes) == bytes(expected.nbytes)
    assert unimem.cpu.memory_allocated(0) > before
    del out
    assert unimem.cpu.memory_allocated(0) == before


# ---------------------------------------------------------------------------
# torch.accelerator's shape: the memory submodule, synchronize, the fraction
# ---------------------------------------------------------------------------
def test_the_memory_submodule_holds_the_same_functions():
    """As torch.accelerator.memory, re-exported by torch.accelerator."""
    import unimem.accelerator.memory as memory
    assert acc.memory is memory
    for name in memory.__all__:
        assert getattr(acc, name) is getattr(memory, name), name
    assert set(memory.__all__) <= set(acc.__all__)
    for name in ("empty_cache", "empty_host_cache", "get_memory_info", "max_memory_allocated",
                 "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
                 "reset_accumulated_memory_stats", "reset_peak_memory_stats"):
        assert name in memory.__all__, name           # torch.accelerator.memory.__all__
    assert acc.memory_stats is memory.memory_stats


def test_synchronize_checks_its_device_and_returns():
    acc.synchronize()
    acc.synchronize(0)
    acc.synchronize(f"{current_type()}:0")
    with pytest.raises(ValueError):
        acc.synchronize(acc.device_count())
    with pytest.raises(TypeError):
        acc.synchronize(1.5)
    with pytest.raises(TypeError):
        acc.synchronize(device=0)                     # positional-only, as torch.accelerator


@pytest.mark.skipif(not unimem.xpu.is_available(), reason="needs a SYCL device")
def test_synchronize_waits_on_every_queue_of_the_xpu_device():
    code = """
        import dpctl
        import unimem
        from unimem import accelerator as acc
        from unimem._runtime import devices as _devices
        assert acc.current_accelerator().type == "xpu"
        device = unimem.xpu.default_queue(0).sycl_device
        unimem.xpu.stream_handle(dpctl.SyclQueue(device))    # a second queue unimem knows
        acc.synchronize(0)                                    # the real queues: returns
        waited = []
        # every wait goes through unimem's serialized queue wait (the OpenCL
        # CPU runtime crashes when two threads wait on one queue at once)
        from unimem.backends import _dpctl_api
        runtime = _devices.get_type("xpu").backend.runtime
        names = {id(runtime.default_queues[0]): "default", id(runtime.queues[1]): "other"}
        real_wait = _dpctl_api.wait_queue

        def watched_wait(queue):
            waited.append(names.get(id(queue), "unknown"))
            real_wait(queue)

        _dpctl_api.wait_queue = watched_wait
        acc.synchronize(0)
        print(sorted(waited))
    """
    out = run_fresh(code, UNIMEM_DEVICE="xpu")
    assert out.strip() == "['default', 'other']"


def test_set_per_process_memory_fraction_takes_a_float_only():
    """PyTorch's check is isinstance(fraction, float); an int is a TypeError."""
    before = acc.get_per_process_memory_fraction()
    for bad in (1, 0, True, "0.5"):
        with pytest.raises(TypeError, match="Invalid type for fraction argument, must be `float`"):
            acc.set_per_process_memory_fraction(bad)
    assert acc.get_per_process_memory_fraction() == before


def test_the_configured_fraction_is_reported_before_the_first_allocation():
    """get_per_process_memory_fraction() once read 1.0 until the first allocation."""
    out = run_fresh("""
        import unimem
        from unimem import accelerator as acc
        assert acc.memory_stats() == {}                # nothing allocated yet
        print(acc.get_per_process_memory_fraction(), unimem.cpu.get_per_process_memory_fraction(0))
        acc.caching_allocator_delete(acc.caching_allocator_alloc(512))
        print(acc.get_per_process_memory_fraction())
    """, UNIMEM_ALLOC_CONF="per_process_memory_fraction:0.5")
    assert out.split() == ["0.5", "0.5", "0.5"]


# torch.accelerator's _snapshot(device=None, augment_with_fx_traces=False)
def test_the_accelerators_snapshot_takes_torchs_arguments():
    assert list(inspect.signature(unimem.accelerator._snapshot).parameters) == ["device", "augment_with_fx_traces"]
    for snapshot in (unimem.accelerator._snapshot(None, False), unimem.accelerator._snapshot(augment_with_fx_traces=True)):
        assert {"segments", "device_traces"} <= set(snapshot)


# torch.xpu.set_per_process_memory_fraction: XPUCachingAllocator takes (0, 1]
def test_xpu_refuses_a_memory_fraction_of_zero_and_changes_nothing():
    before = unimem.xpu.get_per_process_memory_fraction()
    with pytest.raises(ValueError, match=r"invalid fraction:0\. Please set within \(0, 1\]"):
        unimem.xpu.set_per_process_memory_fraction(0.0)
    assert unimem.xpu.get_per_process_memory_fraction() == before
    unimem.cpu.set_per_process_memory_fraction(0.0)          # CUDA's (and the cpu pool's) range: [0, 1]
    try:
        assert unimem.cpu.get_per_process_memory_fraction() == 0.0
    finally:
        unimem.cpu.set_per_process_memory_fraction(1.0)
