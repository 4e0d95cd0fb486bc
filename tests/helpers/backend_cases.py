"""Every backend unimem ships, as the backend conformance suite
(tests/backends/test_conformance.py) takes them: how to make one, and what
it promises beyond the :class:`~unimem.backends.base.Backend` protocol.

A :class:`BackendCase` says what a test cannot read off the backend itself:
the alignment of what ``malloc`` returns (the protocol names none; each
runtime promises its own), whether its addresses are memory this process may
touch (a simulated runtime hands out numbers), the error a bad ``free`` or a
misused virtual memory call is documented to raise, how to queue work on a
stream that an event must then wait for, and how many bytes the backend
still holds (to see that each free gave memory back). The runtimes that may
be absent here (SYCL, a GPU, a C compiler) skip their cases, saying why.
"""
import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import pytest

from unimem.backends._host import PAGE_SIZE, PageAlignedBackend
from unimem.backends.cuda import CUDABackend, CUDAPinnedBackend, OnDevice
from unimem.backends.faults import FaultInjectingBackend
from unimem.backends.pluggable import PluggableAllocator
from unimem.backends.shared_library import SharedLibraryAllocator
from unimem.backends.simulated import SimulatedBackend, SimulatedGPU

from .c_library import build_shared_library
from .fake_cuda import FakeCudaDriver, FakeCudaRuntime
from .gpu import cuda_gpu_available

MiB = 1 << 20
#: The capacity of the simulated devices: small, so that "more than the
#: device holds" is cheap to ask for.
CAPACITY = 256 * MiB
#: What no device here can give: more than the 48-bit address space of x86-64.
IMPOSSIBLE_SIZE = 1 << 60


@dataclass
class BackendCase:
    """One backend of the suite, and what it promises.

    ``make(request)`` returns the backend (``request`` for fixtures it
    needs); ``alignment``: every address malloc returns is a multiple of it,
    the runtime's promise (``why_aligned`` says whose); ``real_memory``: the
    addresses are memory of this process, which a test may write where the
    backend says ``host_accessible``; ``bad_free_error``: what a free of an
    address or size malloc did not hand out raises, where the backend
    documents it (None: undefined, as for the drivers, not tested);
    ``misuse_error``: what a misused virtual memory call raises;
    ``queue_work(backend, stream, device)``: queue work on ``stream`` that
    stays pending until the stream is synchronized (None: no way to hold a
    real device's stream busy); ``held(backend)``: bytes the device holds
    for the backend (None: not known); ``bounded``: its capacity is small and
    known, so mapping past it may be tried; ``live_events(backend)``: events
    the runtime holds (each one's life must end); ``bad_stream``: a handle
    ``check_stream`` must refuse; ``new_stream(backend)``: a handle of a
    second stream of device 0."""

    id: str
    make: Callable[[Any], Any]
    alignment: int
    why_aligned: str
    real_memory: bool
    bad_free_error: Optional[type] = None
    misuse_error: Optional[type] = None
    queue_work: Optional[Callable[[Any, int, int], None]] = None
    held: Optional[Callable[[Any], int]] = None
    bounded: bool = False
    live_events: Optional[Callable[[Any], int]] = None
    bad_stream: Optional[int] = None
    new_stream: Callable[[Any], int] = lambda backend: 0x5000
    marks: List[Any] = field(default_factory=list)

    def param(self) -> Any:
        return pytest.param(self, id=self.id, marks=self.marks)


# ---------------------------------------------------------------------------
# how each backend is made
# ---------------------------------------------------------------------------
_libc = ctypes.CDLL(None)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class HostCallables:
    """What a user hands ``PluggableAllocator``: malloc and free of host
    memory (``posix_memalign`` by 512 bytes, as PyTorch's allocators align),
    counting the bytes out."""

    ALIGNMENT = 512

    def __init__(self):
        self.sizes = {}

    def malloc(self, size, device, stream):
        out = ctypes.c_void_p()
        if _libc.posix_memalign(ctypes.byref(out), self.ALIGNMENT, size) != 0:
            return 0                                    # ENOMEM: the device is full
        self.sizes[out.value] = size                    # one dict item: atomic under the GIL
        return out.value

    def free(self, ptr, size, device, stream):
        if self.sizes.pop(ptr) != size:
            raise AssertionError(f"free({ptr:#x}, {size}) of a block allocated with another size")
        _libc.free(ptr)

    def held(self):
        return sum(self.sizes.values())


def make_pluggable(request):
    from unimem.backends._host import _meminfo
    user = HostCallables()
    backend = PluggableAllocator(user.malloc, user.free, memory_info_fn=lambda device: _meminfo())
    backend.user = user
    return backend


ALLOCATOR_LIBRARY = r"""
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/types.h>
static atomic_llong held;
void* conformance_alloc(ssize_t size, int device, void* stream) {
    void* p = malloc(size);
    if (p) atomic_fetch_add(&held, size);
    return p;
}
void conformance_free(void* ptr, size_t size, int device, void* stream) {
    atomic_fetch_sub(&held, size);
    free(ptr);
}
long long conformance_held(void) { return atomic_load(&held); }
"""


@pytest.fixture(scope="session")
def allocator_library(tmp_path_factory):
    """A shared library of PyTorch's pluggable allocator functions over
    ``malloc``, built with the system's C compiler."""
    return build_shared_library(tmp_path_factory, "conformance_allocator", ALLOCATOR_LIBRARY)


def make_shared_library(request):
    path = request.getfixturevalue("allocator_library")
    backend = SharedLibraryAllocator(path, "conformance_alloc", "conformance_free")
    backend.library.conformance_held.restype = ctypes.c_longlong
    return backend


def make_fake_cuda(request):
    runtime = FakeCudaRuntime(devices=2, capacity=CAPACITY, host_capacity=CAPACITY)
    FakeCudaDriver(runtime)              # virtual memory through the simulated driver
    return CUDABackend(runtime)


def queue_cuda_work(backend, stream, device):
    with OnDevice(backend.runtime, device):
        backend.runtime.launch(stream)


def make_xpu(kind):
    def make(request):
        from unimem._runtime import devices
        if not devices.is_available("xpu"):
            pytest.skip(f"no SYCL device: {devices.unavailable_reason('xpu')}")
        from unimem.backends.xpu import XPUBackend
        return XPUBackend(kind)
    return make


def new_xpu_stream(backend):
    """A handle of a new queue of device 0 (the backend keeps the queue)."""
    import dpctl
    queue = dpctl.SyclQueue(backend.sycl_device(0))
    backend.conformance_queues = getattr(backend, "conformance_queues", []) + [queue]
    return backend.runtime.stream_handle(queue)


def make_gpu(pinned):
    def make(request):
        return CUDAPinnedBackend() if pinned else CUDABackend()
    return make


needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not cuda_gpu_available(), reason="needs an NVIDIA GPU")]

XPU_CASE = dict(alignment=512, real_memory=True, bad_stream=1 << 19,
                why_aligned="aligned_alloc_* by 512, as PyTorch's XPU allocator (kDeviceAlignment)",
                held=lambda backend: backend.raw.held(0), new_stream=new_xpu_stream)

CASES = [
    BackendCase("host", lambda request: PageAlignedBackend("CPU"), alignment=PAGE_SIZE,
                why_aligned="mmap: the host page", real_memory=True, bad_free_error=ValueError,
                misuse_error=ValueError),
    BackendCase("simulated", lambda request: SimulatedBackend(capacity=CAPACITY, devices=2), alignment=512,
                why_aligned="its alignment argument (512 by default)", real_memory=False,
                bad_free_error=RuntimeError, misuse_error=RuntimeError,
                queue_work=lambda backend, stream, device: None,     # every recorded event waits
                held=lambda backend: backend.held(0), bounded=True),
    BackendCase("simulated-gpu", lambda request: SimulatedGPU(capacity=CAPACITY), alignment=512,
                why_aligned="its alignment argument (512 by default)", real_memory=False,
                bad_free_error=RuntimeError, misuse_error=RuntimeError,
                queue_work=lambda backend, stream, device: backend.launch(stream, 0, 1, device),
                held=lambda backend: backend.held(0), bounded=True),
    BackendCase("faults-over-simulated-gpu",
                lambda request: FaultInjectingBackend(SimulatedGPU(capacity=CAPACITY)), alignment=512,
                why_aligned="the inner backend's", real_memory=False,
                bad_free_error=RuntimeError, misuse_error=RuntimeError,
                queue_work=lambda backend, stream, device: backend.inner.launch(stream, 0, 1, device),
                held=lambda backend: backend.inner.held(0), bounded=True),
    BackendCase("pluggable", make_pluggable, alignment=HostCallables.ALIGNMENT,
                why_aligned="the user's malloc_fn (posix_memalign by 512 here)", real_memory=True,
                held=lambda backend: backend.user.held()),
    BackendCase("shared-library", make_shared_library, alignment=16,
                why_aligned="the library's alloc (glibc malloc here: 16)", real_memory=True,
                held=lambda backend: backend.library.conformance_held()),
    BackendCase("cuda-simulated", make_fake_cuda, alignment=256,
                why_aligned="cudaMalloc: at least 256 bytes (CUDA programming guide)", real_memory=False,
                misuse_error=ValueError, queue_work=queue_cuda_work,
                held=lambda backend: backend.runtime.used[0], bounded=True,
                live_events=lambda backend: backend.runtime.events_alive()),
    BackendCase("cuda-pinned-simulated", lambda request: make_fake_cuda(request).pinned_host_backend(),
                alignment=256, why_aligned="cudaHostAlloc: held to cudaMalloc's 256 (CUDA documents none)",
                real_memory=False, held=lambda backend: sum(backend.runtime.pinned.values())),
    BackendCase("xpu-device", make_xpu("device"), **XPU_CASE),
    BackendCase("xpu-shared", make_xpu("shared"), **XPU_CASE),
    BackendCase("xpu-host", make_xpu("host"), **XPU_CASE),
    BackendCase("cuda-gpu", make_gpu(pinned=False), alignment=256,
                why_aligned="cudaMalloc: at least 256 bytes", real_memory=True, misuse_error=ValueError,
                marks=needs_gpu),
    BackendCase("cuda-gpu-pinned", make_gpu(pinned=True), alignment=256,
                why_aligned="cudaHostAlloc: held to cudaMalloc's 256", real_memory=True, marks=needs_gpu),
]
