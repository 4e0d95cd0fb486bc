"""A simulated CUDA runtime with the interface of ``cupy_backends.cuda.api.runtime``.

It lets the CUDA backend and ``unimem.cuda`` run on machines without a GPU:
per-device address spaces with a capacity, a current device (per thread, as
CUDA's), streams whose work completes when a test says so, and events.
Wrong use is an error: freeing an address the current device did not
allocate, setting a device that does not exist.
"""
import itertools
import threading

CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_NOT_READY = 600


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
        self._events = {}
        self._event_ids = itertools.count(1)
        self._recorded = {}                  # (device, stream) -> last sequence queued
        self._completed = {}
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
    def current_stream(self, device):
        return getattr(self._local, "stream", 0)

    def set_stream(self, stream):
        self._local.stream = stream

    def eventCreateWithFlags(self, flags):
        event = next(self._event_ids)
        self._events[event] = None
        return event

    def eventRecord(self, event, stream):
        key = (self.getDevice(), stream)
        with self._lock:
            self._recorded[key] = self._recorded.get(key, 0) + 1
            self._events[event] = (key, self._recorded[key])

    def eventQuery(self, event):
        key, sequence = self._events[event]
        return CUDA_SUCCESS if self._completed.get(key, 0) >= sequence else CUDA_ERROR_NOT_READY

    def eventSynchronize(self, event):
        key, sequence = self._events[event]
        self._completed[key] = max(self._completed.get(key, 0), sequence)

    def eventDestroy(self, event):
        del self._events[event]

    def complete(self, stream, device=0):
        """All work queued so far on ``stream`` has finished."""
        key = (device, stream)
        self._completed[key] = self._recorded.get(key, 0)

    def events_alive(self):
        return len(self._events)
