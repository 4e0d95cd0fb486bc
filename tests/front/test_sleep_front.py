"""Sleep mode through the namespaces: ``unimem.cpu``
sleeps for real, ``unimem.xpu`` (the SYCL CPU device here) refuses saying
why, ``unimem.accelerator`` dispatches to the current device type."""
import ctypes

import numpy
import pytest

import unimem
import unimem.accelerator as acc
import unimem.cpu as cpu
from unimem._runtime import devices as _devices

MiB = 1 << 20


@pytest.fixture
def awake_cpu():
    yield cpu
    cpu.wake_up()


def test_cpu_arrays_keep_their_addresses_and_values(awake_cpu):
    pooled = cpu.empty((512, 512), dtype="f4")
    pooled[:] = numpy.arange(512, dtype="f4")
    address = pooled.ctypes.data
    expected = pooled.copy()
    allocated = cpu.memory_allocated()
    cpu.sleep()
    assert cpu.is_sleeping() and cpu.memory_reserved() == 0
    assert cpu.memory_allocated() == allocated
    with pytest.raises(RuntimeError, match=r"wake_up\(\)"):
        cpu.empty(10)
    cpu.wake_up()
    assert not cpu.is_sleeping()
    assert pooled.ctypes.data == address
    numpy.testing.assert_array_equal(pooled, expected)
    del pooled
    cpu.empty_cache()


def test_cpu_sleep_without_offload_and_frees_while_asleep(awake_cpu):
    block = cpu.caching_allocator_alloc(8 * MiB)
    other = cpu.caching_allocator_alloc(MiB)
    ctypes.memset(other, 1, MiB)
    cpu.sleep(offload=False)
    cpu.caching_allocator_delete(other)           # bookkeeping only
    cpu.wake_up()
    ctypes.memset(block, 2, 8 * MiB)               # mapped and writable at its address
    cpu.caching_allocator_delete(block)
    cpu.empty_cache()


def test_cpu_sleep_refuses_what_is_no_bool(awake_cpu):
    with pytest.raises(TypeError, match="offload must be a bool, not str"):
        cpu.sleep(offload="yes")
    with pytest.raises(TypeError, match="not numpy.int64"):
        cpu.sleep(offload=numpy.int64(1))
    assert not cpu.is_sleeping()


@pytest.mark.parametrize("flag", [numpy.True_, numpy.False_])
def test_sleep_and_a_pools_snapshot_take_a_numpy_bool_as_pybind11_does(awake_cpu, flag):
    """They refused one with "offload must be a bool, not bool", while
    MemPool(use_on_oom=numpy.True_) took it."""
    ptr = cpu.caching_allocator_alloc(1000)
    cpu.sleep(flag)
    assert cpu.is_sleeping()
    cpu.wake_up()
    pool = cpu.MemPool(use_on_oom=flag)
    pool.sleep(flag)
    pool.wake_up()
    assert isinstance(pool.snapshot(flag), list)
    cpu.caching_allocator_delete(ptr)


def test_a_device_never_used_is_awake_and_wake_up_does_nothing():
    assert not unimem.cpu.is_sleeping(0)
    unimem.cpu.wake_up(0)


def test_xpu_cannot_sleep_and_says_why():
    if not _devices.is_available("xpu"):
        pytest.skip(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
    import unimem.xpu as xpu
    block = xpu.caching_allocator_alloc(1000)
    with pytest.raises(NotImplementedError, match="SYCL USM has no way"):
        xpu.sleep()
    assert not xpu.is_sleeping()
    xpu.caching_allocator_delete(xpu.caching_allocator_alloc(1000))     # still allocates
    xpu.caching_allocator_delete(block)


def test_the_accelerator_sleeps_its_current_device_type():
    """Where the current device's memory cannot be given back (SYCL USM;
    CUDA without expandable segments, which a GPU machine is by default),
    the refusal; elsewhere a sleep and a wake-up."""
    device_type = _devices.current_type()
    settings = device_type.registry.get(device_type.registry.current_index()).settings
    if device_type.name == "xpu" or (device_type.name == "cuda" and not settings["expandable_segments"]):
        with pytest.raises(NotImplementedError):
            acc.sleep()
        assert not acc.is_sleeping()
        return
    acc.sleep(offload=False)
    try:
        assert acc.is_sleeping() and acc.memory_reserved() == 0
    finally:
        acc.wake_up()
    assert not acc.is_sleeping()


def test_what_reads_the_snapshot_of_a_sleeping_cpu_agrees_with_its_statistics(awake_cpu):
    """memory_snapshot leaves out the memory a sleep gave back (as the
    unmapped parts of expandable segments): its segment sizes add up to
    memory_reserved(), and the tools that read a snapshot keep working."""
    report_data = pytest.importorskip("unimem._observe.report_data")     # needs the report extra
    blocks = [cpu.caching_allocator_alloc(n) for n in (1000, 3 * MiB, 25 * MiB)]
    awake = cpu.memory_snapshot()
    assert sum(s["total_size"] for s in awake) == cpu.memory_reserved() > 0
    cpu.sleep()
    assert cpu.memory_snapshot() == []
    snapshot = cpu._snapshot()
    assert snapshot["segments"] == []
    made = report_data.snapshot_memory_stats(snapshot, 0)
    assert made["reserved_bytes.all.current"] == cpu.memory_reserved() == 0
    assert "reserved" in cpu.memory_summary().lower()
    try:
        from unimem._observe.report import report_html
    except ImportError:                       # plotly and fastjsonschema are extras
        report_html = None
    if report_html is not None:
        assert "<html" in report_html(snapshot, device=0).lower()
    cpu.wake_up()
    assert cpu.memory_snapshot() == awake
    for ptr in blocks:
        cpu.caching_allocator_delete(ptr)
    cpu.empty_cache()


@pytest.mark.parametrize("case", ["freed while asleep", "cache turned off while asleep"])
def test_with_the_cache_off_what_wake_up_brings_back_free_goes_back(awake_cpu, case):
    """caching_allocator_enable(False): every free gives memory back at once,
    and what is cached when it is turned off goes back too. Memory freed (or
    cached) while asleep came back at wake_up into the cache and stayed."""
    cpu.empty_cache()
    try:
        if case == "freed while asleep":
            cpu.caching_allocator_enable(False)
            p = cpu.caching_allocator_alloc(4 * MiB)
            cpu.sleep(offload=False)
            cpu.caching_allocator_delete(p)
            cpu.wake_up()
        else:
            cpu.caching_allocator_delete(cpu.caching_allocator_alloc(4 * MiB))     # cached
            cpu.sleep(offload=False)
            cpu.caching_allocator_enable(False)
            cpu.wake_up()
        assert cpu.memory_allocated() == 0 and cpu.memory_reserved() == 0
    finally:
        cpu.caching_allocator_enable(True)


def test_the_history_follows_reserved_memory_through_a_sleep(awake_cpu):
    """A sleep's release and a wake's backing are recorded as segment_unmap
    and segment_map: a timeline rebuilt from the history (memory_viz, the
    report) showed the memory held all through the sleep."""
    cpu.empty_cache()
    start = cpu.memory_reserved()
    cpu._record_memory_history("all")
    try:
        blocks = [cpu.caching_allocator_alloc(n) for n in (1000, 25 * MiB)]
        awake = cpu.memory_reserved()
        cpu.sleep()
        asleep = cpu.memory_reserved()
        cpu.wake_up()
        for ptr in blocks:
            cpu.caching_allocator_delete(ptr)
        cpu.empty_cache()
        events = cpu._snapshot()["device_traces"][0]
    finally:
        cpu._record_memory_history(None)
    grows, shrinks = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
    total, seen = start, []
    for event in events:
        if event["action"] in grows + shrinks:
            total += event["size"] if event["action"] in grows else -event["size"]
            seen.append(total)
    assert asleep < awake
    assert asleep in seen and seen.count(awake) >= 2          # held, given back, held again
    assert total == cpu.memory_reserved()
