# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""dpctl's C API, reached at run time.

dpctl ships its C interface in ``libDPCTLSyclInterface.so``. Taking it at
run time (instead of compiling against dpctl's headers) keeps dpctl out of
unimem's build: the package compiles without it and uses it when it is
installed.

Queues other than the devices' defaults sit in a table of stream handles
that never moves (the core reads it without the GIL): a slot is filled when a
queue is added, counts the allocations made on it and not yet freed, and is
cleared again (dropping the queue) once none is left, so the slot can serve
another queue.

:class:`USMRawAllocator`: SYCL USM ``aligned_alloc_device`` /
``aligned_alloc_shared`` / ``aligned_alloc_host`` (by
:data:`SEGMENT_ALIGNMENT`) and ``free``, published to the caching core as C
functions (a cache miss calls them without Python and without the GIL). Pool
blocks become dpctl memory objects in :mod:`unimem._integrations.usm_memory`.
"""
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_GetPointer, PyCapsule_GetName
from libc.stdint cimport uintptr_t, int64_t
from libcpp.vector cimport vector

from unimem._native.provider cimport (RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY, RAW_ERROR,
                                      UM_PROVIDER_CAPSULE, UM_PROVIDER_VERSION)


cdef extern from *:
    """
    #include <atomic>
    #include <cstdint>
    #include <cstdlib>
    #include <mutex>
    /* One stream handle: its queue (NULL: free), the allocations made on
       it and not yet freed, and whether the queue was found idle with no
       holder but unimem (a completed barrier; see mark_idle): a free on it
       then needs no wait. Zeroed memory is a valid empty slot. */
    struct um_queue_slot {
        std::atomic<void*> queue;
        std::atomic<int64_t> live;
        std::atomic<bool> idle;
    };
    static bool um_slot_idle(um_queue_slot* s, size_t i) {
        return s[i].idle.load(std::memory_order_acquire);
    }
    static void um_slot_set_idle(um_queue_slot* s, size_t i, bool idle) {
        s[i].idle.store(idle, std::memory_order_release);
    }
    static um_queue_slot* um_slots_new(size_t n) {
        return static_cast<um_queue_slot*>(std::calloc(n, sizeof(um_queue_slot)));
    }
    static void um_slots_delete(um_queue_slot* s) { std::free(s); }
    static void* um_slot_queue(um_queue_slot* s, size_t i) {
        return s[i].queue.load(std::memory_order_acquire);
    }
    static void um_slot_set_queue(um_queue_slot* s, size_t i, void* q) {
        s[i].queue.store(q, std::memory_order_release);
    }
    static void um_slot_live_add(um_queue_slot* s, size_t i, int64_t d) {
        s[i].live.fetch_add(d, std::memory_order_relaxed);
    }
    static int64_t um_slot_live(um_queue_slot* s, size_t i) {
        return s[i].live.load(std::memory_order_relaxed);
    }

    /* Bytes held per device: a free runs outside the core's lock (and
       another allocator's malloc beside it), so the count is atomic. */
    typedef std::atomic<int64_t> um_held_bytes;
    static um_held_bytes* um_held_new(size_t n) { return new (std::nothrow) um_held_bytes[n](); }
    static void um_held_delete(um_held_bytes* h) { delete[] h; }
    static void um_held_add(um_held_bytes* h, size_t i, int64_t d) {
        h[i].fetch_add(d, std::memory_order_relaxed);
    }
    static int64_t um_held_get(um_held_bytes* h, size_t i) { return h[i].load(std::memory_order_relaxed); }

    /* Every queue wait unimem makes goes through here, one at a time. The
       Intel OpenCL CPU runtime (intel-opencl-rt 2026.2) crashes when two
       threads finish the same queue at once (clFinish on an out-of-order
       queue: a use after free in QueueEvent::DoneWithDependencies; eight
       threads calling DPCTLQueue_Wait crash it within seconds), and a queue
       wait is where unimem's threads meet: each release of a segment waits,
       outside the core's lock and without the GIL. Waiters would wait for
       the same work anyway, so taking turns costs nothing measurable. */
    typedef void (*um_queue_wait_fn)(void*);
    static std::atomic<um_queue_wait_fn> um_dpctl_queue_wait{nullptr};
    static std::mutex um_queue_wait_mutex;
    static void um_wait_queue(void* q) {
        um_queue_wait_fn wait = um_dpctl_queue_wait.load(std::memory_order_acquire);
        if (wait == nullptr || q == nullptr)
            return;
        std::lock_guard<std::mutex> guard(um_queue_wait_mutex);
        wait(q);
    }
    static void um_set_queue_wait(um_queue_wait_fn wait) {
        um_dpctl_queue_wait.store(wait, std::memory_order_release);
    }
    static std::uintptr_t um_wait_queue_address() {
        return reinterpret_cast<std::uintptr_t>(&um_wait_queue);
    }
    """
    ctypedef struct um_queue_slot:
        pass
    um_queue_slot* um_slots_new(size_t n) nogil
    void um_slots_delete(um_queue_slot* s) nogil
    void* um_slot_queue(um_queue_slot* s, size_t i) nogil
    void um_slot_set_queue(um_queue_slot* s, size_t i, void* q) nogil
    bint um_slot_idle(um_queue_slot* s, size_t i) nogil
    void um_slot_set_idle(um_queue_slot* s, size_t i, bint idle) nogil
    void um_slot_live_add(um_queue_slot* s, size_t i, int64_t d) nogil
    int64_t um_slot_live(um_queue_slot* s, size_t i) nogil
    ctypedef struct um_held_bytes:
        pass
    um_held_bytes* um_held_new(size_t n) nogil
    void um_held_delete(um_held_bytes* h) nogil
    void um_held_add(um_held_bytes* h, size_t i, int64_t d) nogil
    int64_t um_held_get(um_held_bytes* h, size_t i) nogil
    ctypedef void (*um_queue_wait_fn)(void*) noexcept nogil
    void um_wait_queue(void* q) nogil
    void um_set_queue_wait(um_queue_wait_fn wait) nogil
    uintptr_t um_wait_queue_address() nogil

# Stream handles a raw allocator can hold at once (reserved, not resident:
# calloc'd pages are touched only when used). Handles are reused once their
# queue is dropped, so this bounds queues alive together, not queues ever seen.
MAX_QUEUE_HANDLES = 1 << 20

#: Every segment starts at a multiple of this, so that every block does (the
#: core hands out blocks at multiples of 512 bytes into a segment): PyTorch's
#: XPU allocator asks ``sycl::aligned_alloc_device`` for 512 bytes
#: (``kDeviceAlignment``). SYCL's ``malloc_*`` promise none (128 on the
#: OpenCL CPU device).
cdef enum:
    SEGMENT_ALIGNMENT_C = 512
SEGMENT_ALIGNMENT = SEGMENT_ALIGNMENT_C

# DPCTLaligned_alloc_<kind>(alignment, size, queue)
ctypedef void* (*usm_malloc_fn)(size_t alignment, size_t size, void* queue) noexcept nogil
ctypedef void (*usm_free_fn)(void* ptr, void* queue) noexcept nogil


def set_queue_wait(uintptr_t wait_fn):
    """Make ``DPCTLQueue_Wait`` (its address) the wait behind :func:`wait_queue`."""
    if not wait_fn:
        raise ValueError("dpctl's DPCTLQueue_Wait was not found")
    um_set_queue_wait(<um_queue_wait_fn>wait_fn)


def wait_queue(queue):
    """Wait for everything submitted to ``queue`` (a ``dpctl.SyclQueue``),
    without the GIL, taking turns with unimem's other queue waits (see
    ``um_wait_queue``). Does nothing before :func:`set_queue_wait`."""
    cdef void* q = <void*><uintptr_t>queue.addressof_ref()
    with nogil:
        um_wait_queue(q)


def queue_wait_address():
    """The address of unimem's queue wait, ``void (*)(DPCTLSyclQueueRef)``,
    for C code that waits on queues (the SYCL interposer)."""
    return um_wait_queue_address()


cdef struct USMContext:
    usm_malloc_fn malloc
    usm_free_fn free
    vector[void*]* default_queues   # device index -> DPCTLSyclQueueRef
    um_queue_slot* slots            # stream handle -> DPCTLSyclQueueRef (0: the device's default)
    size_t n_slots
    um_held_bytes* held             # device index -> bytes currently allocated
    size_t n_devices


cdef inline void* queue_for(USMContext* c, int device, uintptr_t stream) noexcept nogil:
    if stream == 0:
        if device < 0 or <size_t>device >= c.default_queues.size():
            return NULL
        return c.default_queues[0][device]
    if stream >= c.n_slots:
        return NULL
    return um_slot_queue(c.slots, stream)


cdef int usm_malloc(void* ctx, size_t size, int device, uintptr_t stream,
                    uintptr_t* out) noexcept nogil:
    cdef USMContext* c = <USMContext*>ctx
    cdef void* q = queue_for(c, device, stream)
    out[0] = 0
    if q == NULL:
        return RAW_ERROR
    cdef void* p = c.malloc(SEGMENT_ALIGNMENT_C, size, q)
    if p == NULL:
        return RAW_OUT_OF_MEMORY
    out[0] = <uintptr_t>p
    um_held_add(c.held, device, <int64_t>size)
    if stream != 0:
        um_slot_live_add(c.slots, stream, 1)
        um_slot_set_idle(c.slots, stream, False)      # in use again: work may follow
    return RAW_OK


cdef int usm_free(void* ctx, uintptr_t ptr, size_t size, int device,
                  uintptr_t stream) noexcept nogil:
    cdef USMContext* c = <USMContext*>ctx
    cdef void* q = queue_for(c, device, stream)
    if q == NULL:
        return RAW_ERROR
    # As PyTorch's XPU allocator does: no kernel may still use the memory
    # when sycl::free runs. Waiting on an idle queue costs next to nothing,
    # but the waits take turns: an abandoned queue found idle (mark_idle) is
    # not waited on, so that giving its cache back at another queue's first
    # allocation never waits behind another thread's wait on a busy queue.
    if stream == 0 or not um_slot_idle(c.slots, stream):
        um_wait_queue(q)
    c.free(<void*>ptr, q)
    um_held_add(c.held, device, -<int64_t>size)
    if stream != 0:
        um_slot_live_add(c.slots, stream, -1)
    return RAW_OK


cdef class USMRawAllocator:
    """Raw SYCL USM allocations of one kind (``device``, ``shared`` or ``host``).

    Args:
        kind: the USM kind.
        malloc_fn, free_fn: addresses of ``DPCTLaligned_alloc_<kind>`` and
            ``DPCTLfree_with_queue``.
        default_queues: the default ``dpctl.SyclQueue`` of each device.

    A free waits on the queue first through :func:`wait_queue`, whose
    ``DPCTLQueue_Wait`` :func:`set_queue_wait` gives (the XPU backend's
    runtime does, before it makes any raw allocator).
    """

    cdef USMContext ctx
    cdef list _queue_objects          # the default queues, whose refs we hold
    cdef dict _queues_by_handle       # stream handle -> the SyclQueue whose ref its slot holds
    cdef readonly str kind
    cdef readonly object _raw_api
    cdef RawAllocatorAPI api

    def __cinit__(self):
        self.ctx.default_queues = new vector[void*]()
        # slot 0 stays empty: handle 0 means "the device's default queue"
        self.ctx.slots = um_slots_new(MAX_QUEUE_HANDLES)
        if self.ctx.slots == NULL:
            raise MemoryError("no memory for the SYCL queue table")
        self.ctx.n_slots = MAX_QUEUE_HANDLES

    def __dealloc__(self):
        del self.ctx.default_queues
        um_slots_delete(self.ctx.slots)
        if self.ctx.held != NULL:
            um_held_delete(self.ctx.held)

    def __init__(self, str kind, uintptr_t malloc_fn, uintptr_t free_fn, list default_queues):
        if not malloc_fn or not free_fn:
            raise ValueError("dpctl's USM functions were not found")
        self.kind = kind
        self.ctx.malloc = <usm_malloc_fn>malloc_fn
        self.ctx.free = <usm_free_fn>free_fn
        self._queue_objects = list(default_queues)
        self._queues_by_handle = {}
        self.ctx.held = um_held_new(max(len(default_queues), 1))
        if self.ctx.held == NULL:
            raise MemoryError("no memory for the SYCL allocation counts")
        self.ctx.n_devices = len(default_queues)
        for q in default_queues:
            self.ctx.default_queues.push_back(<void*><uintptr_t>q.addressof_ref())
        self.api.version = UM_PROVIDER_VERSION
        self.api.ctx = &self.ctx
        self.api.malloc = usm_malloc
        self.api.free = usm_free
        self._raw_api = PyCapsule_New(&self.api, UM_PROVIDER_CAPSULE, NULL)

    def add_queue(self, queue, Py_ssize_t handle):
        """Serve stream ``handle`` (1 or more, its slot empty) with ``queue``,
        which is kept alive until :meth:`remove_queue`."""
        if handle < 1 or <size_t>handle >= self.ctx.n_slots:
            raise ValueError(f"stream handle {handle} is out of range [1, {self.ctx.n_slots})")
        if handle in self._queues_by_handle:
            raise ValueError(f"stream handle {handle} already has a queue")
        self._queues_by_handle[handle] = queue
        um_slot_set_idle(self.ctx.slots, handle, False)
        um_slot_set_queue(self.ctx.slots, handle, <void*><uintptr_t>queue.addressof_ref())

    def remove_queue(self, Py_ssize_t handle):
        """Let go of stream ``handle``'s queue, which must have no allocation
        left on it; its slot is then free for another queue."""
        if handle not in self._queues_by_handle:
            raise ValueError(f"stream handle {handle} has no queue")
        live = um_slot_live(self.ctx.slots, handle)
        if live != 0:
            raise ValueError(f"stream handle {handle} still has {live} allocation(s) on its queue")
        um_slot_set_queue(self.ctx.slots, handle, NULL)
        del self._queues_by_handle[handle]

    def mark_idle(self, Py_ssize_t handle):
        """Stream ``handle``'s queue has finished its work (a barrier on it
        completed) and nobody but unimem holds it, so nobody can queue more:
        frees on it need not wait, until the next allocation on it."""
        if handle < 1 or <size_t>handle >= self.ctx.n_slots or handle not in self._queues_by_handle:
            raise ValueError(f"stream handle {handle} has no queue")
        um_slot_set_idle(self.ctx.slots, handle, True)

    def allocations_on(self, Py_ssize_t handle):
        """Allocations made on stream ``handle``'s queue and not yet freed."""
        if handle < 1 or <size_t>handle >= self.ctx.n_slots:
            raise ValueError(f"stream handle {handle} is out of range [1, {self.ctx.n_slots})")
        return um_slot_live(self.ctx.slots, handle)

    @property
    def max_queue_handles(self):
        """One more than the largest stream handle this allocator can serve."""
        return self.ctx.n_slots

    def held(self, int device):
        """Bytes allocated on ``device`` through this allocator and not yet freed."""
        if device < 0 or <size_t>device >= self.ctx.n_devices:
            raise ValueError(f"XPU device {device} does not exist ({self.ctx.n_devices} visible)")
        return um_held_get(self.ctx.held, device)

    def malloc(self, size_t size, int device, uintptr_t stream):
        cdef uintptr_t out = 0
        cdef int rc = usm_malloc(&self.ctx, size, device, stream, &out)
        if rc == RAW_ERROR:
            raise ValueError(f"no SYCL queue for device {device}, stream {stream}")
        if rc != RAW_OK:
            raise MemoryError(f"SYCL malloc_{self.kind} of {size} bytes failed")
        return out

    def free(self, uintptr_t ptr, size_t size, int device, uintptr_t stream):
        if usm_free(&self.ctx, ptr, size, device, stream) != RAW_OK:
            raise ValueError(f"no SYCL queue for device {device}, stream {stream}")
