"""unimem's C ABI (``unimem.capi``, ``unimem.h``) on the cpu pool: a C library
built with the system's ``cc`` against the header and linked to unimem's
library, whose pthreads allocate and free while Python holds the GIL, and the
ABI's checks and errors. (Its CUDA and XPU entries: test_capi_cuda.py,
test_capi_xpu.py.)"""
import ctypes
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

import unimem
import unimem.capi
from unimem._runtime import devices as _devices

from tests.helpers import REPO_ROOT
from tests.helpers.capi import (CPU, CUDA, THREADS_SOURCE, XPU, bind_threads, build_c_user, last_error,
                                library)
from tests.helpers.clients import client_of

MiB = 1 << 20
PAIRS = 100_000


@pytest.fixture(scope="module")
def lib():
    return library()


@pytest.fixture(scope="module")
def c_user_path(tmp_path_factory):
    return build_c_user(THREADS_SOURCE, tmp_path_factory.mktemp("capi"))


@pytest.fixture(scope="module")
def c_user(c_user_path):
    """capi_threads.c, called with the GIL let go (ctypes.CDLL)."""
    return bind_threads(ctypes.CDLL(c_user_path))


@pytest.fixture(scope="module")
def c_user_holding_gil(c_user_path):
    """The same library called with the GIL held for the whole call (ctypes.PyDLL)."""
    return bind_threads(ctypes.PyDLL(c_user_path))


def cpu_stats():
    return unimem.cpu.memory_stats(0)


def cache_blocks(size, count):
    """Leave ``count`` blocks of ``size`` bytes cached in the cpu pool (and
    the pool itself made), so that that many threads holding one each hit."""
    allocator = unimem.cpu.caching_allocator(0)
    live = [allocator.malloc(size) for _ in range(count)]
    for ptr in live:
        allocator.free(ptr)


# ---------------------------------------------------------------------------
# the library, the header and their version
# ---------------------------------------------------------------------------
def test_the_header_the_library_and_python_agree_on_the_abi_version(lib, c_user):
    header = os.path.join(unimem.capi.get_include(), "unimem.h")
    with open(header) as f:
        declared = int(re.search(r"#define UNIMEM_ABI_VERSION (\d+)", f.read()).group(1))
    assert declared == unimem.capi.ABI_VERSION == lib.unimem_abi_version() >= 1
    assert c_user.header_abi_version() == c_user.library_abi_version() == declared


def test_the_library_is_unimems_extension_module():
    import unimem._integrations.capi
    assert unimem.capi.library_path() == os.path.abspath(unimem._integrations.capi.__file__)
    assert os.path.isfile(unimem.capi.library_path())
    assert unimem.capi.get_include() == os.path.join(os.path.dirname(os.path.abspath(unimem.__file__)), "include")


def test_the_functions_before_unimem_is_imported_say_so():
    """Loaded by path in a process that never imported unimem: NULL (and -1)
    with the reason, no crash; once unimem is imported, the same handle works."""
    code = textwrap.dedent(f"""
        import ctypes, sys
        lib = ctypes.CDLL({unimem.capi.library_path()!r})
        lib.unimem_cpu_malloc.restype = ctypes.c_void_p
        lib.unimem_cpu_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.unimem_cpu_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.unimem_memory_allocated.restype = ctypes.c_int64
        lib.unimem_last_error.restype = ctypes.c_char_p
        assert "unimem" not in sys.modules
        assert lib.unimem_cpu_malloc(64, 0, None) is None
        print(lib.unimem_last_error().decode())
        assert lib.unimem_memory_allocated(0, 0) == -1 and lib.unimem_empty_cache(0) == -1
        lib.unimem_cpu_free(ctypes.c_void_p(4096), 64, 0, None)      # ignored
        assert lib.unimem_abi_version() >= 1
        sys.path.insert(0, {str(REPO_ROOT)!r})
        import unimem
        ptr = lib.unimem_cpu_malloc(64, 0, None)
        assert ptr and unimem.cpu.memory_allocated(0) == 512
        lib.unimem_cpu_free(ptr, 64, 0, None)
        assert unimem.cpu.memory_allocated(0) == 0
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd="/", env=dict(os.environ, PYTHONPATH=""))
    assert done.returncode == 0, done.stdout + done.stderr
    first, last = done.stdout.strip().splitlines()
    assert "import unimem" in first and "not set up" in first
    assert last == "ok"


# ---------------------------------------------------------------------------
# C threads on the cpu pool
# ---------------------------------------------------------------------------
def test_c_threads_allocate_while_the_caller_holds_the_gil(lib, c_user_holding_gil, c_user):
    """A cache hit and a free take no GIL: the caller holds it for the whole
    call (ctypes.PyDLL) while two pthreads do 100,000 pairs each. A hit that
    needed the GIL would wait for it until the time runs out."""
    size = 4096
    cache_blocks(size, 2)
    lib.unimem_cpu_free(lib.unimem_cpu_malloc(size, 0, None), size, 0, None)   # the C table knows the pool
    before = cpu_stats()
    assert c_user_holding_gil.start(2, PAIRS, size) == 0
    timed_out = c_user_holding_gil.wait_for(120_000)     # the GIL held all along
    if timed_out:
        c_user.wait_for(600_000)                         # let them finish, the GIL let go
    assert not timed_out, "C threads waited for the GIL on a cache hit"
    assert c_user_holding_gil.failures() == 0 and c_user_holding_gil.corruptions() == 0
    after = cpu_stats()
    assert after["allocation.all.allocated"] - before["allocation.all.allocated"] == 2 * PAIRS
    assert after["allocation.all.freed"] - before["allocation.all.freed"] == 2 * PAIRS
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["num_device_alloc"] == before["num_device_alloc"]          # every request a hit


def test_c_threads_and_a_busy_python_thread(c_user):
    """Two pthreads of 100,000 pairs each (GIL let go by ctypes) while a
    Python thread keeps the GIL busy; the counts are unimem.cpu's."""
    size = 65536
    cache_blocks(size, 2)
    before = cpu_stats()
    stop = threading.Event()
    spins = [0]

    def spin():
        while not stop.is_set():
            spins[0] += 1
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        assert c_user.run(2, PAIRS, size) == 0
    finally:
        stop.set()
        spinner.join()
    assert spins[0] > 0
    assert c_user.failures() == 0 and c_user.corruptions() == 0
    after = cpu_stats()
    assert after["allocation.all.allocated"] - before["allocation.all.allocated"] == 2 * PAIRS
    assert after["requested_bytes.all.allocated"] - before["requested_bytes.all.allocated"] == 2 * PAIRS * size
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["num_device_alloc"] == before["num_device_alloc"]


def test_a_miss_on_c_threads_with_a_c_backend_takes_no_gil(c_user_holding_gil, c_user, lib):
    """The cpu pool's backend is a C provider (host memory through the
    provider ABI): a size never cached makes each thread's first request
    miss and ask it for a segment, still with the caller holding the GIL."""
    size = 23 * MiB + 4096
    allocator = unimem.cpu.caching_allocator(0)
    allocator.empty_cache()
    lib.unimem_cpu_free(lib.unimem_cpu_malloc(64, 0, None), 64, 0, None)       # the C table knows the pool
    before = cpu_stats()
    assert c_user_holding_gil.start(2, 200, size) == 0
    timed_out = c_user_holding_gil.wait_for(120_000)
    if timed_out:
        c_user.wait_for(600_000)
    assert not timed_out, "a miss served by a C provider waited for the GIL"
    assert c_user_holding_gil.failures() == 0 and c_user_holding_gil.corruptions() == 0
    after = cpu_stats()
    assert after["num_device_alloc"] > before["num_device_alloc"]
    assert after["allocation.all.allocated"] - before["allocation.all.allocated"] == 400
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    allocator._check_invariants()
    allocator.empty_cache()


class PythonHostBackend:
    """Host memory through Python methods only (no provider ABI), counting its calls."""

    name = "CPU"

    def __init__(self):
        from unimem.backends._host import PageAlignedBackend
        self.inner = PageAlignedBackend("CPU")
        self.mallocs = 0

    def device_count(self):
        return 1

    def malloc(self, size, device, stream):
        self.mallocs += 1
        return self.inner.malloc(size, device, stream)

    def free(self, ptr, size, device, stream):
        self.inner.free(ptr, size, device, stream)


@pytest.fixture
def python_backed_cpu():
    """The cpu device type served by a backend written in Python."""
    backend = PythonHostBackend()
    previous = _devices.get_type("cpu")
    swapped = _devices.DeviceType("cpu", backend)
    _devices.install_type("cpu", swapped)
    yield backend, swapped.allocator(0)
    _devices.install_type("cpu", previous)


def test_a_miss_with_a_python_backend_takes_the_gil_itself(python_backed_cpu, c_user, c_user_holding_gil, lib):
    """Misses from C threads while a Python thread spins: the threads take
    the GIL for the backend's Python. While the caller holds the GIL for
    good, they cannot (and wait for it: no crash, no wrong answer)."""
    backend, allocator = python_backed_cpu
    lib.unimem_cpu_free(lib.unimem_cpu_malloc(64, 0, None), 64, 0, None)    # the C table knows the pool
    size = 23 * MiB + 4096
    before = allocator.memory_stats()["allocation.all.allocated"]
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    spinner.start()
    try:
        assert c_user.run(2, 200, size) == 0
    finally:
        stop.set()
        spinner.join()
    assert c_user.failures() == 0 and c_user.corruptions() == 0
    assert backend.mallocs >= 2
    assert allocator.memory_stats()["allocation.all.allocated"] - before == 400
    allocator.empty_cache()
    made = backend.mallocs
    assert c_user_holding_gil.start(2, 10, size) == 0
    assert c_user_holding_gil.wait_for(1000) == 1          # the GIL held: the misses wait for it
    assert c_user.wait_for(600_000) == 0                   # the GIL let go: they finish
    assert c_user.failures() == 0 and backend.mallocs > made
    allocator._check_invariants()


def test_a_miss_past_a_limit_goes_the_whole_way(lib):
    """A miss the GIL-free path does not serve (past a memory limit): the
    GIL path's answer, here out of memory with PyTorch's text."""
    allocator = unimem.cpu.caching_allocator(0)
    allocator.set_memory_limit(64 * MiB)
    try:
        assert lib.unimem_cpu_malloc(100 * MiB, 0, None) is None
        assert last_error(lib).startswith("OutOfMemoryError: CPU out of memory")
        ptr = lib.unimem_cpu_malloc(30 * MiB, 0, None)
        assert ptr and allocator.owns(ptr)
        lib.unimem_cpu_free(ptr, 30 * MiB, 0, None)
    finally:
        allocator.set_memory_limit(0)
        allocator.empty_cache()
    allocator._check_invariants()


# ---------------------------------------------------------------------------
# the entries from Python (ctypes lets the GIL go)
# ---------------------------------------------------------------------------
def test_a_block_from_c_is_the_pools(lib):
    ptr = lib.unimem_cpu_malloc(1000, 0, None)
    try:
        assert unimem.cpu.caching_allocator(0).owns(ptr)
        assert lib.unimem_memory_allocated(CPU, 0) == unimem.cpu.memory_allocated(0) >= 1024
        assert lib.unimem_memory_reserved(CPU, 0) == unimem.cpu.memory_reserved(0) > 0
        ctypes.memset(ptr, 7, 1000)                         # host memory: writable
    finally:
        lib.unimem_cpu_free(ptr, 1000, 0, None)
    assert not unimem.cpu.caching_allocator(0).owns(ptr)
    assert lib.unimem_cpu_malloc(0, 0, None) is None        # size 0: no block, no error
    lib.unimem_cpu_free(None, 0, 0, None)                   # NULL: ignored


C_CLIENT_SOURCE = textwrap.dedent("""
    #include <unimem.h>
    void* c_block(size_t size) { return unimem_cpu_malloc(size, 0, NULL); }
    void c_free(void* ptr, size_t size) { unimem_cpu_free(ptr, size, 0, NULL); }
    /* PyTorch's pairs, declared by the header and exported by the library */
    void* (*const torch_cuda_malloc)(ssize_t, int, void*) = unimem_torch_cuda_malloc;
    void (*const torch_cuda_free)(void*, ssize_t, int, void*) = unimem_torch_cuda_free;
    void* (*const torch_xpu_malloc)(size_t, int, void*) = unimem_torch_xpu_malloc;
    void (*const torch_xpu_free)(void*, size_t, int, void*) = unimem_torch_xpu_free;
""")


def test_c_codes_blocks_are_cs(lib, tmp_path):
    """A block C code built against unimem.h allocates says "c" (PyTorch's
    pluggable allocator has functions of its own, whose blocks say "torch")."""
    source = tmp_path / "c_client.c"
    source.write_text(C_CLIENT_SOURCE)
    user = ctypes.CDLL(build_c_user(str(source), tmp_path))
    user.c_block.restype, user.c_block.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    user.c_free.restype, user.c_free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t]
    allocator = unimem.cpu.caching_allocator(0)
    ptr = user.c_block(1000)
    try:
        assert client_of(allocator, ptr) == "c"
        assert unimem.cpu.memory_allocated_by_client(0).get("c", 0) >= 1024
    finally:
        user.c_free(ptr, 1000)
    for name in ("torch_cuda_malloc", "torch_cuda_free", "torch_xpu_malloc", "torch_xpu_free"):
        exported = ctypes.cast(getattr(lib, f"unimem_{name}"), ctypes.c_void_p).value
        assert ctypes.c_void_p.in_dll(user, name).value == exported, name


def test_streams_key_cpu_blocks_as_from_python(lib):
    allocator = unimem.cpu.caching_allocator(0)
    ptr = lib.unimem_cpu_malloc(4096, 0, ctypes.c_void_p(0x5000))
    try:
        assert allocator.live_allocations()[ptr][2] == 0x5000
    finally:
        lib.unimem_cpu_free(ptr, 4096, 0, ctypes.c_void_p(0x5000))
    again = lib.unimem_cpu_malloc(4096, 0, ctypes.c_void_p(0x5000))
    other = lib.unimem_cpu_malloc(4096, 0, None)
    assert again == ptr and other != ptr                    # reused on its stream only
    for p, stream in ((again, 0x5000), (other, None)):
        lib.unimem_cpu_free(p, 4096, 0, stream)


def test_empty_cache_from_c(lib):
    ptr = lib.unimem_cpu_malloc(40 * MiB, 0, None)
    lib.unimem_cpu_free(ptr, 40 * MiB, 0, None)
    assert unimem.cpu.memory_reserved(0) >= 40 * MiB
    assert lib.unimem_empty_cache(CPU) == 0
    assert lib.unimem_memory_reserved(CPU, 0) == unimem.cpu.memory_reserved(0) < 40 * MiB


def test_out_of_memory_is_null_with_the_reason(lib):
    before = cpu_stats().get("num_ooms", 0)
    assert lib.unimem_cpu_malloc(1 << 62, 0, None) is None
    assert last_error(lib).startswith("OutOfMemoryError: CPU out of memory")
    assert cpu_stats()["num_ooms"] == before + 1


def test_bad_arguments_are_null_or_minus_one_with_the_reason(lib):
    assert lib.unimem_cpu_malloc(64, 7, None) is None
    assert last_error(lib) == "InvalidDeviceError: device index 7 is out of range: cpu has 1 device"
    assert lib.unimem_cpu_malloc(64, -1, None) is None
    assert "InvalidDeviceError" in last_error(lib)
    assert lib.unimem_memory_allocated(9, 0) == -1 and "unknown unimem_device_type" in last_error(lib)
    assert lib.unimem_empty_cache(-1) == -1 and "unknown unimem_device_type" in last_error(lib)
    assert lib.unimem_memory_allocated(CPU, 3) == -1 and "InvalidDeviceError" in last_error(lib)
    assert lib.unimem_cuda_malloc(-5, 0, None) is None and last_error(lib) == "ValueError: a negative size"


def test_the_error_text_is_per_thread(lib):
    assert lib.unimem_cpu_malloc(64, 5, None) is None
    seen = []
    worker = threading.Thread(target=lambda: seen.append(last_error(lib)))
    worker.start()
    worker.join()
    assert seen == [""] and "device index 5" in last_error(lib)


def test_a_device_type_without_devices_says_why(lib):
    for device_type, name in ((CUDA, "cuda"), (XPU, "xpu")):
        if _devices.is_available(name):
            continue
        assert lib.unimem_memory_allocated(device_type, 0) == -1
        assert f"no {name} device is available" in last_error(lib)


def test_a_replaced_cpu_type_is_followed(lib):
    """install_type (change_current_allocator's way) replaces the cpu pools:
    the C tables forget the old allocator, and the next request goes to the new."""
    from unimem.backends._host import PageAlignedBackend
    first = lib.unimem_cpu_malloc(64, 0, None)              # the old allocator is in the C table
    previous = _devices.get_type("cpu")
    swapped = _devices.DeviceType("cpu", PageAlignedBackend("CPU"))
    _devices.install_type("cpu", swapped)
    try:
        ptr = lib.unimem_cpu_malloc(64, 0, None)
        assert swapped.allocator(0).owns(ptr) and not previous.allocator(0).owns(ptr)
        lib.unimem_cpu_free(ptr, 64, 0, None)
        assert not swapped.allocator(0).owns(ptr)
    finally:
        _devices.install_type("cpu", previous)
    assert previous.allocator(0).owns(first)
    lib.unimem_cpu_free(first, 64, 0, None)
    assert not previous.allocator(0).owns(first)
