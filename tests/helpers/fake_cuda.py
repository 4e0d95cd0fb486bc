"""A simulated CUDA runtime with the interface of ``cupy_backends.cuda.api.runtime``.

It lets the CUDA backend and ``unimem.cuda`` run on machines without a GPU:
per-device address spaces with a capacity, a current device and stream (per
thread, as CUDA's and CuPy's), streams whose work completes when a test says
so, the legacy and per-thread default streams, and events (counted, so that a
test sees one leak).
Wrong use is an error: freeing an address the current device did not
allocate, setting a device that does not exist.
"""
import contextlib
import gc
import itertools
import threading

CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_RESOURCE_HANDLE = 400
CUDA_ERROR_NOT_READY = 600

STREAM_LEGACY_DEFAULT = 0        # the default stream of code built without per-thread default streams
CUDA_STREAM_LEGACY = 1           # cudaStreamLegacy
CUDA_STREAM_PER_THREAD = 2       # cudaStreamPerThread


class CUDARuntimeError(RuntimeError):
    def __init__(self, status):
        self.status = status
        super().__init__(f"cudaError {status}")


class FakeCudaRuntime:
    eventDisableTiming = 2

    def __init__(self, devices=2, capacity=1 << 30):
        self.devices = devices
        self.capacity = capacity
        self._local = threading.local()
        self._lock = threading.Lock()
        self.used = [0] * devices
        self.live = {}                       # ptr -> (device, size)
        self.pinned = {}
        self._next = [(d + 1) << 40 for d in range(devices)]
        self._next_host = 7 << 40
        self._events = {}                    # event -> {stream key: work it waits for}
        self._event_ids = itertools.count(1)
        self._queued = {}                    # stream key -> work queued so far
        self._completed = {}                 # stream key -> work finished so far
        self.recorded = []                   # (stream, thread ident) of every eventRecord
        self.failing_event_streams = set()   # eventRecord on these streams fails
        self.calls = []

    # devices
    def getDeviceCount(self):
        return self.devices

    def getDevice(self):
        return getattr(self._local, "device", 0)

    def setDevice(self, device):
        if not 0 <= device < self.devices:
            raise CUDARuntimeError(CUDA_ERROR_INVALID_DEVICE)
        self._local.device = device

    def memGetInfo(self):
        device = self.getDevice()
        return self.capacity - self.used[device], self.capacity

    # device memory
    def malloc(self, size):
        device = self.getDevice()
        with self._lock:
            if self.used[device] + size > self.capacity:
                raise CUDARuntimeError(CUDA_ERROR_MEMORY_ALLOCATION)
            ptr = self._next[device]
            self._next[device] += -(-size // 512) * 512
            self.used[device] += size
            self.live[ptr] = (device, size)
            self.calls.append(("malloc", device, size))
            return ptr

    def free(self, ptr):
        device = self.getDevice()
        with self._lock:
            owner = self.live.get(ptr)
            if owner is None or owner[0] != device:
                raise AssertionError(f"cudaFree({ptr:#x}) on device {device}: allocated on {owner}")
            del self.live[ptr]
            self.used[device] -= owner[1]
            self.calls.append(("free", device, owner[1]))

    # pinned host memory
    def hostAlloc(self, size, flags):
        with self._lock:
            ptr = self._next_host
            self._next_host += -(-size // 4096) * 4096
            self.pinned[ptr] = size
            return ptr

    def freeHost(self, ptr):
        with self._lock:
            del self.pinned[ptr]

    # streams and events
    #
    # Work is counted per stream: ``launch`` queues a kernel, ``eventRecord``
    # queues a marker, ``complete`` finishes everything queued so far. An
    # event is done when the streams it waits on have finished the work
    # queued on them before it. Handles 0 and 1 (cudaStreamLegacy) name the
    # legacy default stream, which waits for every other (blocking) stream of
    # its device; 2 (cudaStreamPerThread) names the calling thread's own
    # per-thread default stream, a different stream in every thread.
    def _stream_key(self, stream, device=None, thread=None):
        device = self.getDevice() if device is None else device
        if stream in (STREAM_LEGACY_DEFAULT, CUDA_STREAM_LEGACY):
            return (device, "legacy")
        if stream == CUDA_STREAM_PER_THREAD:
            return (device, "per-thread", threading.get_ident() if thread is None else thread)
        return (device, stream)

    def current_stream(self, device):
        return getattr(self._local, "stream", 0)

    def set_stream(self, stream):
        self._local.stream = stream

    def launch(self, stream=None):
        """Queue work on ``stream`` (default: this thread's current stream) of the current device."""
        key = self._stream_key(self.current_stream(None) if stream is None else stream)
        with self._lock:
            self._queued[key] = self._queued.get(key, 0) + 1

    def eventCreateWithFlags(self, flags):
        with self._lock:
            event = next(self._event_ids)
            self._events[event] = {}
        return event

    def eventRecord(self, event, stream):
        key = self._stream_key(stream)
        with self._lock:
            if event not in self._events:
                raise AssertionError(f"cudaEventRecord on event {event}, which does not exist")
            if stream in self.failing_event_streams:
                raise CUDARuntimeError(CUDA_ERROR_INVALID_RESOURCE_HANDLE)
            self._queued[key] = self._queued.get(key, 0) + 1
            waits = {key: self._queued[key]}
            if key[1] == "legacy":        # the legacy stream waits for every blocking stream
                for other, queued in self._queued.items():
                    if other[0] == key[0]:
                        waits[other] = queued
            self._events[event] = waits
            self.recorded.append((stream, threading.get_ident()))

    def _event_waits(self, event):
        waits = self._events.get(event)
        if waits is None:
            raise AssertionError(f"event {event} does not exist (destroyed, or never created)")
        return waits

    def eventQuery(self, event):
        with self._lock:
            waits = self._event_waits(event)
            done = all(self._completed.get(key, 0) >= sequence for key, sequence in waits.items())
        return CUDA_SUCCESS if done else CUDA_ERROR_NOT_READY

    def eventSynchronize(self, event):
        with self._lock:
            for key, sequence in self._event_waits(event).items():
                self._completed[key] = max(self._completed.get(key, 0), sequence)

    def eventDestroy(self, event):
        with self._lock:
            self._event_waits(event)
            del self._events[event]

    def complete(self, stream, device=0, thread=None):
        """All work queued so far on ``stream`` has finished (stream 2: on the
        per-thread default stream of ``thread``, by default the calling one)."""
        key = self._stream_key(stream, device, thread)
        with self._lock:
            self._completed[key] = self._queued.get(key, 0)

    def deviceSynchronize(self):
        """All work queued so far on every stream of the current device has finished."""
        device = self.getDevice()
        with self._lock:
            for key, queued in self._queued.items():
                if key[0] == device:
                    self._completed[key] = queued

    def events_alive(self):
        """How many events exist (created and not destroyed)."""
        with self._lock:
            return len(self._events)


@contextlib.contextmanager
def serving_cuda(runtime):
    """Serve unimem's ``cuda`` device type from ``runtime`` (wired as on a GPU,
    the current stream read from the fake instead of CuPy) while inside."""
    from unimem._runtime import devices as _devices
    from unimem._runtime.devices import make_cuda_type
    saved = (_devices._types.get("cuda"), _devices._unavailable.get("cuda"))
    _devices._types["cuda"] = make_cuda_type(runtime, current_stream_fn=runtime.current_stream)
    try:
        yield runtime
    finally:
        gc.collect()
        if saved[0] is None:
            _devices._types.pop("cuda", None)
        else:
            _devices._types["cuda"] = saved[0]
        if saved[1] is not None:
            _devices._unavailable["cuda"] = saved[1]
