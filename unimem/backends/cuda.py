"""NVIDIA GPU memory through CuPy's CUDA runtime bindings.

``cudaMalloc`` / ``cudaFree`` per device (made current as CuPy does, and put
back after), ``cudaMemGetInfo`` for memory info, CUDA events (recorded on the
streams a block was used on) for stream-ordered reuse, and ``cudaHostAlloc``
for the pinned host pool. CuPy's wheels ship no ``.pxd`` for the runtime, so
these are Python calls; the caching core makes them only on a cache miss.

The runtime is a parameter (``CUDABackend(runtime=...)``): CuPy's
``cupy_backends.cuda.api.runtime`` by default, a stand-in in tests on
machines without a GPU.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .base import Backend

CUDA_ERROR_MEMORY_ALLOCATION = 2          # cudaErrorMemoryAllocation
CUDA_SUCCESS = 0


def _default_runtime() -> Any:
    from cupy_backends.cuda.api import runtime
    return runtime


def _is_out_of_memory(error: BaseException) -> bool:
    return getattr(error, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION


class _OnDevice:
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
    survives_fork = False      # CUDA cannot be used in a forked child

    def __init__(self, runtime: Optional[Any] = None) -> None:
        self.runtime = runtime if runtime is not None else _default_runtime()
        self._count = self.runtime.getDeviceCount()

    def device_count(self) -> int:
        return self._count

    def malloc(self, size: int, device: int, stream: int) -> int:
        try:
            with _OnDevice(self.runtime, device):
                return self.runtime.malloc(size)
        except Exception as error:
            if _is_out_of_memory(error):
                raise MemoryError(str(error)) from None   # the core releases its cache and retries
            raise

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        with _OnDevice(self.runtime, device):
            self.runtime.free(ptr)

    def memory_info(self, device: int) -> Tuple[int, int]:
        with _OnDevice(self.runtime, device):
            free, total = self.runtime.memGetInfo()
        return int(free), int(total)

    # streams: a CUDA event marks the end of the work queued on a stream
    def record_event(self, stream: int, device: int) -> Any:
        rt = self.runtime
        with _OnDevice(rt, device):
            event = rt.eventCreateWithFlags(rt.eventDisableTiming)
            try:
                rt.eventRecord(event, stream)
            except BaseException:
                rt.eventDestroy(event)
                raise
        return event

    def event_done(self, event: Any) -> bool:
        if self.runtime.eventQuery(event) != CUDA_SUCCESS:
            return False
        self.runtime.eventDestroy(event)
        return True

    def event_synchronize(self, event: Any) -> None:
        self.runtime.eventSynchronize(event)
        self.runtime.eventDestroy(event)

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
        if isinstance(value, int):
            return value
    raise TypeError(f"expected a CUDA stream (CuPy or PyTorch) or an int, got {type(stream).__name__}")


def make_device_type(runtime: Optional[Any] = None):
    """The ``cuda`` device type, or a string saying why there is none."""
    if runtime is None:
        try:
            import cupy  # noqa: F401
            runtime = _default_runtime()
        except ImportError as exc:
            return f"CuPy is not installed ({exc}); pip install unimem[cuda]"
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:
        return f"CUDA cannot be used here: {exc}"
    if count == 0:
        return "CUDA sees no GPU"
    from .._devices import DeviceType
    return DeviceType("cuda", CUDABackend(runtime), current_device_fn=runtime.getDevice,
                      set_device_fn=runtime.setDevice, current_stream_fn=_current_stream,
                      stream_handle_fn=stream_pointer)


def _current_stream(device: int) -> int:
    import cupy
    return cupy.cuda.get_current_stream(device).ptr
