"""NVIDIA GPU memory through CuPy's CUDA runtime bindings.

``cudaMalloc`` / ``cudaFree`` per device (made current as CuPy does, and put
back after), ``cudaMemGetInfo`` for memory info, CUDA events (recorded on the
streams a block was used on) for stream-ordered reuse, and ``cudaHostAlloc``
for the pinned host pool. CuPy's wheels ship no ``.pxd`` for the runtime, so
these are Python calls; the caching core makes them only on a cache miss.

The runtime is a parameter (``CUDABackend(runtime=...)``): CuPy's
``cupy_backends.cuda.api.runtime`` by default, a stand-in in tests on
machines without a GPU.

Expandable segments map device memory into reserved address space through
the driver's virtual memory management, which CuPy does not expose:
:mod:`unimem.backends.cuda_vmm` drives it through NVIDIA's ``cuda-bindings``
(the driver is a parameter too, ``CUDABackend(driver=...)``).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from .address_ranges import as_int
from .base import Backend
from .cuda_vmm import CudaVMM, load_driver

CUDA_ERROR_MEMORY_ALLOCATION = 2          # cudaErrorMemoryAllocation
CUDA_ERROR_INSUFFICIENT_DRIVER = 35       # cudaErrorInsufficientDriver
CUDA_ERROR_NO_DEVICE = 100                # cudaErrorNoDevice
CUDA_MEMCPY_HOST_TO_DEVICE = 1            # cudaMemcpyHostToDevice
CUDA_MEMCPY_DEVICE_TO_HOST = 2            # cudaMemcpyDeviceToHost
#: Why an allocator without expandable segments cannot sleep on a GPU.
PAGE_RELEASE_UNAVAILABLE = (
    "memory from cudaMalloc cannot be given back while its addresses stay reserved (cudaFree gives "
    "both back); set expandable_segments:True in UNIMEM_ALLOC_CONF: its segments are mapped through "
    "the driver's virtual memory, which can")
CUDA_SUCCESS = 0
CUDA_STREAM_LEGACY = 1                    # cudaStreamLegacy: the legacy default stream, from any thread
CUDA_STREAM_PER_THREAD = 2                # cudaStreamPerThread: the calling thread's default stream

# Per-thread stream keys live above this address: it is non-canonical on every
# 64-bit CPU CUDA runs on, so no cudaStream_t (a pointer, or 0, 1, 2) is there.
PER_THREAD_KEY_BASE = 0xFFFF_0000_0000_0000
_per_thread_keys = itertools.count(PER_THREAD_KEY_BASE + 1)   # next() is atomic under the GIL
_this_thread = threading.local()


def _default_runtime() -> Any:
    from cupy_backends.cuda.api import runtime
    return runtime


def unusable_reason(error: BaseException, runtime: Any) -> str:
    """Why CUDA cannot be used here, from the error ``runtime`` raised when
    asked for its devices. CUDA says ``cudaErrorInsufficientDriver`` ("CUDA
    driver version is insufficient for CUDA runtime version") both where no
    NVIDIA driver is installed and where it is older than the runtime:
    ``cudaDriverGetVersion`` tells the two apart (0 when there is no driver)."""
    status = getattr(error, "status", None)
    if status == CUDA_ERROR_INSUFFICIENT_DRIVER:
        driver = _version_of(runtime, "driverGetVersion")
        if driver == 0:
            return "no NVIDIA driver was found"
        if driver is not None:
            toolkit = _version_of(runtime, "runtimeGetVersion")
            runtime_part = "" if toolkit is None else f" {toolkit // 1000}.{toolkit % 1000 // 10}"
            return (f"the NVIDIA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, older than "
                    f"CuPy's CUDA runtime{runtime_part}: update the driver")
    if status == CUDA_ERROR_NO_DEVICE:
        return "no NVIDIA GPU was found"
    return f"CUDA cannot be used here: {error}"


def _version_of(runtime: Any, query: str) -> Optional[int]:
    """``runtime.driverGetVersion()`` or ``runtimeGetVersion()`` (CUDA's
    1000 * major + 10 * minor), None where it cannot say."""
    try:
        return int(getattr(runtime, query)())
    except Exception:
        return None


def _is_out_of_memory(error: BaseException) -> bool:
    return getattr(error, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION


class OnDevice:
    """Make ``device`` current for a block of code, as ``cupy.cuda.Device`` does."""

    __slots__ = ("runtime", "device", "previous")

    def __init__(self, runtime: Any, device: int) -> None:
        self.runtime = runtime
        self.device = device

    def __enter__(self) -> None:
        self.previous = self.runtime.getDevice()
        if self.previous != self.device:
            self.runtime.setDevice(self.device)

    def __exit__(self, *exc: Any) -> None:
        if self.previous != self.device:
            self.runtime.setDevice(self.previous)


class CUDABackend(Backend):
    """Device memory of every visible GPU, through ``cudaMalloc``/``cudaFree``."""

    name = "GPU"
    api_name = "CUDA"          # PyTorch's messages: "CUDA out of memory ... GPU 0 has ..."
    survives_fork = False      # CUDA cannot be used in a forked child

    def __init__(self, runtime: Optional[Any] = None, driver: Optional[Any] = None) -> None:
        """``driver``: the ``cuda.bindings.driver`` module to map virtual
        memory with. By default it is imported when first needed, except
        over a runtime given here: a stand-in runtime brings its stand-in
        driver as its ``vmm_driver`` attribute, and one without any offers
        no virtual memory (the real driver would map real memory behind it)."""
        self._default = runtime is None
        self.runtime = runtime if runtime is not None else _default_runtime()
        self._count = self.runtime.getDeviceCount()
        if driver is None and not self._default:
            driver = getattr(self.runtime, "vmm_driver", None)
        self._driver = driver
        self._vmm: Optional[CudaVMM] = None
        self._vmm_reasons: Dict[int, str] = {}      # device -> why it has no virtual memory ("": it has)

    def device_count(self) -> int:
        return self._count

    def malloc(self, size: int, device: int, stream: int) -> int:
        try:
            with OnDevice(self.runtime, device):
                return self.runtime.malloc(size)
        except Exception as error:
            if _is_out_of_memory(error):
                raise MemoryError(str(error)) from None   # the core releases its cache and retries
            raise

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        with OnDevice(self.runtime, device):
            self.runtime.free(ptr)

    def memory_info(self, device: int) -> Tuple[int, int]:
        with OnDevice(self.runtime, device):
            free, total = self.runtime.memGetInfo()
        return int(free), int(total)

    # streams: a CUDA event marks the end of the work queued on a stream
    def record_event(self, stream: int, device: int) -> Any:
        """Record an event after the work queued so far on ``stream``, a pool
        key (see :func:`stream_key`): a per-thread key is recorded on that
        thread's per-thread default stream when called from that thread, else
        on the legacy default stream (see :func:`cuda_stream_of`)."""
        rt = self.runtime
        with OnDevice(rt, device):
            event = rt.eventCreateWithFlags(rt.eventDisableTiming)
            try:
                rt.eventRecord(event, cuda_stream_of(stream))
            except BaseException:
                rt.eventDestroy(event)
                raise
        return event

    def release_event(self, event: Any) -> None:
        """Destroy an event the core recorded but will not wait on (another
        stream's event failed, so the free was undone)."""
        self.runtime.eventDestroy(event)

    def event_done(self, event: Any) -> bool:
        if self.runtime.eventQuery(event) != CUDA_SUCCESS:
            return False
        self.runtime.eventDestroy(event)
        return True

    def synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize`` on ``device``."""
        with OnDevice(self.runtime, device):
            self.runtime.deviceSynchronize()

    def event_synchronize(self, event: Any) -> None:
        self.runtime.eventSynchronize(event)
        self.runtime.eventDestroy(event)

    # -- virtual memory (expandable segments) -----------------------------
    def virtual_memory_unavailable_reason(self, device: int) -> str:
        """Why ``device`` cannot map virtual memory (no ``cuda-bindings``,
        no driver, a GPU without VMM), for the refusal of
        ``expandable_segments``; "" when it can."""
        device = as_int(device, "device")
        reason = self._vmm_reasons.get(device)
        if reason is None:
            if not 0 <= device < self._count:
                raise ValueError(f"GPU {device} does not exist ({self._count} visible)")
            reason = ""
            if self._vmm is None:
                if self._driver is None and not self._default:
                    reason = ("this CUDA runtime was given without a driver for virtual memory "
                              "(CUDABackend(runtime, driver=...))")
                else:
                    try:
                        self._vmm = CudaVMM(self._driver if self._driver is not None else load_driver())
                    except ImportError as exc:
                        reason = str(exc)
            if self._vmm is not None:
                reason = self._vmm.unsupported_reason(device)
            if not reason:
                # the driver maps in the current context: make sure the
                # device's primary context exists (as cudaFree(0) would)
                with OnDevice(self.runtime, device):
                    self.runtime.memGetInfo()
            self._vmm_reasons[device] = reason
        return reason

    def _mapper(self, device: Any) -> CudaVMM:
        reason = self.virtual_memory_unavailable_reason(device)
        if reason:
            raise RuntimeError(f"GPU {device} cannot map virtual memory: {reason}")
        assert self._vmm is not None
        return self._vmm

    def virtual_memory_granularity(self, device: int) -> int:
        """2 MiB (PyTorch's page for expandable segments), or the driver's
        recommended granularity where larger. Without ``cuda-bindings``, a
        driver or VMM support: ``NotImplementedError`` saying which (see
        :meth:`virtual_memory_unavailable_reason`), which the core puts in
        its refusal of ``expandable_segments``."""
        reason = self.virtual_memory_unavailable_reason(device)
        if reason:
            raise NotImplementedError(reason)
        return self._mapper(device).granularity(device)

    def reserve_address_range(self, size: int, device: int) -> int:
        vmm = self._mapper(device)
        with OnDevice(self.runtime, device):
            return vmm.reserve(size, device)

    def map_pages(self, address: int, size: int, device: int) -> None:
        vmm = self._mapper(device)
        with OnDevice(self.runtime, device):
            vmm.map(address, size, device)

    def unmap_pages(self, address: int, size: int, device: int) -> None:
        """Wait for the device first: unlike ``cudaFree``, ``cuMemUnmap`` does
        not wait for kernels still using the memory (PyTorch synchronizes too)."""
        vmm = self._mapper(device)
        vmm.ranges(device).check_unmap(address, size)     # refuse misuse before waiting
        with OnDevice(self.runtime, device):
            self.runtime.deviceSynchronize()
            vmm.unmap(address, size, device)

    def unmap_idle_pages(self, address: int, size: int, device: int) -> None:
        """``cuMemUnmap`` without waiting: the core calls it once an event
        recorded after the pages' last use has completed."""
        vmm = self._mapper(device)
        with OnDevice(self.runtime, device):
            vmm.unmap(address, size, device)

    def release_address_range(self, address: int, size: int, device: int) -> None:
        vmm = self._mapper(device)
        with OnDevice(self.runtime, device):
            vmm.release(address, size, device)

    # -- sleep mode --------------------------------------------------------
    def page_release_unavailable_reason(self, device: int) -> str:
        """Always a reason: only expandable segments (the driver's virtual
        memory) can sleep on a GPU."""
        return PAGE_RELEASE_UNAVAILABLE

    def copy_to_host(self, host_address: int, address: int, size: int, device: int) -> None:
        """``cudaMemcpy`` device to host (waits for the copy)."""
        with OnDevice(self.runtime, device):
            self.runtime.memcpy(host_address, address, size, CUDA_MEMCPY_DEVICE_TO_HOST)

    def copy_from_host(self, address: int, host_address: int, size: int, device: int) -> None:
        """``cudaMemcpy`` host to device (waits for the copy)."""
        with OnDevice(self.runtime, device):
            self.runtime.memcpy(address, host_address, size, CUDA_MEMCPY_HOST_TO_DEVICE)

    def pinned_host_backend(self) -> "CUDAPinnedBackend":
        """Page-locked host memory from ``cudaHostAlloc``: the memory of ``unimem.host``."""
        return CUDAPinnedBackend(self.runtime)

    def __repr__(self) -> str:
        return f"<unimem CUDABackend: {self._count} GPU(s)>"


class CUDAPinnedBackend(Backend):
    """Pinned (page-locked) host memory from ``cudaHostAlloc``/``cudaFreeHost``."""

    name = "host"
    pinning = "cuda"          # what unimem.host.backend_name() reports
    host_accessible = True
    survives_fork = False

    def __init__(self, runtime: Optional[Any] = None) -> None:
        self.runtime = runtime if runtime is not None else _default_runtime()

    def malloc(self, size: int, device: int, stream: int) -> int:
        try:
            return self.runtime.hostAlloc(size, 0)
        except Exception as error:
            if _is_out_of_memory(error):
                raise MemoryError(str(error)) from None
            raise

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.runtime.freeHost(ptr)

    def memory_info(self, device: int = 0) -> Tuple[int, int]:
        from ._host import _meminfo
        return _meminfo()


def stream_pointer(stream: Any) -> int:
    """The ``cudaStream_t`` of a CuPy stream (``.ptr``), a PyTorch stream
    (``.cuda_stream``) or an int."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise TypeError(f"expected a CUDA stream (CuPy or PyTorch) or an int, got {type(stream).__name__}")


# ---------------------------------------------------------------------------
# Stream keys: what the pools key free blocks by
# ---------------------------------------------------------------------------
def per_thread_stream_key() -> int:
    """The pool key of the calling thread's per-thread default stream.

    Every thread gets its own key, never reused in the process (a counter,
    where CuPy uses the ``id`` of a thread-local object, which a later
    thread may get again)."""
    key = getattr(_this_thread, "key", None)
    if key is None:
        key = _this_thread.key = next(_per_thread_keys)
    return key


def stream_key(stream: Any) -> int:
    """The key unimem's CUDA pools file ``stream``'s free blocks under.

    A block freed on a stream is reused at once only by requests on the same
    key, so the key must name one stream. A ``cudaStream_t`` does, except
    ``cudaStreamPerThread`` (2): in each thread it names that thread's own
    default stream, and a block thread A freed on its per-thread stream,
    still used by work queued there, must not go at once to thread B. So, as
    CuPy's pool does, 2 is keyed per thread: it becomes the calling thread's
    :func:`per_thread_stream_key`. Every other handle is its own key.

    ``stream`` is a CuPy or PyTorch stream, a ``cudaStream_t`` as an int, or a
    key this function returned."""
    pointer = stream_pointer(stream)
    if pointer == CUDA_STREAM_PER_THREAD:
        return per_thread_stream_key()
    return pointer


def cuda_stream_of(key: int) -> int:
    """The ``cudaStream_t`` to record an event on for the pool key ``key``.

    A per-thread key is the per-thread default stream of the thread that
    owns it. From that thread, ``cudaStreamPerThread`` names that stream. From
    any other thread (a block is freed, and its events are recorded, by
    whichever thread lets go of it last) no handle names it; there the event
    goes on the legacy default stream (``cudaStreamLegacy``), which waits for
    all work queued before it on every blocking stream of the device, and a
    per-thread default stream is a blocking stream. So the event still
    completes only after the owner's work has: later than needed at worst,
    never earlier. Any other key is the ``cudaStream_t`` itself."""
    if key <= PER_THREAD_KEY_BASE:
        return key
    if key == getattr(_this_thread, "key", None):
        return CUDA_STREAM_PER_THREAD
    return CUDA_STREAM_LEGACY


_get_current_stream: Optional[Callable[[int], Any]] = None


def cupy_current_stream_key(device: int) -> int:
    """The pool key (:func:`stream_key`) of CuPy's current stream on ``device``.

    Every allocation through ``unimem.cuda.allocator`` asks this, so it makes
    one call into CuPy (bound at the first call) and no generic checks: a
    CuPy stream's ``ptr`` is an int."""
    get = _get_current_stream
    if get is None:
        get = _bind_get_current_stream()
    pointer = get(device).ptr
    if pointer == CUDA_STREAM_PER_THREAD:
        return per_thread_stream_key()
    return pointer


def _bind_get_current_stream() -> Callable[[int], Any]:
    global _get_current_stream
    from cupy.cuda import get_current_stream
    _get_current_stream = get_current_stream
    return get_current_stream
