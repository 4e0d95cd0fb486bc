# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""The caching core: a backend-agnostic caching allocator over integer addresses.

One :class:`CachingAllocator` serves one device through one raw-memory backend.
It implements PyTorch's CUDA caching policy (c10/cuda/CUDACachingAllocator.cpp):

* requests are rounded to 512 bytes (or to power-of-two divisions when
  ``roundup_power2_divisions`` asks for it);
* rounded sizes up to 1 MiB come from the small pool, carved out of 2 MiB
  segments; larger ones from the large pool (20 MiB segments under 10 MiB,
  2 MiB-rounded segments above);
* the best fit among free blocks of the same pool and stream is taken
  (smallest size, then lowest address) and split when the rest is worth keeping;
* freeing merges a block with its free neighbours of the same segment;
* a miss asks the backend, then frees cached memory and retries, and only then
  raises :class:`OutOfMemoryError`.

The hot path (a cache hit and a free) is plain C under one lock: no Python
object is touched. Everything that has to talk to Python (a backend written in
Python, stream events, history hooks) is on the miss path.

Layout: the data structures (blocks, segments, the free index, the address
table, the statistics' storage) are in ``unimem/_native/*.pxd`` as inline
functions, and the provider ABI in ``_native/provider.h``. This file is the
state machine: lifecycle, lock, hot path, miss path, free and merge, and the
thin Python methods. Included from beside it, as module-level functions of
the same extension: ``_core_provider.pxi`` (calls into the backend),
``_core_reclaim.pxi`` (cached memory going back), ``_core_streams.pxi``
(stream-ordered reuse), ``_core_errors.pxi`` (errors, OOM text),
``_core_stats.pxi`` (statistics and snapshot export), ``_core_debug.pxi``
(debug mode) and ``_core_checks.pxi`` (option and consistency checks).
Other Cython modules cimport the interface in ``_core.pxd``.
"""

cimport cython

cdef extern from "Python.h":
    # Callable without the GIL: it says whether this thread holds it.
    int PyGILState_Check() nogil
    void PyErr_SetInterrupt()
from cpython.pycapsule cimport PyCapsule_IsValid, PyCapsule_GetPointer
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF, Py_XDECREF
from libc.stdint cimport uint8_t, uint64_t, int64_t, uintptr_t, INT64_MAX
from libc.stdlib cimport malloc as sys_malloc, free as sys_free, calloc
from libc.string cimport memset, memcmp, memcpy, strlen
from libcpp.vector cimport vector
from libcpp.map cimport map as cmap
from cython.operator cimport dereference as deref, preincrement as inc
from libcpp.utility cimport pair
from libcpp.algorithm cimport sort as cpp_sort, unique as cpp_unique

from unimem._native.addr_map cimport *
from unimem._native.arguments cimport as_integer, check_pointer, check_size, check_stream, exact_size
from unimem._native.blocks cimport *
from unimem._native.policy cimport *
from unimem._native.provider cimport (RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY,
                                      UM_PROVIDER_CAPSULE, UM_PROVIDER_VERSION, um_now_ns)
from unimem._native.stats cimport *
from unimem._native.stream_events cimport *
from unimem._native.stream_notices cimport *

import atexit
import collections
import os
import sys
import threading
import warnings
import weakref

# PyTorch refuses such a request with its own sentence ("more than 1EB").
cdef object ONE_EXABYTE = 1 << 60

MIN_BLOCK_SIZE = K_MIN_BLOCK
SMALL_SIZE = K_SMALL_SIZE
SMALL_BUFFER = K_SMALL_BUFFER
LARGE_BUFFER = K_LARGE_BUFFER
MIN_LARGE_ALLOC = K_MIN_LARGE_ALLOC
ROUND_LARGE = K_ROUND_LARGE
ROUNDUP_INTERVALS = K_ROUNDUP_INTERVALS
MAX_REQUEST_SIZE = MAX_REQUEST
MAX_RESERVED_SIZE = MAX_RESERVED

cdef size_t SIZE_UNSET = <size_t>-1

cdef enum:
    DEBUG_FILL = 0xDB                  # what debug mode fills free memory with
cdef unsigned char debug_fill_page[4096]
memset(debug_fill_page, DEBUG_FILL, 4096)

include "_core_free_index.pxi"
include "_core_pair.pxi"
include "_core_errors.pxi"
include "_core_stats.pxi"
include "_core_history.pxi"
include "_core_clients.pxi"
include "_core_debug.pxi"
include "_core_checks.pxi"
include "_core_provider.pxi"
include "_core_reclaim.pxi"
include "_core_event_queue.pxi"
include "_core_streams.pxi"
include "_core_stream_notices.pxi"
include "_core_expandable.pxi"
include "_core_expandable_unmap.pxi"
include "_core_holes.pxi"
include "_core_pools.pxi"
include "_core_miss.pxi"
include "_core_limits.pxi"
include "_core_teardown.pxi"
include "_core_sleep.pxi"
include "_core_sleep_pools.pxi"


# Every allocator alive, so that fork handlers can repair their locks.
_live_allocators = weakref.WeakSet()

# C-level globals: module attributes are torn down during interpreter
# finalization, when allocators may still be collected.
cdef bint _exiting = False
cdef object _is_finalizing = sys.is_finalizing


def _mark_exiting():
    global _exiting
    _exiting = True


atexit.register(_mark_exiting)


cdef void _free_from_deleter(void* allocator, uintptr_t ptr, bint may_wait) noexcept with gil:
    """c_free_detached's free through Python (a finalizer's), with the GIL
    taken here: only for a block that needs it, after the lock is let go.
    ``may_wait``: with the cache off, the segment goes back too (the
    backend's free may wait for the device); not on a runtime's thread,
    where it stays cached until empty_cache or set_caching."""
    cdef CachingAllocator self = <CachingAllocator>allocator
    try:
        if self._try_free(ptr, False, True) == 0 and may_wait:
            _give_back_segment_at(self, ptr)
    except BaseException as exc:
        _report_unraisable(exc, "unimem: freeing a block from its deleter")


cdef uintptr_t _malloc_taking_gil(CachingAllocator self, size_t size, uintptr_t stream, unsigned char client,
                                 char* error, size_t error_size) noexcept with gil:
    """c_malloc_nogil's way through Python: c_malloc, its exception's type
    and message written to ``error``. A Ctrl-C is raised again at Python's
    next check (this call has no Python caller to reach)."""
    try:
        self._refuse_huge(size)
        return self.c_malloc(size, stream, False, client)
    except BaseException as exc:
        _copy_error(error, error_size, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
        if isinstance(exc, KeyboardInterrupt):
            PyErr_SetInterrupt()
    return 0


cdef void _copy_error(char* error, size_t error_size, const char* text) noexcept nogil:
    """``text`` into ``error`` (cut to ``error_size`` - 1 bytes, NUL-terminated)."""
    if error == NULL or error_size == 0:
        return
    cdef size_t n = strlen(text)
    if n >= error_size:
        n = error_size - 1
    memcpy(error, text, n)
    error[n] = 0


cdef bint _interpreter_exiting():
    if _exiting:
        return True
    try:
        return _is_finalizing()
    except BaseException:
        return True


cdef class CachingAllocator:
    """A caching allocator for one device over a raw-memory backend.

    Args:
        backend: the raw memory provider (see :mod:`unimem.backends.base`).
        device (int): the device index this allocator serves.
        max_split_size (int, optional): blocks of at least this many bytes are
            never split ("oversize"). Default: unlimited.
        max_non_split_rounding (int): an oversize request may take a cached
            block at most this much larger. Default: 20 MiB.
        roundup_power2_divisions (sequence of 16 ints, optional): per
            power-of-two interval from 1 MiB to 64 GiB, how many divisions a
            request is rounded to (0 or 1: plain 512-byte rounding).
        garbage_collection_threshold (float): with a memory fraction set, free
            old cached blocks once reserved memory passes this share of it.
        exact_segments (bool): CuPy's pool policy instead of PyTorch's: a new
            segment is exactly the rounded request (no 2 MiB / 20 MiB segments).
    """


    def __init__(self, backend, int device=0, *, max_split_size=None,
                 max_non_split_rounding=K_LARGE_BUFFER,
                 roundup_power2_divisions=None,
                 double garbage_collection_threshold=0.0, double max_reserved_ratio=0.0,
                 bint exact_segments=False, bint expandable_segments=False):
        # C fields start zeroed and object fields None (Cython's tp_new); a
        # second __init__ would drop the tables of a working allocator.
        if self.backend is not None:
            raise RuntimeError("this CachingAllocator is already initialized")
        if backend is None:
            raise TypeError("a backend is required")
        _set_policy(self, max_split_size, max_non_split_rounding, roundup_power2_divisions,
                    garbage_collection_threshold, max_reserved_ratio)
        name = str(getattr(backend, "name", type(backend).__name__))
        if expandable_segments:
            if exact_segments:
                raise ValueError("exact_segments and expandable_segments exclude each other "
                                 "(a segment is either the request or a growing range)")
            _setup_expandable(self, backend, device, name)
        self.policy.small_request_max = 0 if self.expandable and max_reserved_ratio else K_SMALL_SIZE
        if um_init(&self.active, 10) != 0:
            raise MemoryError("cannot allocate the allocator's tables")
        self.backend = backend
        self.device = device
        self.device_name = name
        self._py_malloc = backend.malloc
        self._py_free = backend.free
        raw = getattr(backend, "_raw_api", None)
        if raw is not None and PyCapsule_IsValid(raw, UM_PROVIDER_CAPSULE):
            self._raw = (<RawAllocatorAPI*>PyCapsule_GetPointer(raw, UM_PROVIDER_CAPSULE))[0]
            # A provider built against another version of the ABI is called
            # through its Python methods only.
            self._has_raw = self._raw.version == UM_PROVIDER_VERSION
            # The struct lives in this object (the backend itself by default).
            self._raw_owner = getattr(backend, "_raw_owner", backend)
        self.fraction = 1.0
        self.policy.exact_segments = exact_segments
        self.oom_observers = []
        self.pool_backends = {}
        self.sleep_states = {}
        _live_allocators.add(self)

    def __del__(self):
        _give_back_free_segments(self)

    def __dealloc__(self):
        # The allocator's own C structures; memory was given back in __del__.
        cdef Segment* seg = self.segments
        cdef Segment* nxt
        cdef Block* b
        cdef Block* bn
        while seg != NULL:
            nxt = seg.next_seg
            b = seg.head
            while b != NULL:
                bn = b.next
                if b.stream_uses != NULL:
                    del b.stream_uses
                sys_free(b)
                b = bn
            sys_free(seg)
            seg = nxt
        self.segments = NULL
        cdef StreamTable.iterator it = self.streams.begin()
        while it != self.streams.end():
            stream_pools_delete(deref(it).second)
            inc(it)
        self.streams.clear()
        self.last_pools = NULL
        _delete_private_pools(self)
        _forget_every_event(self)
        um_destroy(&self.active)
        slab_destroy(&self.slab)

    # ------------------------------------------------------------------
    # Locking. Two rules keep Python threads and foreign runtime threads
    # (SYCL host tasks that drop the last reference to an array, and so free
    # its block, from their own thread) from deadlocking:
    #   1. never wait for the lock while holding the GIL;
    #   2. never release the GIL while holding the lock (so whoever holds the
    #      GIL never finds the lock taken by another thread, and a finalizer
    #      frees its block in one go, without giving the GIL up half-way).
    # Backend calls that may block run outside the lock: returning memory,
    # asking for a segment of the device's own pools (_alloc_block: its
    # bytes count against the limits meanwhile), expandable segments'
    # virtual memory calls (_core_expandable.pxi), and every stream event call
    # (record, ask, wait: _core_streams.pxi copies the queue heads out under
    # the lock and commits the answers under it again). The history hook runs
    # outside it too, and no thread waits for another's (_core_history.pxi:
    # commits in the order the batches were taken), and so do check_stream
    # and release_stream (_core_stream_notices.pxi: one teller per stream
    # settles what the backend holds with the table). A free that arrives while
    # this thread's own call still holds the lock (a finalizer run by a
    # backend call made under it) goes to the inbox, deferred_frees, done
    # before that operation returns (_drain_inbox). Calls still made under
    # the lock (sleep's, private pools' allocators) are the strict xfails of
    # tests/core/threads/test_no_call_under_the_lock.py.
    # ------------------------------------------------------------------
    cdef inline void _lock(self) noexcept:
        """Take the lock for anything but the pair of one size: a merge put
        off is done first, and the next free of the last split block is an
        ordinary one (_core_pair.pxi)."""
        self._lock_hot()
        self.last_split = NULL
        if self.unmerged != NULL:
            _merge_deferred(self)

    cdef inline void _lock_hot(self) noexcept:
        """Take the lock for c_malloc and c_free, whose cache hits look at
        the unmerged block themselves."""
        if not self.lock.try_lock():
            with nogil:
                self.lock.lock()
        self.lock_depth += 1

    cdef inline void _unlock(self) noexcept nogil:
        self.lock_depth -= 1
        self.lock.unlock()

    # ------------------------------------------------------------------
    # policy helpers (PyTorch's round_size / get_allocation_size / should_split)
    # ------------------------------------------------------------------
    cdef inline size_t _round_size(self, size_t size) noexcept nogil:
        if size < K_MIN_BLOCK:
            return K_MIN_BLOCK
        cdef int log_size = um_floor_log2(size)
        cdef int index = log_size - 20 if log_size > 20 else 0
        if index > K_ROUNDUP_INTERVALS - 1:
            index = K_ROUNDUP_INTERVALS - 1
        cdef size_t divisions = self.policy.roundup_divisions[index]
        if divisions > 1 and size > K_MIN_BLOCK * divisions:
            return roundup_power2_next_division(size, divisions)
        return (size + K_MIN_BLOCK - 1) & ~(<size_t>(K_MIN_BLOCK - 1))

    cdef inline bint _should_split(self, Block* b, size_t size) noexcept nogil:
        cdef size_t remaining = b.size - size
        if b.is_small:
            return remaining >= K_MIN_BLOCK
        if self.expandable:                   # PyTorch: expandable blocks always split
            return remaining >= K_MIN_BLOCK
        return size < self.policy.max_split_size and remaining > K_SMALL_SIZE

    cdef inline bint _gc_enabled(self) noexcept nogil:
        return self.set_fraction and self.policy.gc_threshold > 0.0

    # ------------------------------------------------------------------
    # stream pools
    # ------------------------------------------------------------------
    cdef inline FreeIndex* _pool(self, uintptr_t stream, bint is_small) noexcept nogil:
        """The free index of (stream, pool), created on first use; NULL when
        host memory for it cannot be had."""
        cdef StreamPools* sp = self.last_pools
        if sp == NULL or sp.stream != stream:
            sp = self._stream_pools(stream)
            if sp == NULL:
                return NULL
        return sp.small if is_small else sp.large

    cdef StreamPools* _stream_pools(self, uintptr_t stream) noexcept nogil:
        """Find (O(1)) or make the pools of ``stream``."""
        cdef StreamTable.iterator it = self.streams.find(stream)
        cdef StreamPools* sp
        if it != self.streams.end():
            sp = deref(it).second
        else:
            sp = stream_pools_new(stream)
            if sp == NULL:
                return NULL
            self.streams[stream] = sp
            # a new stream (a new SYCL queue): at this call's miss, ask the
            # backend whether older streams were abandoned (_core_provider.pxi)
            self.stream_notices.added = stream != 0
        self.last_pools = sp
        return sp

    cdef void _drop_stream_if_unused(self, StreamPools* sp) noexcept nogil:
        """Forget the pools of a stream that holds no segment (stream 0, the
        default, stays). Its handle is noted for the backend, which may then
        let go of what it keeps for the stream (a SYCL queue)."""
        if sp.n_segments != 0 or sp.n_stream_uses != 0 or sp.n_private_segments != 0 or sp.stream == 0:
            return
        self.streams.erase(sp.stream)
        if self.last_pools == sp:
            self.last_pools = NULL
        um_notices_drop(self.stream_notices, sp.stream)   # no memory: the backend keeps its hold
        stream_pools_delete(sp)

    cdef void _drop_unused_streams(self) noexcept nogil:
        cdef vector[StreamPools*] unused
        cdef StreamTable.iterator it = self.streams.begin()
        while it != self.streams.end():
            if (deref(it).second.n_segments == 0 and deref(it).second.n_stream_uses == 0
                    and deref(it).second.n_private_segments == 0):
                unused.push_back(deref(it).second)
            inc(it)
        for sp in unused:
            self._drop_stream_if_unused(sp)

    cdef inline FreeIndex* _pool_of(self, Block* b) noexcept nogil:
        return b.index

    # ------------------------------------------------------------------
    # the hot path
    # ------------------------------------------------------------------
    cdef Block* _get_free_block(self, FreeIndex* fi, size_t size) noexcept nogil:
        if self._gc_enabled():
            fi.get_free_blocks_call_count += 1
        cdef SizeClass* sc = NULL
        cdef Block* b = fi_best_fit(fi, size, &sc)
        if b == NULL:
            return NULL
        if self.expandable and b.next != NULL and b.next.unmapped:
            b = _prefer_unexpandable(fi, b, &sc)
        # An oversize block is never handed to a normal request, and an
        # oversize request takes a cached block only if it wastes little.
        if size < self.policy.max_split_size and b.size >= self.policy.max_split_size:
            return NULL
        if size >= self.policy.max_split_size and b.size >= size + self.policy.max_non_split_rounding:
            return NULL
        fi_remove_from(fi, sc, b)
        return b

    cdef Block* _alloc_found_block(self, Block* block, FreeIndex* fi, size_t size,
                                   size_t orig_size, bint by_handle, unsigned char client) noexcept nogil:
        """Hand out ``block`` (already taken off the free index) for a request
        of ``size`` rounded bytes. A split remainder takes the Block that
        _reserve_for_alloc kept in the slab."""
        cdef DeviceStats* st = &self.stats
        cdef bint is_small = block.is_small
        # PyTorch leaves expandable blocks out of inactive_split (their free
        # pages can always be given back): asked below only where it counts.
        cdef bint already_split = block.prev != NULL or block.next != NULL
        cdef Block* remaining
        if self._should_split(block, size):
            # The front part is handed out; the rest stays free. The Block
            # was reserved (cannot fail), and every field is set here.
            remaining = self.slab.free_list
            self.slab.free_list = remaining.next
            remaining.requested_size = 0
            remaining.stream_uses = NULL
            remaining.event_count = 0
            remaining.ptr = block.ptr + size
            remaining.size = block.size - size
            remaining.stream = block.stream
            remaining.segment = block.segment
            remaining.index = block.index
            remaining.is_small = is_small
            remaining.allocated = False
            remaining.unmapped = False
            remaining.lost = False
            remaining.releasing = False
            remaining.client = CLIENT_NONE    # the slab's Block may be an old block's
            remaining.prev = block
            remaining.next = block.next
            if block.next != NULL:
                block.next.prev = remaining
            block.next = remaining
            block.size = size
            fi_insert(fi, remaining)   # cannot fail: the class map was reserved
            if self.expandable and block.segment.expandable:
                pass
            elif already_split:
                pool_decrease(st, S_INACTIVE_SPLIT_BYTES, is_small, size)
            else:
                pool_increase(st, S_INACTIVE_SPLIT_BYTES, is_small, remaining.size)
                pool_increase(st, S_INACTIVE_SPLIT, is_small, 1)
        else:
            if already_split and not (self.expandable and block.segment.expandable):
                pool_decrease(st, S_INACTIVE_SPLIT_BYTES, is_small, block.size)
                pool_decrease(st, S_INACTIVE_SPLIT, is_small, 1)
        return self._hand_out(block, orig_size, by_handle, client)

    cdef inline Block* _hand_out(self, Block* block, size_t orig_size, bint by_handle,
                                 unsigned char client) noexcept nogil:
        """The end of _alloc_found_block: ``block`` (its size final) becomes
        live, and the statistics count it. The active map has room (reserved)."""
        cdef DeviceStats* st = &self.stats
        cdef bint is_small = block.is_small
        block.allocated = True
        block.by_handle = by_handle
        block.client = client
        block.requested_size = orig_size
        if self.debug_on:
            _debug_check(self, block)
        um_put_unchecked(&self.active, block.ptr, block)
        pool_increase(st, S_ALLOCATION, is_small, 1)
        pool_increase(st, S_ALLOCATED_BYTES, is_small, block.size)
        pool_increase(st, S_ACTIVE, is_small, 1)
        pool_increase(st, S_ACTIVE_BYTES, is_small, block.size)
        pool_increase(st, S_REQUESTED_BYTES, is_small, orig_size)
        if block.size >= self.policy.max_split_size:
            stat_increase(&st.oversize_allocations, 1)
        if self.recording:                # PyTorch's trace records the request
            self._trace_for(T_ALLOC, block.ptr, orig_size, block.stream, client)
        return block


    cdef inline int _reserve_for_alloc(self, FreeIndex* fi) noexcept nogil:
        """Reserve what handing out one block may need, so that nothing can
        fail half-way: one more active entry, one more size class, and one
        Block for a split remainder (kept in the slab)."""
        if um_reserve(&self.active, self.active.count + 1) != 0:
            return -1
        if um_reserve(&fi.by_size, fi.by_size.count + 1) != 0:
            return -1
        if self.slab.free_list == NULL:
            self.slab.free_list = <Block*>sys_malloc(sizeof(Block))
            if self.slab.free_list == NULL:
                return -1
            self.slab.free_list.next = NULL
        return 0

    cdef inline Block* _malloc_cached(self, size_t orig_size, uintptr_t stream, bint by_handle,
                               unsigned char client, int* status) noexcept nogil:
        """A cache hit, or NULL. ``status`` is set to -1 when host memory for the
        allocator's own bookkeeping ran out. Lock held."""
        cdef size_t size = self._round_size(orig_size)
        cdef bint is_small = size <= self.policy.small_request_max
        cdef FreeIndex* fi = self._pool(stream, is_small)
        status[0] = 0
        if self.unmerged != NULL:             # the pair of one size (_core_pair.pxi)
            if self.unmerged.size == size and self.unmerged.index == fi:
                return _split_again(self, orig_size, by_handle, client, status)
            _merge_deferred(self)
        if fi == NULL or self._reserve_for_alloc(fi) != 0:
            self.last_split = NULL
            status[0] = -1
            return NULL
        cdef Block* b = self._get_free_block(fi, size)
        if b == NULL:
            self.last_split = NULL
            return NULL
        cdef size_t whole = b.size
        b = self._alloc_found_block(b, fi, size, orig_size, by_handle, client)
        # Only for a request of its own: one made by Python that a backend
        # call runs under the lock (depth 2) is followed by the outer miss,
        # which changes the index after it.
        self.last_split = b if b.size != whole and self.lock_depth == 1 and _may_defer_merge(self) else NULL
        return b

    cdef inline void _trace(self, int action, uintptr_t addr, size_t size, uintptr_t stream) noexcept nogil:
        self._trace_for(action, addr, size, stream, CLIENT_NONE)

    cdef inline void _trace_for(self, int action, uintptr_t addr, size_t size, uintptr_t stream,
                                unsigned char client) noexcept nogil:
        """_trace of a block's event: ``client`` is the block's."""
        cdef TraceEvent ev
        ev.action = action
        ev.client = client
        ev.addr = addr
        ev.size = size
        ev.stream = stream
        ev.time_ns = um_now_ns()
        self.trace_buffer.push_back(ev)

    # ------------------------------------------------------------------
    # the segment list (the miss path that makes segments: _core_miss.pxi)
    # ------------------------------------------------------------------
    cdef inline void _link_segment(self, Segment* seg) noexcept nogil:
        seg.prev_seg = NULL
        seg.next_seg = self.segments
        if self.segments != NULL:
            self.segments.prev_seg = seg
        self.segments = seg
        self.segments_by_base[seg.base] = seg

    cdef inline void _unlink_segment(self, Segment* seg) noexcept nogil:
        if seg.prev_seg != NULL:
            seg.prev_seg.next_seg = seg.next_seg
        else:
            self.segments = seg.next_seg
        if seg.next_seg != NULL:
            seg.next_seg.prev_seg = seg.prev_seg
        self.segments_by_base.erase(seg.base)


    # ------------------------------------------------------------------
    # freeing
    # ------------------------------------------------------------------
    cdef size_t _try_merge(self, Block* dst, Block* src, FreeIndex* fi) noexcept nogil:
        if not block_mergeable(src):
            return 0
        fi_remove(fi, src)
        if dst.prev == src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev != NULL:
                dst.prev.next = dst
            else:
                dst.segment.head = dst
        else:
            dst.next = src.next
            if dst.next != NULL:
                dst.next.prev = dst
        cdef size_t subsumed = src.size
        dst.size += subsumed
        block_delete(&self.slab, src)
        return subsumed

    cdef void _free_block(self, Block* b) noexcept nogil:
        """Return a block whose uses are over to its pool, merged with free
        neighbours (PyTorch's free_block)."""
        cdef DeviceStats* st = &self.stats
        cdef FreeIndex* fi = self._pool_of(b)
        cdef size_t original_size = b.size
        cdef size_t requested = b.requested_size
        cdef int64_t net_blocks = 0
        cdef int64_t net_bytes = 0
        cdef size_t subsumed
        cdef bint is_small = b.is_small
        if not self.sleep_marks.empty() and _hold_if_asleep(self, b):
            return                   # its segment sleeps: back at wake_up (_core_sleep.pxi)
        if self.recording:
            self._trace_for(T_FREE_COMPLETED, b.ptr, b.requested_size, b.stream, b.client)
        if self.debug_on:
            memset(<void*>b.ptr, DEBUG_FILL, b.size)
        subsumed = self._try_merge(b, b.prev, fi)
        if subsumed:
            net_blocks -= 1
            net_bytes -= <int64_t>subsumed
        subsumed = self._try_merge(b, b.next, fi)
        if subsumed:
            net_blocks -= 1
            net_bytes -= <int64_t>subsumed
        b.requested_size = 0
        b.client = CLIENT_NONE       # a free block has no client
        fi_insert(fi, b)   # the block's size class was reserved or exists
        if b.prev != NULL or b.next != NULL:
            net_blocks += 1
            net_bytes += <int64_t>b.size
        if self.expandable and b.segment.expandable:   # PyTorch leaves expandable blocks out of
            net_blocks = net_bytes = 0                 # inactive_split (a MemPool's segments are plain)
        self._account_free_merge(is_small, net_blocks, net_bytes, original_size, requested)

    cdef inline void _account_free_merge(self, bint is_small, int64_t net_blocks, int64_t net_bytes,
                                         size_t original_size, size_t requested) noexcept nogil:
        """The statistics of a free: ``net_blocks``/``net_bytes`` change the
        inactive split pieces (merges and the block itself), and the freed
        block of ``original_size`` bytes (``requested`` asked) is no longer active."""
        cdef DeviceStats* st = &self.stats
        if net_blocks > 0:
            pool_increase(st, S_INACTIVE_SPLIT, is_small, net_blocks)
        elif net_blocks < 0:
            pool_decrease(st, S_INACTIVE_SPLIT, is_small, -net_blocks)
        if net_bytes > 0:
            pool_increase(st, S_INACTIVE_SPLIT_BYTES, is_small, net_bytes)
        elif net_bytes < 0:
            pool_decrease(st, S_INACTIVE_SPLIT_BYTES, is_small, -net_bytes)
        pool_decrease(st, S_ACTIVE, is_small, 1)
        pool_decrease(st, S_ACTIVE_BYTES, is_small, original_size)
        pool_decrease(st, S_REQUESTED_BYTES, is_small, requested)

    cdef inline int _reserve_class(self, Block* b) noexcept nogil:
        """Room for the size class a freed (merged) block may need."""
        cdef FreeIndex* fi = self._pool_of(b)
        return um_reserve(&fi.by_size, fi.by_size.count + 1)

    cdef inline int _free_fast(self, uintptr_t ptr, bint by_handle) noexcept nogil:
        """Free an allocated block without stream uses. 0: done; 1: unknown
        pointer; 2: the block needs the slow path (stream events); 3: no host
        memory for the bookkeeping; 4: the block belongs to an Allocation and
        this is not it (or the reverse). Lock held."""
        if self.unmerged != NULL:
            _merge_deferred(self)
        cdef size_t slot = um_find_slot(&self.active, ptr)
        if slot > self.active.mask:
            return 1
        cdef Block* b = <Block*>self.active.vals[slot]
        if b.by_handle != by_handle:
            return 4
        if b.stream_uses != NULL:
            self.last_split = NULL
            return 2
        if self._reserve_class(b) != 0:
            self.last_split = NULL
            return 3
        um_erase_slot(&self.active, slot)
        self._account_free_request(b)
        if _merge_can_wait(self, b):           # the pair of one size (_core_pair.pxi)
            _free_unmerged(self, b)
            return 0
        self.last_split = NULL
        self._free_block(b)
        return 0

    cdef inline void _account_free_request(self, Block* b) noexcept nogil:
        b.allocated = False
        pool_decrease(&self.stats, S_ALLOCATION, b.is_small, 1)
        pool_decrease(&self.stats, S_ALLOCATED_BYTES, b.is_small, b.size)
        if b.size >= self.policy.max_split_size:
            stat_decrease(&self.stats.oversize_allocations, 1)
        if self.recording:
            self._trace_for(T_FREE_REQUESTED, b.ptr, b.requested_size, b.stream, b.client)


    # ------------------------------------------------------------------
    # after the lock: history and out-of-memory reporting
    # ------------------------------------------------------------------
    cdef int _flush_trace(self) except -1:
        """Hand recorded events to the history hook, outside the lock and
        without waiting for another thread's hook (_core_history.pxi).
        Nothing of it runs while no hook is installed (recording is False).

        Not while this thread holds the lock (a free or an allocation made
        by Python that a backend call under the lock ran): the hook never
        runs under it. Those events go with the outer call's."""
        if self.trace_buffer.empty() or self.lock.held_here():
            return 0
        return _deliver_history(self)

    cdef object _out_of_memory(self, object requested, object tried=None):
        """Build (and report) the OutOfMemoryError for a failed request of
        ``requested`` bytes, for which a segment of ``tried`` bytes was asked
        (PyTorch's message names the latter)."""
        return _out_of_memory_error(self, requested, requested if tried is None else tried)


    cdef inline void _update_unusual(self) noexcept nogil:
        self.unusual = (self.poisoned or self.n_pending_events != 0 or not self.deferred_frees.empty()
                        or self.recording
                        or self.debug_on or self.cache_off or not self.routes.empty()
                        or self.sleeping)

    cdef int _check_usable(self) except -1:
        if self.poisoned:
            raise RuntimeError(self.poison_reason)
        return 0

    # ------------------------------------------------------------------
    # the typed entry points (every Python-facing call ends here)
    # ------------------------------------------------------------------
    cdef uintptr_t c_malloc(self, size_t size, uintptr_t stream, bint by_handle=False,
                            unsigned char client=CLIENT_UNIMEM) except? 0:
        """Allocate ``size`` bytes on ``stream``; 0 for size 0. Raises on failure.
        ``by_handle``: the block goes into an Allocation, and only it frees it.
        ``client``: who asks (the block remembers it).
        A cache hit stays in this function; the rest (unusual states, a miss)
        is out of line, so that the hit pays for none of its bookkeeping."""
        cdef Block* b
        cdef int status
        cdef uintptr_t routed
        if size == 0:
            return 0
        if self.unusual:
            routed = _before_unusual_malloc(self, size, stream, by_handle, client)
            if routed != 0:
                return routed
        self._lock_hot()
        b = self._malloc_cached(size, stream, by_handle, client, &status)
        if b == NULL:
            return _malloc_miss(self, size, stream, by_handle, client, status)
        self._unlock()
        if self.unusual:          # history, debug mode (or a hook installed meanwhile)
            _after_malloc(self, b.ptr, size, by_handle)
        return b.ptr


    cdef int _try_free(self, uintptr_t ptr, bint by_handle, bint from_finalizer) except -1:
        """Free a live block. Returns 1 (changing nothing) for an address this
        allocator does not hold, 4 for a block that belongs to an Allocation
        (``by_handle`` False) or to no Allocation (``by_handle`` True). With
        ``from_finalizer`` (a finalizer, or Allocation.release, which runs
        _after_free itself, and with the cache off gives the segment back
        itself, after the free is done) no Python code runs after the free: a finalizer may run
        on a runtime's thread (a SYCL host task) that must not give the GIL up
        half-way; its history events wait in the buffer for the next call from
        Python. At interpreter exit a finalizer does not wait for the lock (a
        daemon thread frozen while holding it would hang the exit): the block
        is then left to the ending process (returns 0)."""
        cdef int rc
        if from_finalizer and _exiting:
            if not self.lock.try_lock():
                return 0
            self.lock_depth += 1
        else:
            self._lock_hot()
        rc = self._free_fast(ptr, by_handle)
        if rc == 2 or rc == 3:
            rc = self._free_slow(ptr, rc)
            if not from_finalizer:
                _drain_inbox(self)      # frees a finalizer made while the events were recorded
        else:
            self._unlock()
        if not from_finalizer and (self.recording or not self.stream_notices.dropped.empty()):
            self._after_free()
        if self.cache_off and rc == 0 and not from_finalizer:
            _give_back_segment_at(self, ptr)
        return rc

    cdef int _free_slow(self, uintptr_t ptr, int rc) except -1:
        """_try_free of a block _free_fast left (``rc`` 2: stream events; 3:
        no host memory for the bookkeeping), the lock held (and let go here)."""
        try:
            if rc == 3:
                raise MemoryError("host memory for the allocator's bookkeeping ran out")
            _free_with_events(self, ptr)
        finally:
            self._unlock()
        return 0

    cdef int _after_free(self) except -1:
        """History and the backend's dropped streams, outside the lock, after a
        free: what raises here (a Ctrl-C) comes after the block went back."""
        if self.recording:
            self._flush_trace()
        if not self.stream_notices.dropped.empty():
            _tell_backend_dropped_streams(self)
        return 0

    cdef int c_free(self, uintptr_t ptr) except -1:
        """Free a pointer from c_malloc. Unknown pointers raise ValueError."""
        if ptr == 0:
            return 0
        cdef int rc = self._try_free(ptr, False, False)
        if rc != 0:
            self._refuse_free(ptr, rc)
        return 0

    cdef int _refuse_free(self, uintptr_t ptr, int rc) except -1:
        """c_free's error for what _try_free would not free (``rc`` 1 or 4)."""
        if rc == 1:
            raise InvalidPointerError(
                f"pointer {ptr:#x} was not allocated by this {self.device_name} "
                f"allocator (device {self.device}), or was already freed")
        if rc == 4:
            raise ValueError(HANDLE_OWNED_MESSAGE.format(ptr))
        return 0

    cdef void c_free_detached(self, uintptr_t ptr) noexcept nogil:
        """Free a pointer from c_malloc on any thread, holding the GIL or not:
        the entry of deleters that run where Python code may not (a SYCL host
        task dropping the last smart pointer to a pool block when the kernels
        using it are done). Nothing is raised: there is no caller to tell.

        Without the GIL it waits for the lock (no thread holding the lock
        waits for the GIL: rule 2 above) and frees a block without stream
        uses at once, so the frees of array memory never wait for Python.
        Nor does such a free ever wait for a queue: a block used on other
        streams, and with the cache off every block (whose segment goes
        back, and the backend's free waits for the segment's queue), is
        kept for the next call from Python's side (_defer_free). The rare
        block that needs Python otherwise (host memory for the bookkeeping)
        takes the GIL after the lock is let go.
        With the GIL it is a finalizer's free. At interpreter exit nothing
        waits: a block whose lock is taken is left to the ending process.
        No Python object lives in this function: Cython would take the GIL
        at its exit to let go of it."""
        cdef int rc
        if _exiting:
            if not self.lock.try_lock():
                return
            self.lock_depth += 1
            self._free_fast(ptr, False)
            self._unlock()
            return
        if PyGILState_Check():
            _free_from_deleter(<void*>self, ptr, True)
            return
        self.lock.lock()
        self.lock_depth += 1
        if self.cache_off:
            rc = _keep_uncached_free(self, ptr)
        else:
            rc = self._free_fast(ptr, False)
            if rc == 2 and _defer_free(self, ptr) == 0:
                rc = 0          # its events are recorded from Python's side (_free_deferred)
        self._unlock()
        if rc == 2 or rc == 3:                  # needs Python (host memory ran out): it waits for no queue
            _free_from_deleter(<void*>self, ptr, False)

    cdef uintptr_t c_malloc_nogil(self, size_t size, uintptr_t stream, unsigned char client, char* error,
                                  size_t error_size) noexcept nogil:
        """c_malloc for callers of C (unimem's C ABI, unimem/_integrations/capi.pyx), on
        any thread, holding the GIL or not. Returns the address (0 for size
        0); on failure 0, with the reason written to ``error`` (``error_size``
        bytes, NUL-terminated). Nothing is raised: there is no Python caller.

        A cache hit takes the lock and nothing else. Without the GIL it
        waits for the lock (no thread holding the lock waits for the GIL:
        rule 2); holding the GIL it only tries the lock (rule 1). A miss on a
        thread without the GIL whose new segment comes from a backend of the
        provider ABI, within every limit, is served without the GIL too
        (_malloc_miss_nogil). Everything else (another miss, an unusual
        state, a request no device holds, the lock held elsewhere while this
        thread has the GIL) is c_malloc with the GIL taken here, after the
        lock is let go. History events of a hit
        wait in the buffer for the next call from Python, as c_free_detached's
        do. At interpreter exit the GIL is never taken: only a hit is served."""
        cdef Block* b
        cdef int status
        cdef bint locked
        cdef bint holding_gil
        if size == 0:
            return 0
        if not self.unusual and size <= MAX_REQUEST:
            holding_gil = PyGILState_Check()
            if _exiting or holding_gil:
                locked = self.lock.try_lock()
            else:
                self.lock.lock()
                locked = True
            if locked:
                self.lock_depth += 1
                if not self.unusual:       # read again under the lock
                    b = self._malloc_cached(size, stream, False, client, &status)
                    if b == NULL and status == 0 and not (holding_gil or _exiting):
                        b = _malloc_miss_nogil(self, size, stream, client)     # a C provider's segment
                    if b != NULL:
                        self._unlock()
                        return b.ptr
                self._unlock()
        if _exiting:
            _copy_error(error, error_size, b"the interpreter is exiting: only cached blocks are handed out")
            return 0
        return _malloc_taking_gil(self, size, stream, client, error, error_size)

    cdef bint c_owns(self, uintptr_t ptr) noexcept:
        self._lock()
        cdef bint found = um_find(&self.active, ptr) != NULL
        self._unlock()
        return found

    # ------------------------------------------------------------------
    # Python API
    # ------------------------------------------------------------------
    cdef int _refuse_huge(self, object n) except -1:
        """A request no device holds goes straight to out-of-memory (the
        policy's arithmetic is never run on it)."""
        if n > MAX_REQUEST:
            if self.poisoned:
                self._check_usable()
            raise self._out_of_memory(n)
        return 0

    def malloc(self, size, stream=0):
        """Allocate ``size`` bytes on ``stream`` and return the address (0 for
        size 0). Raises :class:`OutOfMemoryError` when the device is full."""
        cdef object n = check_size(size)
        cdef uintptr_t s = check_stream(stream)
        self._refuse_huge(n)
        return self.c_malloc(n, s)

    def free(self, ptr):
        """Free the block at ``ptr``. Raises ValueError for an address this
        allocator did not hand out or that was already freed, and for the
        block of an :class:`Allocation` (which frees itself)."""
        self.c_free(check_pointer(ptr))

    def allocate(self, size, stream=0, client=None):
        """Allocate and return an :class:`Allocation` that frees its block when
        it is garbage collected (what array libraries hold on to). Only the
        Allocation can free the block: :meth:`free` refuses its address.
        ``client``: the name (in :data:`CLIENTS`) of the framework the block
        is for, as snapshots and :meth:`memory_allocated_by_client` tell it;
        None: unimem's own."""
        cdef unsigned char who = CLIENT_UNIMEM if client is None else _client_code(client)
        cdef object n = check_size(size)
        cdef uintptr_t s = check_stream(stream)
        self._refuse_huge(n)
        cdef uintptr_t p = self.c_malloc(n, s, True, who)
        return _make_allocation(self, p, n)

    def owns(self, ptr):
        """Whether ``ptr`` is a live allocation of this allocator."""
        try:
            return self.c_owns(check_pointer(ptr))
        except (TypeError, ValueError):
            return False

    def record_stream(self, ptr, stream):
        """Mark the block at ``ptr`` as used on ``stream``: when freed, it is
        reused only after the work queued on ``stream`` by then has completed.

        The backend may check the stream first (``check_stream(stream,
        device)``, optional): a handle that names no stream is refused here,
        not at the free, which could then never happen."""
        return _record_stream(self, ptr, stream)

    def empty_cache(self, stream=None, wait=True):
        """Release all unoccupied cached memory (whole free segments) back to
        the backend, or only ``stream``'s when one is given. Waits for pending
        stream events first (PyTorch's device pools); with ``wait`` False only
        asks about them, and blocks whose stream work is still running stay
        cached (PyTorch's pinned host pool, whose empty_cache waits for no
        event). Either way the backend's free may wait for the work queued
        where the memory was used (the SYCL backends wait on the segment's
        queue, as cudaFree and cudaFreeHost synchronize). With expandable segments, every whole free page is
        unmapped, in the middle of a segment too; the address ranges stay
        reserved (:meth:`empty_virt_addr_cache` releases them)."""
        try:
            return _empty_cache(self, stream, wait)
        finally:
            _drain_inbox(self)

    def sleep(self, offload=True, segments=None, tag=None):
        """Give the memory of every segment back while its addresses stay
        reserved (vLLM's ``CuMemAllocator.sleep``): ``memory_reserved()``
        falls to what is still backed by memory (0 for a whole sleep), and
        allocating raises ``RuntimeError`` until :meth:`wake_up`. With
        ``offload`` the bytes of every live block are first copied to host
        memory, and :meth:`wake_up` copies them back; without, the contents
        are lost. Live blocks stay live at their addresses and may be freed
        meanwhile (their copies are dropped). Free cached memory is given back
        too and mapped again at wake_up, without its contents.

        Needs a backend that can give memory back and keep its addresses:
        expandable segments (the virtual memory calls), else the backend's
        ``release_pages``/``restore_pages``; ``NotImplementedError`` says why
        not. The segments of a private pool with its own allocator
        (``create_pool(pool_id, backend)``) sleep through that allocator's
        ``release_pages``/``restore_pages`` (and copies); one that cannot is
        refused with ``NotImplementedError`` before anything changes, while
        its pool holds a segment. Waits for the device and for stream-ordered
        frees first.

        ``segments``: ``f(address, size, stream) -> bool`` selects the
        segments that sleep (a private pool's); allocation is then not refused
        here (its caller refuses allocation into what sleeps). ``tag`` names
        the sleep for :meth:`wake_up` (segments sleep under one tag at a
        time). Asleep already under ``tag``: nothing is done. See
        ``_core_sleep.pxi`` for what a failure half way leaves."""
        try:
            _sleep(self, offload, segments, tag)
        finally:
            _drain_inbox(self)

    def wake_up(self, tag=None):
        """End the sleep named ``tag``: back every address given back with
        memory again, copy the offloaded bytes back, and allow allocation
        again. Every live block is at the address it had. Awake: nothing is
        done. A failure (the device is full) raises with what was not woken
        still asleep: call it again. With the cache off (set_caching(False)),
        the free memory that comes back goes back to the backend at once."""
        try:
            _wake_up(self, tag)
        finally:
            _drain_inbox(self)
        if self.cache_off:
            self.empty_cache()

    def is_sleeping(self, tag=None):
        """Whether the sleep named ``tag`` is in force."""
        return tag in self.sleep_states

    def empty_virt_addr_cache(self):
        """Release the reserved address ranges of expandable segments that
        hold no mapped page (torch_npu's ``empty_virt_addr_cache``). Call
        :meth:`empty_cache` first to unmap the free pages. Nothing to do
        without expandable segments."""
        try:
            return _empty_virt_addr_cache(self)
        finally:
            _drain_inbox(self)

    def reserved_address_space(self):
        """``{"ranges": n, "bytes": n}``: the address ranges expandable
        segments hold reserved, mapped or not."""
        return _reserved_address_space(self)

    def process_events(self):
        """Move blocks whose stream events completed back to the pool (and
        free the blocks a runtime's thread let go of that wait for other
        streams: _free_deferred)."""
        _process_events_and_deferred(self)

    def _free_as_runtime_thread(self, ptr):
        """Free ``ptr`` as a SYCL runtime's thread does: ``c_free_detached``
        without the GIL (for tests)."""
        cdef uintptr_t p = check_pointer(ptr)
        with nogil:
            self.c_free_detached(p)

    def _stream_count(self):
        """How many streams have pools (for tests)."""
        return self.streams.size()

    def lost_segments(self):
        """Segments whose backend free raised, as ``{"count": n, "bytes": n}``.

        Such a free may have released the memory or not (an interrupt can
        arrive after the driver let go), so the segment is never cached
        again: it is forgotten (it no longer counts as reserved) and counted
        here. Memory a failed free did not release stays with the process."""
        return {"count": self.lost_segment_count, "bytes": self.lost_segment_bytes}

    def set_memory_fraction(self, double fraction):
        """Limit this allocator to ``fraction`` of the device's total memory."""
        return _set_memory_fraction(self, fraction)

    def get_memory_fraction(self):
        """The memory fraction set with :meth:`set_memory_fraction` (1.0 if none)."""
        return self.fraction

    def set_memory_limit(self, limit):
        """Limit this allocator to ``limit`` bytes of the device (0: no limit),
        as ``cupy.cuda.MemoryPool.set_limit(size=...)`` does: a request whose
        segment would pass the limit gets a segment of just its rounded size
        when that fits (CuPy's pool allocates no more than asked)."""
        return _set_memory_limit(self, limit)

    def get_memory_limit(self):
        """The byte limit in force (0: none)."""
        return self.allowed_memory_maximum if self.set_fraction else 0

    def free_block_count(self):
        """How many free blocks the cache holds (``MemoryPool.n_free_blocks``)."""
        cdef size_t n = 0
        cdef StreamTable.iterator it
        self._lock()
        it = self.streams.begin()
        while it != self.streams.end():
            n += deref(it).second.small.n_blocks + deref(it).second.large.n_blocks
            inc(it)
        n += _private_free_block_count(self)
        self._unlock()
        return n

    def set_capacity(self, size_t capacity):
        """Tell the allocator how much memory its device has (0: unknown).

        A request whose segment would not fit even an empty device fails at
        once, without releasing the cache."""
        self._lock()
        self.capacity = capacity
        self._unlock()

    @property
    def capacity(self):
        return self.capacity

    def set_max_allocation_size(self, size_t size):
        """Tell the allocator the largest single allocation its device allows
        (0: no limit known; SYCL devices have one). A request whose segment
        is larger fails at once, without releasing the cache."""
        self._lock()
        self.max_allocation = size
        self._unlock()

    @property
    def max_allocation_size(self):
        return self.max_allocation

    @property
    def settings(self):
        """The allocation policy in force, as PyTorch's option names."""
        return _settings(self)

    def round_size(self, size):
        """The size a request of ``size`` bytes is rounded to."""
        cdef object n = check_size(size)
        if n == 0:
            return 0
        if n > MAX_REQUEST:
            raise ValueError("size too large")
        return self._round_size(n)

    # statistics ---------------------------------------------------------

    def memory_stats(self):
        """All statistics as a flat ``OrderedDict`` sorted by key, with
        PyTorch's key names (see ``torch.cuda.memory_stats``)."""
        values = _stat_values(self)
        return collections.OrderedDict(zip(_SORTED_KEYS, [values[i] for i in _SORTED_ORDER]))

    def memory_allocated(self):
        """Bytes currently handed out (``allocated_bytes.all.current``)."""
        return pool_current(&self.stats, S_ALLOCATED_BYTES)

    def max_memory_allocated(self):
        return self.stats.core[S_ALLOCATED_BYTES][POOL_ALL].peak

    def memory_allocated_by_client(self):
        """``{client: bytes}``: :meth:`memory_allocated` by the framework
        each block was handed out to (names of :data:`CLIENTS`, in that
        order; only those holding memory). The values add up to
        :meth:`memory_allocated`."""
        return _allocated_by_client(self)

    def memory_reserved(self):
        """Bytes held from the backend (``reserved_bytes.all.current``)."""
        return pool_current(&self.stats, S_RESERVED_BYTES)

    def max_memory_reserved(self):
        return self.stats.core[S_RESERVED_BYTES][POOL_ALL].peak

    def backend_timing(self):
        """Time spent in the backend's malloc and free, in microseconds:
        ``{"alloc": {total,max,min,count,avg}, "free": {...}}``."""
        self._lock()
        a = self.stats.device_alloc_time
        f = self.stats.device_free_time
        self._unlock()
        return {"alloc": _duration_dict(a), "free": _duration_dict(f)}


    def reset_peak_stats(self):
        """Reset every "peak" statistic to its current value."""
        self._lock()
        stats_reset_peak(&self.stats)
        self._unlock()

    def reset_accumulated_stats(self):
        """Reset the "allocated"/"freed" histories and the event counters."""
        self._lock()
        stats_reset_accumulated(&self.stats)
        self._unlock()

    # state -------------------------------------------------------------
    def snapshot(self, pool_id=None):
        """The segments and their blocks, in PyTorch's snapshot layout; only
        those of private pool ``pool_id`` (its ``MemPool.id``) when given.
        Memory a sleep gave back is left out (as PyTorch leaves out the
        unmapped parts of an expandable segment), with the live blocks in it:
        the segment sizes add up to ``reserved_bytes.all.current``."""
        return _snapshot_awake(self, pool_id)

    # private pools (MemPool) and the cache switch: _core_pools.pxi ------
    def create_pool(self, pool_id, backend=None, use_on_oom=False, no_split=False):
        """Make private pool ``pool_id`` (a ``(0, n)`` id) with use count 1;
        its segments come from ``backend`` (an allocator with ``malloc`` and
        ``free``) when given."""
        _create_pool(self, pool_id, backend, use_on_oom, no_split)

    def release_pool(self, pool_id):
        """Drop one use of the pool (its MemPool died): at none left, its free
        segments go back, and the rest once their blocks are freed and
        :meth:`empty_cache` runs."""
        try:
            _release_pool(self, pool_id)
        finally:
            _drain_inbox(self)

    def begin_pool(self, pool_id):
        """Route this thread's allocations to the pool (one more use)."""
        _begin_pool(self, pool_id)

    def end_pool(self, pool_id):
        """Stop routing this thread's allocations to the pool (one use less)."""
        try:
            _end_pool(self, pool_id)
        finally:
            _drain_inbox(self)

    def sleep_pool(self, pool_id, offload=True):
        """:meth:`sleep` for the segments of private pool ``pool_id`` (under
        its id as the tag); allocating from the pool raises ``RuntimeError``
        until :meth:`wake_up_pool`. A pool with its own allocator sleeps
        through it; ``NotImplementedError``, nothing changed, where that
        allocator cannot give memory back (or, with ``offload``, copy it)."""
        try:
            _sleep_pool(self, pool_id, offload)
        finally:
            _drain_inbox(self)

    def wake_up_pool(self, pool_id):
        """:meth:`wake_up` of the pool's sleep; allocation from it works again."""
        try:
            _wake_up_pool(self, pool_id)
        finally:
            _drain_inbox(self)

    def pool_use_count(self, pool_id):
        """The pool's use count (0 for a pool this allocator does not have)."""
        return _pool_use_count(self, pool_id)

    def set_caching(self, bint enabled):
        """Turn the cache off (every allocation a segment of its own, given
        back at its free) or on again."""
        try:
            _set_caching(self, enabled)
        finally:
            _drain_inbox(self)

    @property
    def caching(self):
        """Whether the cache is on."""
        return not self.cache_off

    def live_allocations(self):
        """``{address: (size, requested_size, stream)}`` of every live block."""
        return _live_allocations(self)

    # debug mode ----------------------------------------------------------

    def enable_debug(self, site_fn=None):
        """Debug mode: fill free memory with a known byte (DEBUG_FILL, 0xDB) and
        check it on reuse (the backend's memory must be readable by the host). A
        write after free is reported as a WriteAfterFreeWarning naming where the
        memory was last allocated (``site_fn()`` gives the caller's frames).
        Raises NotImplementedError, changing nothing, when the backend does
        not say its memory is ``host_accessible``."""
        if not getattr(self.backend, "host_accessible", False):
            raise NotImplementedError(
                f"debug mode fills free memory and reads it back from the host; the {self.device_name} "
                f"backend ({type(self.backend).__name__}) does not say its memory is host_accessible")
        if site_fn is not None and not callable(site_fn):
            raise TypeError(f"site_fn must be callable or None, got {type(site_fn).__name__}")
        _enable_debug(self, site_fn)

    @property
    def debug(self):
        """Whether debug mode is on."""
        return self.debug_on

    def debug_reports(self):
        """The write-after-free reports of debug mode, oldest first."""
        return list(self.debug_mode.messages) if self.debug_mode is not None else []

    def flush_history(self):
        """Hand the recorded actions still buffered (frees done by finalizers)
        to the history hook now."""
        if self.recording:
            self._flush_trace()

    def set_trace_hook(self, hook):
        """Install ``hook(events)`` to receive the allocator's actions as
        ``(action, address, size, stream, time_ns, client)`` tuples, or None
        to stop. The hook runs on the thread whose operations made the
        events, with the allocator's lock let go; batches of two threads
        may reach it in either order. To keep the allocator's order, the
        hook returns a callable, its commit: commits are called in the
        order the batches were taken (perhaps on another thread)."""
        _set_trace_hook(self, hook)

    def add_oom_observer(self, observer):
        """Call ``observer(device, requested, allocated, reserved, free)`` on
        every out-of-memory error, before it is raised."""
        self.oom_observers.append(observer)

    def remove_oom_observer(self, observer):
        self.oom_observers.remove(observer)

    def _poison(self, reason):
        """Refuse all further allocation (e.g. in a forked child whose device
        context did not survive the fork)."""
        self.poisoned = True
        self._update_unusual()
        self.poison_reason = reason

    cdef bint _lock_for_fork(self):
        """Take the lock before fork(), waiting at most about 0.2 s."""
        cdef bint got
        with nogil:
            got = self.lock.lock_for(200000000)
        if got:
            self.lock_depth += 1
        return got

    def _reset_lock_after_fork(self):
        """In the child: only this thread survived. The lock is free, the
        events another thread was waiting on are pending again, and the
        other threads' uses of pools are over."""
        return _reset_after_fork(self)

    def _lock_held_here(self):
        """Whether this thread holds the allocator's lock (for tests: a
        backend call or a hook that finds it held breaks the core's rule)."""
        return self.lock.held_here()

    def _check_invariants(self):
        """Verify the allocator's internal consistency (for tests): segments
        tile their memory, the free index holds exactly the free blocks, and
        every statistic equals what the blocks say. Raises AssertionError."""
        _check_invariants(self)


include "_core_allocation.pxi"
include "_core_fork.pxi"
