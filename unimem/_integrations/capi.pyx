# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""unimem's C ABI (``include/unimem.h``): the library C code and PyTorch's
pluggable allocators load is this extension module itself.

``capi.hpp`` defines the exported functions; they call the entries below,
which this module hands to it when imported. A request finds its allocator
(and, for XPU, the stream key of its queue) in C tables without the GIL,
and goes to the core's GIL-free entry (``CachingAllocator.c_malloc_nogil``,
``c_free_detached``): a cache hit touches no Python object. What the tables
do not hold yet (a device's allocator, a queue, a thread's CUDA per-thread
stream key) is looked up once with the GIL, taken here, and published.

Lifetimes: an allocator published to the tables is kept alive for the rest
of the process (a thread without the GIL may be using it at any time); when
its device type is replaced (``unimem._runtime.devices.install_type``) the
tables forget it and the next request looks the new one up. An XPU queue
seen here keeps unimem's own object for that queue alive (so its stream
handle keeps naming it), as PyTorch keeps its streams' queues.
"""
from cpython.exc cimport PyErr_SetInterrupt
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t, uintptr_t

from unimem._core cimport CachingAllocator
from unimem._native.blocks cimport CLIENT_C, CLIENT_TORCH
from unimem._native.stats cimport S_ALLOCATED_BYTES, S_RESERVED_BYTES, pool_current

import atexit
import importlib

from unimem._runtime.devices import get_type, on_type_replaced


ctypedef size_t (*identity_fn)(const void*) noexcept nogil

cdef extern from "capi.hpp":
    int UNIMEM_ABI_VERSION
    int UNIMEM_CPU, UNIMEM_CUDA, UNIMEM_XPU

cdef extern from "capi.hpp" namespace "um_capi" nogil:
    ctypedef struct Entries "um_capi::Entries":
        void* (*malloc)(int, size_t, int, void*, int) noexcept nogil
        void (*free)(int, void*, int, void*) noexcept nogil
        int64_t (*stat)(int, int, int) noexcept nogil
        int (*empty_cache)(int) noexcept nogil
    int N_TYPES, ERROR_SIZE
    char* error_buffer()
    void set_error(const char* text)
    uintptr_t thread_key()
    void set_thread_key(uintptr_t key)
    void* allocator_of(int type, int device)
    void publish_allocator(int type, int device, void* allocator)
    void forget_allocators(int type)
    int find_queue(const void* queue, void** allocator, uintptr_t* stream)
    int record_queue(const void* queue, size_t identity, void* allocator, uintptr_t stream)
    void forget_queues()
    void set_queue_identity(identity_fn fn)
    void set_entries(const Entries* e)


#: The version of the C ABI (``UNIMEM_ABI_VERSION`` of ``unimem.h``).
ABI_VERSION = UNIMEM_ABI_VERSION
#: The device types as the C ABI numbers them (``unimem_device_type``).
DEVICE_TYPES = ("cpu", "cuda", "xpu")

cdef uintptr_t CUDA_STREAM_PER_THREAD = 2       # cudaStreamPerThread
cdef bint _exiting = False
# Every allocator published to the C tables, kept for the process.
cdef dict _published = {}
# XPU queue address -> unimem's object for that queue (its handle's).
cdef dict _queue_holders = {}
cdef identity_fn _queue_identity = NULL


def _mark_exiting():
    global _exiting
    _exiting = True


atexit.register(_mark_exiting)


# ---------------------------------------------------------------------------
# the entries (called by capi.hpp's exported functions, on any thread)
# ---------------------------------------------------------------------------
cdef void* _malloc(int device_type, size_t size, int device, void* stream, int for_torch) noexcept nogil:
    """``for_torch``: PyTorch's pluggable allocator asks (unimem_torch_*),
    not plain C: its blocks' client says so."""
    cdef void* allocator = NULL
    cdef uintptr_t key = <uintptr_t>stream
    if size == 0:
        return NULL
    if _route(device_type, device, stream, True, &allocator, &key) != 0:
        return NULL
    return <void*>(<CachingAllocator>allocator).c_malloc_nogil(size, key, CLIENT_TORCH if for_torch else CLIENT_C,
                                                                error_buffer(), ERROR_SIZE)


cdef void _free(int device_type, void* ptr, int device, void* stream) noexcept nogil:
    cdef void* allocator = NULL
    cdef uintptr_t key = 0
    if _route(device_type, device, stream, False, &allocator, &key) != 0:
        return
    # A pointer the pool does not hold is left alone (there is no caller to tell).
    (<CachingAllocator>allocator).c_free_detached(<uintptr_t>ptr)


cdef inline int _route(int device_type, int device, void* stream, bint create, void** allocator,
                       uintptr_t* key) noexcept nogil:
    """The allocator and stream key of a request: from the C tables, or
    looked up with the GIL. 0, or -1 with the error set."""
    cdef int found
    if device_type == UNIMEM_XPU and stream != NULL:
        if find_queue(stream, allocator, key):
            return 0
        return _queue_route(stream, allocator, key)
    allocator[0] = allocator_of(device_type, device)
    if allocator[0] == NULL:
        found = _look_up_allocator(device_type, device, create, allocator)
        if found != 1:
            if found == 0:
                set_error(b"ValueError: no block of this device was allocated by unimem")
            return -1
    if device_type == UNIMEM_XPU:
        key[0] = 0                      # no queue: the device's default queue
    elif device_type == UNIMEM_CUDA and key[0] == CUDA_STREAM_PER_THREAD:
        key[0] = thread_key()
        if key[0] == 0:
            key[0] = _look_up_thread_key()
            if key[0] == 0:
                return -1
    return 0


cdef int64_t _stat(int which, int device_type, int device) noexcept nogil:
    cdef void* allocator
    cdef int found
    if device_type < 0 or device_type >= N_TYPES:
        set_error(b"ValueError: unknown unimem_device_type")
        return -1
    allocator = allocator_of(device_type, device)
    if allocator == NULL:
        found = _look_up_allocator(device_type, device, False, &allocator)
        if found < 0:
            return -1
        if found == 0:
            return 0                     # before the device's first allocation, as torch's
    return pool_current(&(<CachingAllocator>allocator).stats, S_RESERVED_BYTES if which else S_ALLOCATED_BYTES)


cdef int _empty_cache(int device_type) noexcept with gil:
    if device_type < 0 or device_type >= N_TYPES:
        set_error(b"ValueError: unknown unimem_device_type")
        return -1
    if _refuse_at_exit():
        return -1
    try:
        importlib.import_module(f"unimem.{DEVICE_TYPES[device_type]}").empty_cache()
    except BaseException as exc:
        _note(exc)
        return -1
    return 0


cdef Entries _entries
_entries.malloc = _malloc
_entries.free = _free
_entries.stat = _stat
_entries.empty_cache = _empty_cache


# ---------------------------------------------------------------------------
# what the tables do not hold yet, looked up with the GIL
# ---------------------------------------------------------------------------
cdef void _note(BaseException exc) noexcept:
    """``exc`` as this thread's error; a Ctrl-C is raised again at Python's
    next check (no Python caller can be told of it here)."""
    set_error(f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
    if isinstance(exc, KeyboardInterrupt):
        PyErr_SetInterrupt()


cdef bint _refuse_at_exit() noexcept:
    if _exiting:
        set_error(b"RuntimeError: the interpreter is exiting")
    return _exiting


cdef int _look_up_allocator(int device_type, int device, bint create, void** allocator) noexcept with gil:
    """The allocator of ``device`` (made if ``create``), published: 1; 0 when
    it was not made yet; -1 with the error set."""
    if _refuse_at_exit():
        return -1
    try:
        registry = get_type(DEVICE_TYPES[device_type]).registry
        found = registry.get(device) if create else registry.peek(device)
    except BaseException as exc:
        _note(exc)
        return -1
    if found is None:
        return 0
    _publish(device_type, device, found)
    allocator[0] = <void*>found
    return 1


cdef void _publish(int device_type, int device, CachingAllocator allocator) noexcept:
    _published[id(allocator)] = allocator
    publish_allocator(device_type, device, <void*>allocator)


cdef uintptr_t _look_up_thread_key() noexcept with gil:
    """The calling thread's key for cudaStreamPerThread, as unimem.cuda keys
    it (unimem.backends.cuda.per_thread_stream_key), kept in C after."""
    cdef uintptr_t key
    if _refuse_at_exit():
        return 0
    try:
        from unimem.backends.cuda import per_thread_stream_key
        key = per_thread_stream_key()
    except BaseException as exc:
        _note(exc)
        return 0
    set_thread_key(key)
    return key


cdef int _queue_route(void* queue, void** allocator, uintptr_t* key) noexcept with gil:
    if _refuse_at_exit():
        return -1
    try:
        found, stream = _route_queue(<uintptr_t>queue)
    except BaseException as exc:
        _note(exc)
        return -1
    allocator[0] = <void*>found
    key[0] = stream
    return 0


def _route_queue(uintptr_t queue_ref):
    """``(allocator, stream key)`` of device USM requests on the
    ``sycl::queue*`` at ``queue_ref``, recorded for the GIL-free lookups.

    The key is unimem.xpu's for the queue (``_xpu_pools._stream_for``: the
    runtime's handle, 0 for a default queue). The queue's device decides the
    pool; its SYCL context must be the pool's (device USM of another context
    cannot be used on it)."""
    global _queue_identity
    from unimem.backends import xpu as _backend
    import dpctl
    runtime = _backend._SyclRuntime.get()
    if _queue_identity == NULL:
        address = runtime.c_functions(("DPCTLQueue_Hash",))["DPCTLQueue_Hash"]
        _queue_identity = <identity_fn><uintptr_t>address
        set_queue_identity(_queue_identity)
    # dpctl copies the queue the capsule names (the caller keeps its own).
    queue = dpctl.SyclQueue(PyCapsule_New(<void*>queue_ref, b"SyclQueueRef", NULL))
    index = runtime.device_index_of(queue)
    default = runtime.default_queues[index]
    if queue.sycl_context != default.sycl_context:
        raise ValueError(f"the queue's SYCL context is not the one unimem's XPU pool of device {index} "
                         f"allocates in (that of dpctl's default queue for {default.sycl_device.name!r}): "
                         f"its device USM could not be used on this queue")
    allocator = get_type("xpu").allocator(index)
    for _ in range(3):
        stream = runtime.stream_handle(queue)
        # unimem's own object for the handle: held here, the runtime keeps the
        # handle for this queue (it lets go of a queue only it holds)
        holder = runtime.queues[stream] if stream else default
        if holder is not None and holder == queue:
            break
    else:
        raise RuntimeError("the SYCL queue's stream handle kept changing while it was looked up")
    identity = _queue_identity(<const void*>queue_ref)
    _publish_queue(queue_ref, identity, allocator, stream, holder)
    return allocator, stream


cdef int _publish_queue(uintptr_t queue_ref, size_t identity, CachingAllocator allocator, uintptr_t stream,
                        object holder) except -1:
    _published[id(allocator)] = allocator
    recorded = record_queue(<const void*>queue_ref, identity, <void*>allocator, stream)
    if recorded < 0:
        raise MemoryError("no host memory for the C ABI's queue table")
    if recorded:
        _queue_holders[queue_ref] = holder     # the entry it replaced (a queue gone) lets go of its own
    return 0


def _forget_type(name):
    """A device type was replaced: its allocators are no longer the tables'."""
    if name not in DEVICE_TYPES:
        return
    forget_allocators(DEVICE_TYPES.index(name))
    if name == "xpu":
        forget_queues()
        _queue_holders.clear()


def allocators_published():
    """How many allocators the C tables have held (for tests)."""
    return len(_published)


on_type_replaced(_forget_type)
set_entries(&_entries)
