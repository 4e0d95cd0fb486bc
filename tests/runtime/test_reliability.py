"""Long runs, debug mode, fork, and exiting with live blocks."""
import ctypes
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import unimem
from unimem import _core
from unimem._runtime import devices as _devices
from unimem.backends._host import PageAlignedBackend

MiB = 1 << 20


def run_fresh(code, timeout=120, **env):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **env))
    for noise in ("Exception ignored", "Error in sys.excepthook", "Segmentation", "Traceback"):
        assert noise not in done.stderr, done.stderr
    return done


# ---------------------------------------------------------------------------
# the long run, short form (benchmarks/soak.py runs 10 million operations)
# ---------------------------------------------------------------------------
def test_soak_short_form_keeps_process_memory_flat():
    from benchmarks.soak import soak
    result = soak(300_000)
    assert result["rss_growth"] < 0.05, result
    assert result["reserved_after_empty_cache"] == 0


# ---------------------------------------------------------------------------
# debug mode
# ---------------------------------------------------------------------------
def write_after_free_site(a):
    return a.malloc(4096)          # the line reports must name


def test_debug_mode_reports_a_write_after_free_with_its_allocation_site():
    from unimem._observe.history import python_frames
    a = _core.CachingAllocator(PageAlignedBackend(), 0)
    a.enable_debug(python_frames)
    p = write_after_free_site(a)
    ctypes.memset(p, 1, 4096)          # using the memory is fine
    a.free(p)
    ctypes.memset(p + 100, 7, 3)       # writing after free is not
    with pytest.warns(unimem.WriteAfterFreeWarning) as caught:
        q = a.malloc(4096)
    assert q == p
    message = str(caught[0].message)
    assert f"{p + 100:#x}" in message and "offset 100" in message
    assert "write_after_free_site" in message and "test_reliability.py" in message
    assert a.debug_reports() == [message]


def test_debug_mode_is_quiet_when_memory_is_used_right():
    a = _core.CachingAllocator(PageAlignedBackend(), 0)
    a.enable_debug()
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # any report fails the test
        blocks = [a.malloc(n) for n in (1, 5000, 3 * MiB, 12 * MiB)]
        for p, n in zip(blocks, (1, 5000, 3 * MiB, 12 * MiB)):
            ctypes.memset(p, 0x55, n)
        for p in blocks:
            a.free(p)
        blocks = [a.malloc(n) for n in (12 * MiB, 1, 3 * MiB, 5000)]
    assert a.debug_reports() == []
    for p in blocks:
        a.free(p)


def test_debug_mode_is_off_by_default_and_only_where_the_host_can_read():
    assert not _core.CachingAllocator(PageAlignedBackend(), 0).debug
    done = run_fresh("""
        import unimem
        from unimem._runtime import devices as _devices
        from unimem.backends.simulated import SimulatedBackend
        p = unimem.cpu.caching_allocator_alloc(10)
        print(unimem.cpu.caching_allocator(0).debug,
              _devices.new_allocator(_devices.DEVICE_POOLS["cpu"], SimulatedBackend(), 0).debug)
    """, UNIMEM_DEBUG="1")
    assert done.stdout.split() == ["True", "False"]


def test_debug_mode_on_the_sycl_device_catches_a_write_through_a_stale_pointer():
    if not _devices.is_available("xpu"):
        pytest.fail(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
    done = run_fresh("""
        import ctypes, warnings
        import unimem, unimem.xpu as xpu
        x = xpu.empty(1024, dtype="u1")
        stale = x.get_array().usm_data._pointer
        del x
        ctypes.memset(stale + 10, 1, 1)          # the SYCL CPU device's memory is host memory
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = xpu.empty(1024, dtype="u1")
        print(y.get_array().usm_data._pointer == stale, len(caught),
              caught and caught[0].category.__name__)
    """, UNIMEM_DEBUG="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1", "WriteAfterFreeWarning"]


# ---------------------------------------------------------------------------
# fork, and exiting with live blocks
# ---------------------------------------------------------------------------
def test_after_fork_host_memory_works_and_devices_say_why_not():
    done = run_fresh("""
        import os, unimem
        from unimem._runtime import devices as _devices
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(1000))
        has_xpu = _devices.is_available("xpu")
        if has_xpu:
            import unimem.xpu as xpu
            keep = xpu.empty(100)
        pid = os.fork()
        if pid == 0:
            code = 0
            p = unimem.cpu.caching_allocator_alloc(5000)       # host memory: fine
            unimem.cpu.caching_allocator_delete(p)
            if has_xpu:
                try:
                    xpu.empty(100)
                    code = 3
                except RuntimeError as e:
                    code = 0 if "does not survive a fork" in str(e) and "spawn" in str(e) else 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "xpu" if has_xpu else "no-xpu")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["child", "0"]


def test_exiting_with_live_blocks_neither_crashes_nor_hangs():
    done = run_fresh("""
        import unimem
        from unimem._runtime import devices as _devices
        keep = [unimem.cpu.caching_allocator_alloc(n) for n in (1, 3 << 20, 40 << 20)]
        keep.append(unimem.host.caching_host_alloc(10_000))
        arrays = [unimem.cpu.empty((100, 100))]
        if _devices.is_available("xpu"):
            import unimem.xpu as xpu
            arrays += [xpu.ones((256, 256)), xpu.empty(10, usm_type="shared"), xpu.empty(10, usm_type="host")]
        unimem.accelerator._record_memory_history()
        print("exiting with", len(keep) + len(arrays), "live blocks")
    """, timeout=120)
    assert done.returncode == 0 and "exiting with" in done.stdout, done.stderr
