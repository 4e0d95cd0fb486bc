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
import enum
import gc
import itertools
import threading

import pytest

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

    def __init__(self, devices=2, capacity=1 << 30, host_capacity=64 << 30):
        self.devices = devices
        self.capacity = capacity
        self.host_capacity = host_capacity   # bytes cudaHostAlloc can pin in all
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
            if sum(self.pinned.values()) + size > self.host_capacity:
                raise CUDARuntimeError(CUDA_ERROR_MEMORY_ALLOCATION)
            ptr = self._next_host
            self._next_host += -(-size // 4096) * 4096
            self.pinned[ptr] = size
            return ptr

    def freeHost(self, ptr):
        with self._lock:
            if ptr not in self.pinned:
                raise AssertionError(f"cudaFreeHost({ptr:#x}): not allocated by cudaHostAlloc")
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
def serving_cuda(runtime, cupy_streams=False):
    """Serve unimem's ``cuda`` device type from ``runtime`` (wired as on a GPU,
    the current stream read from the fake instead of CuPy) while inside.
    ``cupy_streams``: keep the stream function a GPU's type has (CuPy's
    current stream), for a test that replaces CuPy's ``get_current_stream``."""
    from unimem._runtime import devices as _devices
    from unimem._runtime.devices import make_cuda_type
    saved = (_devices._types.get("cuda"), _devices._unavailable.get("cuda"))
    _devices.install_type("cuda", make_cuda_type(runtime) if cupy_streams
                          else make_cuda_type(runtime, current_stream_fn=runtime.current_stream))
    try:
        yield runtime
    finally:
        gc.collect()
        _devices.install_type("cuda", saved[0])
        if saved[1] is not None:
            _devices._unavailable["cuda"] = saved[1]


# ---------------------------------------------------------------------------
# Fixtures over the simulated runtime, for the tests of every layer that
# drive unimem's CUDA pools (a test module imports the fixtures it uses)
# ---------------------------------------------------------------------------
@pytest.fixture
def fake():
    """Serve the ``cuda`` device type from a simulated two-GPU runtime."""
    with serving_cuda(FakeCudaRuntime(devices=2, capacity=1 << 30)) as runtime:
        yield runtime


@pytest.fixture
def on_stream(fake):
    """``with on_stream(s):`` makes ``s`` the current stream, as ``with stream:`` does in CuPy."""
    class OnStream:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.previous = fake.current_stream(None)
            fake.set_stream(self.stream)

        def __exit__(self, *exc):
            fake.set_stream(self.previous)
    return OnStream


def raw_allocator_of(runtime):
    """A CuPy-style raw allocator (``size -> MemoryPointer``) over the fake,
    as ``cupy.cuda.memory._malloc`` is over the real runtime."""
    memory = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra").cuda.memory

    class RawMemory(memory.UnownedMemory):
        def __init__(self, size):
            super().__init__(runtime.malloc(size), size, None, runtime.getDevice())

        def __del__(self):
            if self.ptr:
                runtime.free(self.ptr)

    return lambda size: memory.MemoryPointer(RawMemory(size), 0)


# ---------------------------------------------------------------------------
# The driver's virtual memory management, as cuda.bindings.driver offers it
# ---------------------------------------------------------------------------
class _Enums:
    """The enum types of ``cuda.bindings.driver`` that the VMM calls use,
    with the real names and values."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_NOT_INITIALIZED = 3
        CUDA_ERROR_INVALID_DEVICE = 101
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUmemAllocationType(enum.IntEnum):
        CU_MEM_ALLOCATION_TYPE_INVALID = 0
        CU_MEM_ALLOCATION_TYPE_PINNED = 1

    class CUmemLocationType(enum.IntEnum):
        CU_MEM_LOCATION_TYPE_INVALID = 0
        CU_MEM_LOCATION_TYPE_DEVICE = 1

    class CUmemAllocationGranularity_flags(enum.IntEnum):
        CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

    class CUmemAccess_flags(enum.IntEnum):
        CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
        CU_MEM_ACCESS_FLAGS_PROT_READ = 1
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3

    class CUdevice_attribute(enum.IntEnum):
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemLocation:
    def __init__(self):
        self.type = 0
        self.id = 0


class CUmemAllocationProp:
    def __init__(self):
        self.type = 0
        self.location = CUmemLocation()


class CUmemAccessDesc:
    def __init__(self):
        self.location = CUmemLocation()
        self.flags = 0


class CUmemGenericAllocationHandle:
    """An opaque handle, as the real one (never an int the caller could mix up)."""
    __slots__ = ("id", "device", "size", "mappings", "released")

    def __init__(self, id, device, size):
        self.id, self.device, self.size = id, device, size
        self.mappings = 0          # how many cuMemMap ranges use it
        self.released = False      # cuMemRelease was called


HOST_PAGE = 4096


class FakeCudaDriver(_Enums):
    """``cuda.bindings.driver``'s virtual memory calls over the devices of a
    :class:`FakeCudaRuntime`, sharing their capacity (``memGetInfo`` sees
    mapped memory). Every call returns a tuple whose first item is a
    ``CUresult``, as the real bindings do.

    It refuses, with the status the real driver documents, what the driver
    refuses: any call before ``cuInit``; a reservation not a multiple of the
    host page or with an alignment not a power of two; ``cuMemCreate`` of a
    size not a multiple of the granularity, or beyond the device's capacity
    (``CUDA_ERROR_OUT_OF_MEMORY``); ``cuMemMap`` outside a reservation, over
    a mapped byte, misaligned, past the handle's size or of a released
    handle; ``cuMemSetAccess`` of a range not fully mapped; ``cuMemUnmap``
    of a range that is not whole mappings; ``cuMemAddressFree`` not of a
    whole reservation. Stricter than the driver, where its behaviour is
    undefined or unspecified: ``cuMemAddressFree`` of a range with mappings
    is refused, and ``cuMemRelease`` of an unknown or released handle is an
    ``AssertionError``. Every refused call is kept in :attr:`refused`, so a
    test sees a backend that relied on the driver to catch its misuse.

    ``cuMemRelease`` of a mapped handle is allowed, as in the driver: the
    memory is freed when its last mapping goes.
    """

    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, runtime, granularity=2 << 20, recommended=None, vmm_supported=True,
                 address_space=1 << 44):
        self.runtime = runtime
        runtime.vmm_driver = self              # CUDABackend(runtime) finds it here
        self.minimum = granularity
        self.recommended = recommended or granularity
        self.vmm_supported = vmm_supported
        self.address_space = address_space      # bytes that can be reserved at once
        self.initialized = False
        self._next_address = 0x3000_0000_0000
        self.reservations = {}                  # address -> size
        self.mappings = {}                      # address -> (size, handle): each cuMemMap
        self.access = {}                        # mapping address -> {device: flags}
        self.handles = {}                       # handle id -> handle, until freed
        self._handle_ids = itertools.count(1)
        self.calls = []                         # (name, args) of every call
        self.refused = []                       # (name, args, status) of every refused call
        self.failures = {}                      # name -> [statuses the next calls return]

    # -- the machinery --------------------------------------------------------
    def fail_next(self, name, status=None, times=1):
        """The next ``times`` calls of ``name`` fail with ``status``
        (default: out of memory), as a driver at its limits would."""
        status = self.CUresult.CUDA_ERROR_OUT_OF_MEMORY if status is None else status
        self.failures.setdefault(name, []).extend([status] * times)

    def _enter(self, name, args):
        self.calls.append((name, args))
        if name != "cuInit" and not self.initialized:
            return self._refuse(name, args, self.CUresult.CUDA_ERROR_NOT_INITIALIZED)
        pending = self.failures.get(name)
        if pending:
            return pending.pop(0)
        return self.CUresult.CUDA_SUCCESS

    def _refuse(self, name, args, status=None):
        status = self.CUresult.CUDA_ERROR_INVALID_VALUE if status is None else status
        self.refused.append((name, args, status))
        return status

    def _device_ok(self, device):
        return isinstance(device, int) and 0 <= device < self.runtime.devices

    def _prop_ok(self, prop):
        return (isinstance(prop, CUmemAllocationProp)
                and prop.type == self.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and self._device_ok(prop.location.id))

    def _reservation_of(self, address, size):
        for base, length in self.reservations.items():
            if base <= address and address + size <= base + length:
                return base
        return None

    def _mappings_covering(self, address, size):
        """The mappings that exactly tile [address, address+size), in
        order, or None when the range is not whole mappings."""
        found, at = [], address
        while at < address + size:
            mapping = self.mappings.get(at)
            if mapping is None:
                return None
            found.append(at)
            at += mapping[0]
        return found if at == address + size else None

    def _free_if_unused(self, handle):
        if handle.released and handle.mappings == 0:
            del self.handles[handle.id]
            with self.runtime._lock:
                self.runtime.used[handle.device] -= handle.size

    # -- the calls --------------------------------------------------------------
    def cuInit(self, flags):
        status = self._enter("cuInit", (flags,))
        if status == self.CUresult.CUDA_SUCCESS:
            self.initialized = True
        return (status,)

    def cuGetErrorName(self, error):
        try:
            return (self.CUresult.CUDA_SUCCESS, self.CUresult(error).name.encode())
        except ValueError:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def cuDeviceGet(self, ordinal):
        status = self._enter("cuDeviceGet", (ordinal,))
        if status == self.CUresult.CUDA_SUCCESS and not self._device_ok(ordinal):
            status = self._refuse("cuDeviceGet", (ordinal,), self.CUresult.CUDA_ERROR_INVALID_DEVICE)
        return (status, ordinal if status == self.CUresult.CUDA_SUCCESS else None)

    def cuDeviceGetAttribute(self, attribute, device):
        status = self._enter("cuDeviceGetAttribute", (attribute, device))
        if status != self.CUresult.CUDA_SUCCESS:
            return (status, None)
        if attribute != self.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
            return (self._refuse("cuDeviceGetAttribute", (attribute, device)), None)
        return (status, int(self.vmm_supported))

    def cuMemGetAllocationGranularity(self, prop, option):
        status = self._enter("cuMemGetAllocationGranularity", (prop, option))
        if status != self.CUresult.CUDA_SUCCESS:
            return (status, None)
        if not self._prop_ok(prop):
            return (self._refuse("cuMemGetAllocationGranularity", (prop, option)), None)
        minimum = option == self.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return (status, self.minimum if minimum else self.recommended)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        args = (size, alignment, addr, flags)
        status = self._enter("cuMemAddressReserve", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status, None)
        if size <= 0 or size % HOST_PAGE or alignment & (alignment - 1) or flags:
            return (self._refuse("cuMemAddressReserve", args), None)
        if sum(self.reservations.values()) + size > self.address_space:
            return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)      # a limit, not a misuse
        align = max(alignment, HOST_PAGE)
        address = -(-self._next_address // align) * align
        self._next_address = address + size
        self.reservations[address] = size
        return (status, address)

    def cuMemCreate(self, size, prop, flags):
        args = (size, prop, flags)
        status = self._enter("cuMemCreate", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status, None)
        if not self._prop_ok(prop) or size <= 0 or size % self.minimum or flags:
            return (self._refuse("cuMemCreate", args), None)
        device = prop.location.id
        with self.runtime._lock:
            if self.runtime.used[device] + size > self.runtime.capacity:
                return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            self.runtime.used[device] += size
        handle = CUmemGenericAllocationHandle(next(self._handle_ids), device, size)
        self.handles[handle.id] = handle
        return (status, handle)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        args = (ptr, size, offset, handle, flags)
        status = self._enter("cuMemMap", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status,)
        if (not isinstance(handle, CUmemGenericAllocationHandle) or self.handles.get(handle.id) is not handle
                or handle.released or ptr % self.minimum or size <= 0 or size % self.minimum
                or offset % self.minimum or offset + size > handle.size or flags
                or self._reservation_of(ptr, size) is None
                or any(a < ptr + size and ptr < a + s for a, (s, _) in self.mappings.items())):
            return (self._refuse("cuMemMap", args),)
        self.mappings[ptr] = (size, handle)
        self.access[ptr] = {}                  # a new mapping has no access until cuMemSetAccess
        handle.mappings += 1
        return (status,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        args = (ptr, size, desc, count)
        status = self._enter("cuMemSetAccess", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status,)
        covering = self._mappings_covering(ptr, size)
        if (covering is None or count != len(desc) or count == 0
                or not all(isinstance(d, CUmemAccessDesc) and self._device_ok(d.location.id)
                           and d.location.type == self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                           for d in desc)):
            return (self._refuse("cuMemSetAccess", args),)
        for at in covering:
            for d in desc:
                self.access[at][d.location.id] = int(d.flags)
        return (status,)

    def cuMemUnmap(self, ptr, size):
        args = (ptr, size)
        status = self._enter("cuMemUnmap", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status,)
        covering = self._mappings_covering(ptr, size)
        if covering is None:
            return (self._refuse("cuMemUnmap", args),)
        for at in covering:
            _, handle = self.mappings.pop(at)
            del self.access[at]
            handle.mappings -= 1
            self._free_if_unused(handle)
        return (status,)

    def cuMemRelease(self, handle):
        status = self._enter("cuMemRelease", (handle,))
        if status != self.CUresult.CUDA_SUCCESS:
            return (status,)
        if not isinstance(handle, CUmemGenericAllocationHandle) or self.handles.get(handle.id) is not handle \
                or handle.released:
            raise AssertionError(f"cuMemRelease of a handle that is not live ({handle!r}): undefined behaviour")
        handle.released = True
        self._free_if_unused(handle)
        return (status,)

    def cuMemAddressFree(self, ptr, size):
        args = (ptr, size)
        status = self._enter("cuMemAddressFree", args)
        if status != self.CUresult.CUDA_SUCCESS:
            return (status,)
        if self.reservations.get(ptr) != size or any(ptr <= a < ptr + size for a in self.mappings):
            return (self._refuse("cuMemAddressFree", args),)
        del self.reservations[ptr]
        return (status,)

    # -- what a test reads --------------------------------------------------------
    def accessible(self, address, device):
        """Whether ``device`` may read and write ``address``."""
        for at, (size, _) in self.mappings.items():
            if at <= address < at + size:
                return self.access[at].get(device) == self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return False

    def physical_bytes(self, device):
        """Bytes of device memory held by live handles."""
        return sum(h.size for h in self.handles.values() if h.device == device)
