# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""The device registry: the caching allocators of one device type, one per
index, and the per-thread current device.

It sits on the core (it cimports :class:`unimem._core.CachingAllocator` and
calls its typed entry points), and is what the facade's fastest functions
(``caching_allocator_alloc``/``delete``) go through: typed here because the
lookups through Python methods would cost more than the allocation itself.
"""
cimport cython
from libc.stdint cimport uint64_t, uintptr_t

from unimem._core cimport CachingAllocator
from unimem._native.arguments cimport check_pointer, check_size, check_stream, exact_size
from unimem._native.policy cimport MAX_REQUEST
from unimem._native.stats cimport S_ALLOCATED_BYTES, pool_current

import threading
import weakref

from unimem._core import HANDLE_OWNED_MESSAGE, InvalidDeviceError, InvalidPointerError


# Per-thread current device index, one slot per live device registry; the
# owner says which registry set it (slots are reused once a registry dies,
# and a new one must not inherit another's index).
cdef extern from *:
    """
    #include <cstdint>
    #define UM_MAX_REGISTRIES 64
    static thread_local int um_current_device[UM_MAX_REGISTRIES];
    static thread_local uint64_t um_current_owner[UM_MAX_REGISTRIES];
    """
    int UM_MAX_REGISTRIES
    int um_current_device[64]
    uint64_t um_current_owner[64]


# ---------------------------------------------------------------------------
# The per-device-type table behind the facade's fast functions
# ---------------------------------------------------------------------------
# Slots of the per-thread current-device table: taken by live registries,
# given back when one dies. Each registry also has an id never reused.
_free_registry_slots = list(range(UM_MAX_REGISTRIES - 1, -1, -1))
cdef uint64_t _last_registry_id = 0
# Every registry alive, so that a forked child gets fresh creation locks.
_live_registries = weakref.WeakSet()

@cython.final          # its cpdef methods are then called directly from C
cdef class DeviceRegistry:
    """The caching allocators of one kind of device (``cpu``, ``xpu``,
    ``cuda``), one per device index, created on first use by ``factory``.

    The current device index is per thread (as in PyTorch) unless
    ``current_device_fn`` reports it (CUDA's current device, for instance).
    ``current_stream_fn`` gives the stream a request without one uses, and
    ``stream_handle_fn`` turns a stream object (a CuPy stream, a SYCL queue)
    into the integer handle the core keys its pools by.
    """

    cdef readonly int slot
    cdef uint64_t owner_id
    cdef readonly str device_type
    cdef readonly int device_count
    cdef object _factory
    cdef list _allocators
    # The allocator of a registry with one device, once made: the fast
    # functions' common case (no device, no stream, an exact int) goes
    # straight to it (and unimem.cuda.allocator's, read as ``only``).
    cdef readonly CachingAllocator only
    cdef object _create_lock
    cdef object _thread_current         # threading.local, when no C table slot was free
    cdef object __weakref__
    cdef public object current_device_fn
    cdef public object current_stream_fn
    cdef public object stream_handle_fn
    # Set when its device type left the front's table (replaced): the
    # namespaces' fast functions, which keep the registry they found, then
    # look the type up again (see NamespaceAllocFunctions).
    cdef public bint retired

    def __cinit__(self, *args, **kwargs):
        self.slot = -1

    def __init__(self, str device_type, int device_count, factory, *,
                 current_device_fn=None, current_stream_fn=None, stream_handle_fn=None):
        global _last_registry_id
        if self.slot < 0 and self._thread_current is None:
            if _free_registry_slots:
                self.slot = _free_registry_slots.pop()
                _last_registry_id += 1
                self.owner_id = _last_registry_id
            else:
                # The C table is full (many MemoryPools alive): this registry
                # keeps its per-thread current device in Python instead.
                self._thread_current = threading.local()
        self.device_type = device_type
        self.device_count = device_count
        self._factory = factory
        self._allocators = [None] * device_count
        self._create_lock = threading.Lock()
        _live_registries.add(self)
        self.current_device_fn = current_device_fn
        self.current_stream_fn = current_stream_fn
        self.stream_handle_fn = stream_handle_fn

    cdef int check_index(self, int index) except -1:
        if index < 0 or index >= self.device_count:
            raise InvalidDeviceError(
                f"device index {index} is out of range: {self.device_type} has "
                f"{self.device_count} device{'s' if self.device_count != 1 else ''}")
        return 0

    cpdef int current_index(self) except -1:
        if self.current_device_fn is not None:
            return self.current_device_fn()
        if self.slot < 0:
            return getattr(self._thread_current, "index", 0)
        if um_current_owner[self.slot] != self.owner_id:
            return 0                   # not set in this thread (by this registry)
        return um_current_device[self.slot]

    cdef inline int _default_index(self) except -1:
        """The index a request without a device goes to: the current one, or
        0 without asking when there is a single device (the only valid
        index: the per-thread table is not read on the hot path then)."""
        if self.device_count == 1:
            return 0
        return self.current_index()

    def set_current_index(self, int index):
        self.check_index(index)
        if self.slot < 0:
            self._thread_current.index = index
            return
        um_current_device[self.slot] = index
        um_current_owner[self.slot] = self.owner_id

    def __dealloc__(self):
        if self.slot >= 0 and _free_registry_slots is not None:
            _free_registry_slots.append(self.slot)

    cpdef CachingAllocator get(self, int index):
        """The allocator of device ``index``, created if needed."""
        self.check_index(index)
        cdef CachingAllocator a = <CachingAllocator>self._allocators[index]
        if a is not None:
            return a
        with self._create_lock:
            if self._allocators[index] is None:
                allocator = self._factory(index)
                if not isinstance(allocator, CachingAllocator):
                    raise TypeError("the registry's factory must return a CachingAllocator")
                self._allocators[index] = allocator
                if self.device_count == 1:
                    self.only = allocator
            return self._allocators[index]

    def _reset_after_fork(self):
        # Another thread may have held it while creating an allocator.
        self._create_lock = threading.Lock()

    def peek(self, int index):
        """The allocator of device ``index`` if it was created, else None."""
        self.check_index(index)
        return self._allocators[index]

    def initialized(self):
        """The allocators created so far, by index."""
        return {i: a for i, a in enumerate(self._allocators) if a is not None}

    def is_initialized(self):
        return any(a is not None for a in self._allocators)

    cdef uintptr_t stream_handle(self, object stream, int index=-1) except? 0:
        if stream is None:
            if self.current_stream_fn is None:
                return 0
            return check_stream(self.current_stream_fn(index))
        if self.stream_handle_fn is None:
            return check_stream(stream)
        # Ints too: a cudaStream_t such as cudaStreamPerThread is keyed per
        # thread, and an XPU handle is checked against the queue table.
        return check_stream(self.stream_handle_fn(stream))

    def stream_handle_of(self, stream, int device=-1):
        """The integer handle the pools key ``stream`` by (None: ``device``'s
        current stream)."""
        if stream is None and device < 0:
            device = self.current_index()
        return self.stream_handle(stream, device)

    def allocate_current(self, size, client=None):
        """An :class:`~unimem._core.Allocation` of ``size`` bytes on the
        current device and its current stream (``CachingAllocator.allocate``,
        for ``client``): what an array library's allocator hook asks for, in
        one call."""
        cdef int index = self._default_index()
        return self.get(index).allocate(size, self.stream_handle(None, index), client)

    def alloc(self, size, device=None, stream=None):
        """Allocate ``size`` bytes on ``device`` (an index; None: the current
        one) and ``stream``; return the address (0 for size 0)."""
        return self._alloc(size, device, stream)

    cdef object _alloc(self, object size, object device, object stream):
        cdef size_t n = 0
        cdef object checked = None
        if not exact_size(size, &n):
            checked = check_size(size)            # raises for what is no size
        cdef int index = self._default_index() if device is None else _device_int(device)
        cdef CachingAllocator a = self.get(index)
        if checked is not None:
            if checked > MAX_REQUEST:
                raise a._out_of_memory(checked)
            n = checked
        elif n > MAX_REQUEST:
            raise a._out_of_memory(n)
        return a.c_malloc(n, self.stream_handle(stream, index))

    def delete(self, ptr):
        """Free an address handed out by :meth:`alloc` on any device."""
        self._delete(ptr)

    cdef int _delete(self, object ptr) except -1:
        cdef uintptr_t p = check_pointer(ptr)
        if p == 0:
            return 0
        # The current device's allocator first: the block is most likely
        # there; then the others (no list is built: this runs on every free).
        cdef int current = self._default_index() if self.device_count else 0
        cdef int rc = _free_on(self._allocators[current], p) if current < self.device_count else 1
        cdef Py_ssize_t i
        for i in range(len(self._allocators)):
            if rc != 1:
                break
            if i != current:
                rc = _free_on(self._allocators[i], p)
        if rc == 0:
            return 0
        if rc == 4:
            raise ValueError(HANDLE_OWNED_MESSAGE.format(p))
        raise InvalidPointerError(f"pointer {p:#x} was not allocated by the unimem "
                         f"{self.device_type} allocator, or was already freed")

    def find_owner(self, ptr):
        """The allocator holding the live block at ``ptr``, or None."""
        for a in self._allocators:
            if a is not None and a.owns(ptr):
                return a
        return None

    def memory_allocated(self, device=None):
        cdef int index = self.current_index() if device is None else _device_int(device)
        self.check_index(index)
        cdef CachingAllocator a = <CachingAllocator>self._allocators[index]
        return 0 if a is None else pool_current(&a.stats, S_ALLOCATED_BYTES)


cdef inline int _free_on(object allocator, uintptr_t p) except -1:
    """CachingAllocator._try_free on ``allocator`` (1, as for an unknown
    address, when that device's allocator was never made)."""
    if allocator is None:
        return 1
    return (<CachingAllocator>allocator)._try_free(p, False, False)


cdef int _device_int(object device) except? -1:
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device index must be an int, not {type(device).__name__}")
    if device < 0:
        raise InvalidDeviceError(f"device index must be non-negative, got {device}")
    if device > 1 << 20:
        raise InvalidDeviceError(f"device index {device} is out of range")
    return device


# ---------------------------------------------------------------------------
# The current accelerator's registry, for the facade's fastest functions
# ---------------------------------------------------------------------------
cdef DeviceRegistry _current_registry = None
_registry_resolver = None


def set_current_registry_resolver(resolver):
    """Install the function the fast facade calls once to learn the current
    accelerator's registry (the front decides; the core only caches it)."""
    global _registry_resolver, _current_registry
    _registry_resolver = resolver
    _current_registry = None


_device_index_resolver = None


def set_device_index_resolver(resolver):
    """Install the function that turns what the front takes for a device
    (``"xpu:0"``, a device object) into the current accelerator's device
    index, for ``unimem.accelerator.caching_allocator_alloc``'s checked path."""
    global _device_index_resolver
    _device_index_resolver = resolver


cdef inline DeviceRegistry _current():
    # Inlined into the fast functions: once resolved, one test and no call.
    if _current_registry is not None:
        return _current_registry
    return _resolve_current()


cdef DeviceRegistry _resolve_current():
    global _current_registry
    if _registry_resolver is None:
        raise RuntimeError("unimem's device registry is not set up (import unimem)")
    _current_registry = _registry_resolver()
    return _current_registry


include "registry_hot.pxi"


def _after_fork_in_child():
    """In a forked child: each registry gets a fresh creation lock (another
    thread may have held it while creating an allocator)."""
    for registry in list(_live_registries):
        registry._reset_after_fork()
