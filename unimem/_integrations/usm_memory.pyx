# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""dpctl memory objects over unimem's pool blocks, made in C: dpnp's allocator.

dpnp 0.20 (as dpctl.tensor did in dpctl 0.15-0.21) allocates the memory of
every array it makes from Python with ``dpctl.memory.MemoryUSMDevice(nbytes,
queue=...)`` (``...Shared``, ``...Host``), reading those names from the
*Python module* ``dpctl.memory`` at each call. :class:`UsmAllocator` stands in
for one of the three classes: an integer request on a queue unimem serves
comes from a caching pool, anything else goes to dpctl's class unchanged.

The memory object handed out is one of dpctl's own (``MemoryUSMDevice``,
...), laid out as dpctl's public header ``dpctl/memory/_memory.h`` declares
it, with the block held by a ``std::shared_ptr<void>`` whose deleter returns
it to the pool - exactly how dpctl holds memory it allocated itself. Two
things follow. dpnp's kernels keep such memory alive by copying the smart
pointer into their host tasks instead of queueing a task that needs the GIL
to drop a Python reference; and the block goes back to the pool from
whichever thread lets go of the last copy, through the core's GIL-free free
entry (:meth:`CachingAllocator.c_free_detached`), once the kernels using it
have finished. The memory's ``reference_obj`` is ``None``, as for dpctl's.

Building the object in C (allocate the instance, set its fields) instead of
through ``Memory_Make`` saves the two SYCL pointer queries and the queue copy
that ``Memory_Make`` makes: :func:`check_layout` compares the layout with
objects dpctl made itself before anything is handed out.
"""
from cpython.object cimport PyObject, PyTypeObject
from cpython.dict cimport PyDict_GetItem
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uintptr_t

from unimem._native.provider cimport um_now_ns

from unimem._core cimport CachingAllocator
from unimem._native.blocks cimport CLIENT_DPNP

import numbers


cdef extern from *:
    """
    #include <memory>
    #include <new>
    #include <cstdint>
    typedef void (*um_detached_free_fn)(void* allocator, std::uintptr_t ptr);

    /* Returns a pool block when the last smart pointer to it goes. */
    struct um_pool_deleter {
        void* allocator;
        um_detached_free_fn free_fn;
        void operator()(void* p) const noexcept {
            free_fn(allocator, reinterpret_cast<std::uintptr_t>(p));
        }
    };

    /* A new std::shared_ptr<void> owning the block, as dpctl's opaque
       pointer (dpctl deletes it with `delete`). NULL when there is no host
       memory for it: shared_ptr's constructor has then already handed the
       block to the deleter. */
    static void* um_new_block_owner(std::uintptr_t p, void* allocator, um_detached_free_fn fn) {
        try {
            return new std::shared_ptr<void>(reinterpret_cast<void*>(p), um_pool_deleter{allocator, fn});
        } catch (...) {
            return NULL;
        }
    }
    static void um_delete_block_owner(void* owner) {
        delete static_cast<std::shared_ptr<void>*>(owner);
    }
    /* What a SYCL host task does with a copy of the smart pointer: hold it,
       then let it go on the runtime's thread (a pthread start routine, so a
       test can run it on a thread Python has never seen). */
    static void* um_copy_block_owner(void* owner) {
        return new std::shared_ptr<void>(*static_cast<std::shared_ptr<void>*>(owner));
    }
    static void* um_release_block_owner_copy(void* copy) {
        delete static_cast<std::shared_ptr<void>*>(copy);
        return NULL;
    }
    static std::uintptr_t um_release_block_owner_copy_address() {
        return reinterpret_cast<std::uintptr_t>(&um_release_block_owner_copy);
    }
    static void um_reset_block_owner(void* owner) {
        static_cast<std::shared_ptr<void>*>(owner)->reset();
    }
    /* Whether the smart pointer holds a pool block (its deleter is ours). */
    static int um_owns_pool_block(void* owner) {
        return std::get_deleter<um_pool_deleter>(*static_cast<std::shared_ptr<void>*>(owner)) != NULL;
    }
    static long um_block_owner_use_count(void* owner) {
        return static_cast<std::shared_ptr<void>*>(owner)->use_count();
    }

    /* dpctl's _Memory (dpctl/include/dpctl/memory/_memory.h: Py_MemoryObject). */
    struct um_dpctl_memory {
        PyObject_HEAD
        void* vtab;
        void* memory_ptr;
        void* opaque_ptr;
        Py_ssize_t nbytes;
        PyObject* queue;
        PyObject* refobj;
    };
    static PyObject* um_new_instance(PyTypeObject* type) {
        return type->tp_alloc(type, 0);
    }
    """
    ctypedef void (*um_detached_free_fn)(void* allocator, uintptr_t ptr) noexcept nogil
    void* um_new_block_owner(uintptr_t p, void* allocator, um_detached_free_fn fn) nogil
    void um_delete_block_owner(void* owner) nogil
    long um_block_owner_use_count(void* owner) nogil
    void um_reset_block_owner(void* owner) nogil
    int um_owns_pool_block(void* owner) nogil
    void* um_copy_block_owner(void* owner) nogil
    uintptr_t um_release_block_owner_copy_address() nogil
    ctypedef struct um_dpctl_memory:
        void* vtab
        void* memory_ptr
        void* opaque_ptr
        Py_ssize_t nbytes
        PyObject* queue
        PyObject* refobj
    object um_new_instance(PyTypeObject* type)


cdef void _return_block(void* allocator, uintptr_t ptr) noexcept nogil:
    (<CachingAllocator>allocator).c_free_detached(ptr)


# Why a request went around the pool, in allocator_counters' key order.
BYPASS_REASONS = ("foreign_context", "alignment", "zero_size", "other_arguments", "no_pool")
DEF N_REASONS = 5
cdef enum Bypass:
    BY_FOREIGN_CONTEXT = 0
    BY_ALIGNMENT = 1
    BY_ZERO_SIZE = 2
    BY_OTHER_ARGUMENTS = 3
    BY_NO_POOL = 4

# The pool's blocks start at multiples of 512 bytes (the core's rounding
# unit, and the XPU backend aligns every segment to 512:
# _dpctl_api.SEGMENT_ALIGNMENT): alignments up to this are honoured by any block.
POOL_ALIGNMENT = 512

# Allocators a handed-out block may return to are never destroyed: a block's
# deleter can run on a SYCL thread at any time, even after the hook is gone,
# and holds only a borrowed pointer. One per pool, so a handful.
cdef list _pinned_allocators = []


def layout_size():
    """The size of dpctl's memory object as this module lays it out."""
    return sizeof(um_dpctl_memory)


cdef class UsmKind:
    """One of dpctl's three memory classes and what the hook needs of it:
    the class, its C type and the virtual table its instances carry."""
    cdef readonly object memory_class
    cdef readonly str usm_type
    cdef PyTypeObject* type_object
    cdef void* vtab

    def __init__(self, memory_class, str usm_type, probe):
        """``probe``: an instance dpctl made itself, of exactly ``memory_class``."""
        if type(probe) is not memory_class:
            raise TypeError(f"the probe is a {type(probe).__name__}, not a {memory_class.__name__}")
        self.memory_class = memory_class
        self.usm_type = usm_type
        self.type_object = <PyTypeObject*>memory_class
        self.vtab = (<um_dpctl_memory*><PyObject*>probe).vtab


# dpctl's _Memory, once check_layout has accepted it.
cdef object _memory_base = None


def check_layout(probe, memory_base):
    """Raise ``RuntimeError`` unless ``probe`` (a ``MemoryUSM*`` that dpctl
    allocated itself) has the layout this module writes; ``memory_base`` is
    dpctl's ``_Memory``, the base of every memory class."""
    global _memory_base
    if not isinstance(probe, memory_base):
        raise TypeError(f"the probe is a {type(probe).__name__}, not a dpctl memory object")
    cdef um_dpctl_memory* m = <um_dpctl_memory*><PyObject*>probe
    probe_type = type(probe)
    cdef PyTypeObject* t = <PyTypeObject*>probe_type
    problems = []
    if <size_t>t.tp_basicsize != sizeof(um_dpctl_memory):
        problems.append(f"its size is {t.tp_basicsize} bytes, not {sizeof(um_dpctl_memory)}")
    else:
        if <uintptr_t>m.memory_ptr != probe._pointer:
            problems.append("the data pointer is not where dpctl's header puts it")
        if m.nbytes != probe.nbytes:
            problems.append("the size is not where dpctl's header puts it")
        if m.queue != <PyObject*>probe.sycl_queue:
            problems.append("the queue is not where dpctl's header puts it")
        if m.refobj != <PyObject*>probe.reference_obj:
            problems.append("the owner is not where dpctl's header puts it")
        if m.opaque_ptr == NULL or um_block_owner_use_count(m.opaque_ptr) != 1:
            problems.append("dpctl's memory holds no std::shared_ptr where its header puts one")
    if problems:
        raise RuntimeError(f"dpctl's {type(probe).__name__} is not laid out as unimem expects "
                           f"({'; '.join(problems)})")
    _memory_base = memory_base


cdef class UsmAllocator:
    """Serves dpctl memory requests of one USM kind from unimem's pools.

    ``route(queue)`` (Python, called once per queue object and cached for
    the default queues) returns ``(allocator, stream, queue, cacheable,
    guard)`` for a queue the pool serves - ``guard(queue)``, when not None,
    runs before each allocation on it - or a bypass reason (an index into
    :data:`BYPASS_REASONS`).
    Counters: requests served and their bytes, requests passed to dpctl and
    their bytes, by reason.
    """
    cdef readonly UsmKind kind
    cdef object route
    cdef object out_of_memory_error
    # The last default queue seen and where its requests go.
    cdef object cached_queue
    cdef CachingAllocator cached_allocator
    cdef object cached_guard
    cdef public long long pooled_allocations
    cdef public long long pooled_bytes
    cdef long long bypassed_allocations[N_REASONS]
    cdef long long bypassed_bytes[N_REASONS]

    def __init__(self, UsmKind kind, route, out_of_memory_error):
        self.kind = kind
        self.route = route
        self.out_of_memory_error = out_of_memory_error

    def counters(self):
        """``{"pooled.allocations": n, "pooled.bytes": n, "bypassed.<reason>.allocations": n, ...}``."""
        out = {"pooled.allocations": self.pooled_allocations, "pooled.bytes": self.pooled_bytes}
        for i, reason in enumerate(BYPASS_REASONS):
            out[f"bypassed.{reason}.allocations"] = self.bypassed_allocations[i]
            out[f"bypassed.{reason}.bytes"] = self.bypassed_bytes[i]
        return out

    cdef inline object _bypass(self, int reason, Py_ssize_t nbytes, tuple args, dict kwargs):
        self.bypassed_allocations[reason] += 1
        if nbytes > 0:
            self.bypassed_bytes[reason] += nbytes
        return self.kind.memory_class(*args, **kwargs)

    def allocate(self, tuple args, dict kwargs):
        """``memory_class(*args, **kwargs)``, from the pool where it can."""
        cdef Py_ssize_t nbytes
        cdef Py_ssize_t alignment = 0
        cdef object queue
        cdef CachingAllocator allocator
        cdef uintptr_t stream = 0
        cdef uintptr_t ptr
        if len(args) != 1:
            return self._bypass(BY_OTHER_ARGUMENTS, 0, args, kwargs)
        size = args[0]
        if type(size) is not int:
            # dpctl takes any numbers.Integral (a NumPy integer) as a size
            if isinstance(size, bool) or not isinstance(size, numbers.Integral):
                return self._bypass(BY_OTHER_ARGUMENTS, 0, args, kwargs)
            size = int(size)
        nbytes = size
        queue = None
        if kwargs:
            for key, value in kwargs.items():
                if key == "queue":
                    queue = value
                elif key == "alignment":
                    if type(value) is not int:
                        return self._bypass(BY_ALIGNMENT, nbytes, args, kwargs)
                    alignment = value
                elif key != "copy":          # copy only matters for a memory argument
                    return self._bypass(BY_OTHER_ARGUMENTS, nbytes, args, kwargs)
        if nbytes <= 0:
            return self._bypass(BY_ZERO_SIZE, nbytes, args, kwargs)
        if alignment > 0 and (alignment > POOL_ALIGNMENT or (alignment & (alignment - 1)) != 0):
            return self._bypass(BY_ALIGNMENT, nbytes, args, kwargs)
        if queue is not None and queue is self.cached_queue:
            allocator = self.cached_allocator
            guard = self.cached_guard
        else:
            routed = self.route(queue)
            if type(routed) is int:
                return self._bypass(routed, nbytes, args, kwargs)
            allocator, stream, queue, is_default, guard = routed
            if is_default:
                self.cached_queue = queue
                self.cached_allocator = allocator
                self.cached_guard = guard
        if guard is not None:
            guard(queue)
        try:
            ptr = allocator.c_malloc(<size_t>nbytes, stream, False, CLIENT_DPNP)
        except MemoryError as exc:
            raise self.out_of_memory_error(*exc.args) from None
        memory = self._wrap(ptr, nbytes, queue, allocator)
        self.pooled_allocations += 1
        self.pooled_bytes += nbytes
        return memory

    cdef object _wrap(self, uintptr_t ptr, Py_ssize_t nbytes, object queue, CachingAllocator allocator):
        return _new_memory(self.kind, ptr, nbytes, queue, allocator)


cdef object _new_memory(UsmKind kind, uintptr_t ptr, Py_ssize_t nbytes, object queue, CachingAllocator allocator):
    """dpctl's memory object of ``kind`` over the block at ``ptr``, held by a
    smart pointer whose deleter gives it back to ``allocator``. On failure
    the block is given back."""
    cdef void* owner = um_new_block_owner(ptr, <void*>allocator, _return_block)
    if owner == NULL:                 # the block went back through the deleter
        raise MemoryError("no host memory for the smart pointer of a pool block")
    try:
        memory = um_new_instance(kind.type_object)
    except BaseException:
        um_delete_block_owner(owner)  # gives the block back
        raise
    cdef um_dpctl_memory* m = <um_dpctl_memory*><PyObject*>memory
    m.vtab = kind.vtab
    m.memory_ptr = <void*>ptr
    m.opaque_ptr = owner
    m.nbytes = nbytes
    Py_INCREF(queue)
    m.queue = <PyObject*>queue
    Py_INCREF(None)
    m.refobj = <PyObject*>None
    return memory


cdef inline void _spin_ns(int64_t ns) noexcept nogil:
    """Busy-wait: no system call, so the CPU is not given up (on a CPU device
    busy with kernels, giving it up costs a scheduler time slice)."""
    cdef int64_t end = um_now_ns() + ns
    while um_now_ns() < end:
        pass


# How long yield_gil lets the GIL go: about what dpctl's own allocation
# runs without it (a USM malloc of the OpenCL CPU device: 1-3 us), and at
# most how often (a busy allocation loop then pays a few percent, not the
# whole moment on every array).
cdef int64_t GIL_YIELD_NS = 2000
cdef int64_t GIL_YIELD_INTERVAL_NS = 50000
cdef int64_t _last_gil_yield_ns = 0


def yield_gil(queue=None):
    """Let the GIL go for about GIL_YIELD_NS, busy (the CPU is kept), and take
    it back, at most once every GIL_YIELD_INTERVAL_NS: threads waiting for
    it (dpctl's keep-alive host tasks) can take it meanwhile, as they do
    while dpctl's own allocator runs. Nothing is waited for. ``queue`` is
    ignored (the signature of an allocation guard)."""
    global _last_gil_yield_ns
    cdef int64_t now = um_now_ns()
    if now - _last_gil_yield_ns < GIL_YIELD_INTERVAL_NS:
        return
    with nogil:
        _spin_ns(GIL_YIELD_NS)
    _last_gil_yield_ns = um_now_ns()


# The allocator pooled_memory pinned last (pinning is a list search).
cdef CachingAllocator _last_pinned = None


def pooled_memory(UsmKind kind, CachingAllocator allocator, Py_ssize_t nbytes, uintptr_t stream, queue):
    """A new block of ``nbytes`` (> 0) from ``allocator`` on ``stream``, as
    dpctl's memory object of ``kind`` bound to ``queue``: what
    ``unimem.xpu.empty`` builds its arrays on, the same objects the dpnp
    allocator hands out. The allocator's errors (out of memory) propagate."""
    global _last_pinned
    cdef uintptr_t ptr
    if nbytes <= 0:
        raise ValueError(f"a pool block holds at least one byte, not {nbytes}")
    if allocator is not _last_pinned:
        pin_allocator(allocator)
        _last_pinned = allocator
    ptr = allocator.c_malloc(<size_t>nbytes, stream)
    return _new_memory(kind, ptr, nbytes, queue, allocator)


def holds_pool_block(memory):
    """Whether ``memory`` (a dpctl memory object) holds a block of unimem's
    pools through the smart pointer this module gives it."""
    if block_owner_use_count(memory) == 0:
        return False
    return bool(um_owns_pool_block((<um_dpctl_memory*><PyObject*>memory).opaque_ptr))


def release_now(memory):
    """Let go of ``memory``'s own smart pointer to its block: the block goes
    back to its pool now, or when the last kernel holding a copy is done.
    For a failed fill of a new array, whose traceback would keep it alive;
    the memory must not be used again."""
    if not holds_pool_block(memory):
        raise ValueError("the memory is not a pool block's")
    um_reset_block_owner((<um_dpctl_memory*><PyObject*>memory).opaque_ptr)


def pin_allocator(CachingAllocator allocator):
    """Keep ``allocator`` alive for the rest of the process (its blocks'
    deleters point at it)."""
    if not any(a is allocator for a in _pinned_allocators):
        _pinned_allocators.append(allocator)


def block_owner_use_count(memory):
    """How many smart pointers hold ``memory``'s block (0: not smart-pointer-owned)."""
    if _memory_base is None or not isinstance(memory, _memory_base):
        raise TypeError(f"expected a dpctl memory object, got {type(memory).__name__}")
    cdef um_dpctl_memory* m = <um_dpctl_memory*><PyObject*>memory
    if m.opaque_ptr == NULL:
        return 0
    return um_block_owner_use_count(m.opaque_ptr)


def call_stand_in(stand_in, *args, **kwargs):
    """The ``__call__`` of the stand-ins' metaclass: ``MemoryUSMDevice(...)``
    with the hook installed. A class derived from a stand-in (a user's
    subclass of ``MemoryUSMDevice`` made while the hook is installed) has the
    same metaclass but no allocator of its own: it is constructed as any
    class is, its instances its own."""
    cdef PyObject* allocator = PyDict_GetItem(<object>(<PyTypeObject*>stand_in).tp_dict, "__unimem_allocator__")
    if allocator == NULL:
        return type.__call__(stand_in, *args, **kwargs)
    return (<UsmAllocator>allocator).allocate(args, kwargs)


def _hold_block(memory):
    """A new copy of ``memory``'s smart pointer, as a SYCL host task takes
    one: returns its address, to be let go by calling the C function at
    :data:`_RELEASE_HELD_BLOCK` (``void* (void* copy)``) on any thread. For
    the tests of frees on threads Python has never seen."""
    if block_owner_use_count(memory) == 0:
        raise ValueError("the memory is not held by a smart pointer")
    return <uintptr_t>um_copy_block_owner((<um_dpctl_memory*><PyObject*>memory).opaque_ptr)


_RELEASE_HELD_BLOCK = um_release_block_owner_copy_address()
