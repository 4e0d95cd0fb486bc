"""Expandable segments over the real host and XPU backends: the host grows
and shrinks real memory (measured with RSS); XPU refuses the option, saying
why, instead of ignoring it."""
import ctypes
import os
import subprocess
import sys

import pytest

from unimem import _core
from unimem._runtime import devices as _devices
from unimem.backends._host import PAGE_SIZE, PageAlignedBackend
from unimem.backends.xpu import VIRTUAL_MEMORY_UNAVAILABLE, XPUBackend

from tests.backends.test_host_virtual_memory import rss

MiB = 1 << 20


def test_the_core_grows_host_memory_in_place_and_gives_it_back():
    backend = PageAlignedBackend("CPU")
    allocator = _core.CachingAllocator(backend, 0, expandable_segments=True)
    allocator.set_capacity(8 << 30)
    start = rss()
    blocks = [allocator.malloc(16 * MiB) for _ in range(4)]
    assert len(backend.address_ranges.reserved()) == 1         # one range, grown in place
    assert blocks == [blocks[0] + i * 16 * MiB for i in range(4)]
    for i, b in enumerate(blocks):
        ctypes.memset(b, i + 1, 16 * MiB)
    grown = rss()
    assert grown - start >= 60 * MiB
    assert all(ctypes.string_at(b + 16 * MiB - 1, 1) == bytes([i + 1]) for i, b in enumerate(blocks))
    for b in blocks:
        allocator.free(b)
    allocator.empty_cache()
    assert backend.address_ranges.mapped_bytes() == 0
    assert grown - rss() >= 60 * MiB
    allocator.empty_virt_addr_cache()
    assert backend.address_ranges.reserved() == []


def run(code, conf):
    env = {**os.environ, "UNIMEM_ALLOC_CONF": conf}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_cpu_pool_takes_expandable_segments_from_the_environment():
    done = run("import unimem.cpu as c\n"
               "p = c.caching_allocator_alloc(5 << 20)\n"
               "s = c.memory_snapshot()\n"
               "print('expandable', [seg['is_expandable'] for seg in s])\n"
               "c.caching_allocator_delete(p)\n", "expandable_segments:True")
    assert done.returncode == 0, done.stderr
    assert "expandable [True]" in done.stdout


# ---------------------------------------------------------------------------
# XPU: no route to SYCL's virtual memory through dpctl
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def xpu_backend():
    if not _devices.is_available("xpu"):
        pytest.fail(f"no SYCL device: {_devices.unavailable_reason('xpu')} (the xpu extra installs one)")
    return XPUBackend("device")


def test_an_xpu_backend_says_why_it_has_no_virtual_memory(xpu_backend):
    assert "dpctl 0.22 offers no route" in VIRTUAL_MEMORY_UNAVAILABLE
    assert xpu_backend.virtual_memory_unavailable_reason(0) == VIRTUAL_MEMORY_UNAVAILABLE
    with pytest.raises(NotImplementedError, match="sycl_ext_oneapi_virtual_mem"):
        xpu_backend.virtual_memory_granularity(0)
    with pytest.raises(ValueError, match="does not exist"):
        xpu_backend.virtual_memory_granularity(len(xpu_backend.runtime.devices))
    with pytest.raises(TypeError):
        xpu_backend.virtual_memory_granularity("0")


@pytest.mark.parametrize("kind", ["device", "host"])
def test_the_core_refuses_expandable_segments_on_xpu_saying_why(xpu_backend, kind):
    with pytest.raises(NotImplementedError, match=r"expandable_segments:True.*dpctl 0\.22 offers no route"):
        _core.CachingAllocator(XPUBackend(kind), 0, expandable_segments=True)
    _core.CachingAllocator(XPUBackend(kind), 0)           # without the option: as before


def test_unimem_xpu_refuses_the_option_from_the_environment(xpu_backend):
    done = run("import unimem.xpu as x\n"
               "x.caching_allocator_alloc(1 << 20)\n", "expandable_segments:True")
    assert done.returncode != 0
    assert "NotImplementedError" in done.stderr and "dpctl 0.22 offers no route" in done.stderr, done.stderr
