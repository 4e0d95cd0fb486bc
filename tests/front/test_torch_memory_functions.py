"""PyTorch 2.13's memory functions that unimem added without a core change:
``mem_get_info`` on every backend, ``list_gpu_processes``, the
host statistics in ``unimem.cuda``/``unimem.xpu``, the pluggable allocators
(``change_current_allocator``, ``get_allocator_backend``,
``CUDAPluggableAllocator``, ``XPUPluggableAllocator``) and
``torch.accelerator``'s stream, device-index and capability functions.

CUDA runs on the simulated runtime (tests/helpers/fake_cuda.py); XPU on the
real SYCL device; a C allocator is compiled with the system's C compiler.
"""
import ctypes
import os
import sys
import types

import pytest

import unimem
import unimem.accelerator as acc
import unimem.cpu
import unimem.cuda
import unimem.host

from tests.helpers import fresh
from tests.helpers.c_library import build_shared_library
from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)
from tests.helpers.fake_nvml import fake_pynvml

ALLOCATOR_SOURCE = r"""
#include <stdlib.h>
#include <sys/types.h>
static void* last_stream_seen;
static int calls;
void* my_alloc(ssize_t size, int device, void* stream) { last_stream_seen = stream; calls++; return malloc(size); }
void* no_memory(ssize_t size, int device, void* stream) { calls++; return NULL; }
void my_free(void* ptr, size_t size, int device, void* stream) { last_stream_seen = stream; calls++; free(ptr); }
void* last_stream(void) { return last_stream_seen; }
int call_count(void) { return calls; }
"""


@pytest.fixture(scope="module")
def allocator_library(tmp_path_factory):
    """A shared library with PyTorch's pluggable allocator functions over malloc."""
    return build_shared_library(tmp_path_factory, "pluggable", ALLOCATOR_SOURCE)


def library_counters(path):
    library = ctypes.CDLL(path)
    library.last_stream.restype = ctypes.c_void_p
    return library


def run_fresh(code, **env):
    return fresh.run_fresh(code, **env).split()


# ---------------------------------------------------------------------------
# mem_get_info, by backend
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("namespace", [unimem.cpu, unimem.cuda, acc])
def test_mem_get_info_is_get_memory_info(namespace):
    assert namespace.mem_get_info == namespace.get_memory_info       # the same (bound) function


def test_mem_get_info_on_cpu_is_the_systems_memory():
    free, total = unimem.cpu.mem_get_info()
    assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < free <= total


def test_mem_get_info_on_cuda_is_cudaMemGetInfo(fake):
    p = unimem.cuda.caching_allocator_alloc(3 << 20, device=1)
    try:
        assert unimem.cuda.mem_get_info(1) == (fake.capacity - fake.used[1], fake.capacity)
        assert fake.used[1] == unimem.cuda.memory_reserved(1) > 0
    finally:
        unimem.cuda.caching_allocator_delete(p)


def test_mem_get_info_on_xpu_is_the_devices_global_memory(xpu):
    free, total = xpu.mem_get_info(0)
    assert total == xpu.default_queue(0).sycl_device.global_mem_size
    assert 0 < free <= total


# ---------------------------------------------------------------------------
# list_gpu_processes (NVML)
# ---------------------------------------------------------------------------
def test_list_gpu_processes_without_nvml_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)           # import pynvml fails
    assert unimem.cuda.list_gpu_processes() == "pynvml module not found, please install nvidia-ml-py"


def test_list_gpu_processes_prints_nvmls_processes_as_pytorch(monkeypatch, fake):
    process = types.SimpleNamespace(pid=4242, usedGpuMemory=3 << 20)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([process]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert unimem.cuda.list_gpu_processes(1) == "GPU:1\nprocess       4242 uses        3.000 MB GPU memory"
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([]))
    assert unimem.cuda.list_gpu_processes(0) == "GPU:0\nno processes are running"


def test_list_gpu_processes_maps_visible_devices_to_nvml_indices(monkeypatch, fake):
    nvml = fake_pynvml([])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert unimem.cuda.list_gpu_processes(0).splitlines()[0] == "GPU:3"
    assert nvml.handles == [3]


def test_list_gpu_processes_without_a_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(driver="not loaded"))
    assert unimem.cuda.list_gpu_processes() == "cuda driver can't be loaded, is cuda enabled?"


# ---------------------------------------------------------------------------
# host statistics: unimem.host's pinned pool, from every namespace
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["host_memory_stats", "host_memory_stats_as_nested_dict",
                                  "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats"])
def test_host_statistics_are_unimem_hosts(name, xpu):
    for namespace in (unimem.cuda, xpu, acc):
        assert getattr(namespace, name) is getattr(unimem.host, name)


# ---------------------------------------------------------------------------
# pluggable allocators
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("namespace", [unimem.cpu, unimem.cuda, acc])
def test_the_allocator_backend_is_native_by_default(namespace):
    assert namespace.get_allocator_backend() == "native"


def test_cuda_pluggable_allocator_serves_cache_misses_with_the_stream(fake, allocator_library):
    library = library_counters(allocator_library)
    calls_before = library.call_count()
    unimem.cuda.change_current_allocator(unimem.cuda.CUDAPluggableAllocator(allocator_library, "my_alloc", "my_free"))
    assert unimem.cuda.get_allocator_backend() == "pluggable"
    fake.set_stream(0x5000)
    try:
        pointers = [unimem.cuda.caching_allocator_alloc(1000) for _ in range(3)]
        assert library.call_count() - calls_before == 1              # one segment, the cache serves the rest
        assert library.last_stream() == 0x5000                       # the cudaStream_t of the request
        for pointer in pointers:
            unimem.cuda.caching_allocator_delete(pointer)
        assert unimem.cuda.memory_stats()["num_device_alloc"] == 1
        unimem.cuda.empty_cache()
        assert library.call_count() - calls_before == 2              # the segment went back through my_free
        with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
            unimem.cuda.change_current_allocator(
                unimem.cuda.CUDAPluggableAllocator(allocator_library, "my_alloc", "my_free"))
    finally:
        fake.set_stream(0)


def test_a_null_from_the_pluggable_allocator_is_out_of_memory(fake, allocator_library):
    unimem.cuda.change_current_allocator(unimem.cuda.CUDAPluggableAllocator(allocator_library, "no_memory", "my_free"))
    with pytest.raises(unimem.OutOfMemoryError):
        unimem.cuda.caching_allocator_alloc(1000)
    assert unimem.cuda.memory_stats()["num_ooms"] == 1


def test_pluggable_allocator_bad_input(allocator_library):
    with pytest.raises(ValueError, match="exports no function 'nowhere'"):
        unimem.cuda.CUDAPluggableAllocator(allocator_library, "nowhere", "my_free")
    # PyTorch's getattr on the ctypes library raises AttributeError: ported handlers catch it.
    for pluggable in (unimem.cuda.CUDAPluggableAllocator, unimem.xpu.XPUPluggableAllocator):
        with pytest.raises(AttributeError, match="exports no function 'nowhere'"):
            pluggable(allocator_library, "my_alloc", "nowhere")
    with pytest.raises(TypeError):
        unimem.cuda.CUDAPluggableAllocator(allocator_library, 7, "my_free")
    with pytest.raises(OSError):
        unimem.cuda.CUDAPluggableAllocator("/nonexistent/alloc.so", "my_alloc", "my_free")
    with pytest.raises(TypeError, match="expects an allocator"):
        unimem.cpu.change_current_allocator(lambda size: 0)


def test_xpu_pluggable_allocator_gets_the_sycl_queue(xpu, allocator_library):
    out = run_fresh(f"""
        import ctypes, unimem, unimem.xpu as xpu
        xpu.change_current_allocator(xpu.XPUPluggableAllocator({allocator_library!r}, "my_alloc", "my_free"))
        library = ctypes.CDLL({allocator_library!r})
        library.last_stream.restype = ctypes.c_void_p
        pointer = xpu.caching_allocator_alloc(1000)
        print(xpu.get_allocator_backend(), library.call_count(),
              library.last_stream() == xpu.default_queue(0).addressof_ref())
        xpu.caching_allocator_delete(pointer)
        xpu.empty_cache()
        free, total = xpu.mem_get_info(0)
        print(library.call_count(), total == xpu.default_queue(0).sycl_device.global_mem_size)
    """)
    assert out == ["pluggable", "1", "True", "2", "True"]


def test_a_named_pluggable_allocator_is_its_backend_name():
    out = run_fresh("""
        import unimem, unimem.cpu
        unimem.cpu.change_current_allocator(unimem.PluggableAllocator(lambda *a: 0, lambda *a: None, name="arena"))
        print(unimem.cpu.get_allocator_backend(), unimem.accelerator.get_allocator_backend())
    """, UNIMEM_DEVICE="cpu")
    assert out == ["arena", "arena"]


def test_any_allocator_change_current_allocator_installed_is_pluggable():
    """An allocator written to the Backend Protocol (only malloc and free),
    not a PluggableAllocator, left get_allocator_backend() at "native"."""
    out = run_fresh("""
        import ctypes, unimem, unimem.cpu
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        class MallocAndFree:
            def malloc(self, size, device, stream):
                return libc.malloc(size) or 0
            def free(self, ptr, size, device, stream):
                libc.free(ptr)
        print(unimem.cpu.get_allocator_backend())
        unimem.cpu.change_current_allocator(MallocAndFree())
        unimem.cpu.caching_allocator_delete(unimem.cpu.caching_allocator_alloc(100))
        print(unimem.cpu.get_allocator_backend(), unimem.accelerator.get_allocator_backend())
        try:
            unimem.cpu.mem_get_info()
        except NotImplementedError as exc:
            print("NotImplementedError")
    """, UNIMEM_DEVICE="cpu")
    assert out == ["native", "pluggable", "pluggable", "NotImplementedError"]


def test_a_pluggable_allocator_giving_two_devices_the_same_memory_is_refused():
    """Each device's allocator refused memory overlapping its own segments
    only: the same bytes handed to device 0 and device 1 were accepted, and a
    free by address then freed the other device's block."""
    out = run_fresh("""
        import ctypes, unimem, unimem.cpu as m
        buf = ctypes.create_string_buffer(8 << 20)
        base = (ctypes.addressof(buf) + 4095) & ~4095
        given = []
        def my_malloc(size, device, stream):
            return base + (1 << 20 if given.count(device) else 0)   # device 0 and 1: the same bytes
        def my_free(ptr, size, device, stream):
            given.append(("free", ptr))
        unimem.change_current_allocator(unimem.PluggableAllocator(my_malloc, my_free, device_count=2))
        p0 = m.caching_allocator_alloc(1000, 0)
        try:
            m.caching_allocator_alloc(1000, 1)
        except RuntimeError as exc:
            print("overlaps memory it handed out before" in str(exc))
        print(m.memory_allocated(0) == 1024, m.memory_allocated(1) == m.memory_reserved(1) == 0)
        m.caching_allocator_delete(p0)
        m.empty_cache()
        print(given == [("free", base)])
        print(m.caching_allocator_alloc(1000, 1) == base)        # given back: it may come again
    """, UNIMEM_DEVICE="cpu")
    assert out == ["True"] * 5


# ---------------------------------------------------------------------------
# torch.accelerator: streams, device indices, capability
# ---------------------------------------------------------------------------
def test_device_idx_names_are_the_device_index_functions():
    assert acc.current_device_idx is acc.current_device_index
    assert acc.set_device_idx is acc.set_device_index


# The current accelerator is decided once per process (and what it decided is
# cached on the way to the pools): each kind is tried in a fresh interpreter.
def test_cuda_streams_are_cupys():
    out = run_fresh("""
        import cupy, unimem, unimem.accelerator as acc
        from unimem._runtime import devices
        from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda
        current = {}

        class Stream:                      # CuPy makes no stream without a GPU: one standing in
            def __init__(self, device_id, ptr):
                self.device_id, self.ptr = device_id, ptr

            def use(self):
                current[fake.getDevice()] = self
                fake.set_stream(self.ptr)

        cupy.cuda.get_current_stream = lambda device_id=None: current.get(device_id, Stream(device_id, 0))
        with serving_cuda(FakeCudaRuntime(devices=2)) as fake:
            devices._current = "cuda"
            stream = Stream(1, 0x7000)
            acc.set_stream(stream)
            print(acc.current_device_index(), acc.current_stream() is stream, acc.current_stream(0).ptr)
            pointer = acc.caching_allocator_alloc(512)
            print(acc.memory_snapshot()[0]["stream"] == 0x7000)      # the pool keys the block by that stream
            acc.caching_allocator_delete(pointer)
            try:
                acc.set_stream(0x7000)
            except TypeError as error:
                print(type(error).__name__, "expected a CuPy stream" in str(error))
    """)
    assert out == ["1", "True", "0", "True", "TypeError", "True"]


def test_xpu_current_stream_is_the_default_queue_and_set_stream_says_why_not(xpu):
    out = run_fresh("""
        import unimem.accelerator as acc, unimem.xpu as xpu
        print(acc.current_stream() is xpu.default_queue(0), acc.current_stream("xpu:0") is xpu.default_queue(0))
        try:
            acc.set_stream(xpu.default_queue(0))
        except NotImplementedError as error:
            print("no current stream to set" in str(error))
    """, UNIMEM_DEVICE="xpu")
    assert out == ["True", "True", "True"]


def test_cpu_has_no_streams():
    out = run_fresh("""
        import unimem.accelerator as acc
        print(acc.current_stream())
        try:
            acc.set_stream(None)
        except NotImplementedError as error:
            print("the host has no streams" in str(error))
    """, UNIMEM_DEVICE="cpu")
    assert out == ["None", "True"]


CAPABILITY = """
    import unimem.accelerator as acc
    print(" ".join(sorted(str(t) for t in acc.get_device_capability(0)["supported_dtypes"])))
"""


def test_device_capability_lists_numpy_dtypes(xpu):
    on_cpu = run_fresh(CAPABILITY, UNIMEM_DEVICE="cpu")
    assert {"bool", "float16", "float32", "float64", "complex128", "int64", "uint8"} <= set(on_cpu)
    sycl_device = xpu.default_queue(0).sycl_device
    on_xpu = run_fresh(CAPABILITY, UNIMEM_DEVICE="xpu")
    assert ("float64" in on_xpu) == sycl_device.has_aspect_fp64
    assert ("float16" in on_xpu) == sycl_device.has_aspect_fp16
    assert "float32" in on_xpu
