cimport cython
# The caching core's interface: what other Cython modules (the runtime's
# device registry, benchmark loops) may cimport. The state machine itself is
# in _core.pyx; its data structures in unimem/_native/.
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp.map cimport map as cmap
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from unimem._native.addr_map cimport U64Map
from unimem._native.blocks cimport Block, FreeIndex, Segment, BlockSlab, PrivatePool, StreamPools, StreamTable
from unimem._native.policy cimport K_ROUNDUP_INTERVALS, Policy
from unimem._native.provider cimport RawAllocatorAPI
from unimem._native.stats cimport DeviceStats, TraceEvent
from unimem._native.stream_events cimport UMStreamEvents
from unimem._native.stream_notices cimport UMStreamNotices

cdef extern from "csupport.hpp" nogil:
    cppclass UMLock:
        bint try_lock()
        bint held_here()
        bint lock_for(int64_t timeout_ns)
        void lock()
        void unlock()
        void reset_after_fork()


# no_gc_clear: __dealloc__ needs the backend. When an allocator dies in a
# reference cycle, the collector would otherwise clear its references first.
# final: cdef methods are called directly (and inlined), not through a vtable.
@cython.final
cdef class HistoryDelivery:
    cdef readonly object hook
    cdef object committing                # threading.Lock, never waited for: who runs the commits
    cdef dict ready                       # batch number -> its commit (or None), prepared
    cdef uint64_t taken                   # batches taken from the buffer so far
    cdef uint64_t committed               # the next batch whose commit runs


@cython.final
cdef class DebugMode:
    cdef object site_fn                   # () -> frames of the caller
    cdef dict sites                       # block address -> (sequence, size, frames)
    cdef int64_t sequence
    cdef vector[pair[uintptr_t, uintptr_t]] damage   # (block, first changed byte), found under the lock
    cdef list messages


@cython.no_gc_clear
@cython.final
cdef class CachingAllocator:
    cdef readonly object backend
    cdef readonly int device
    cdef readonly str device_name
    cdef object _py_malloc
    cdef object _py_free
    cdef RawAllocatorAPI _raw
    cdef bint _has_raw
    cdef object _raw_owner            # keeps the C context behind _raw alive

    cdef Policy policy                    # the allocation policy's settings (_native/policy.pxd)
    cdef double fraction
    cdef bint set_fraction
    cdef size_t allowed_memory_maximum
    cdef size_t capacity                  # the device's total memory, 0 if unknown
    cdef size_t max_allocation            # the device's largest single allocation, 0 if unknown

    # state
    cdef UMLock lock
    cdef DeviceStats stats
    cdef size_t total_allocated_memory    # bytes held from the backend
    cdef U64Map active                    # address -> allocated Block
    cdef StreamTable streams              # stream handle -> its free indexes
    cdef StreamPools* last_pools          # the last stream used (most calls use one)
    cdef Segment* segments                # doubly linked list of all segments
    cdef cmap[uintptr_t, Segment*] segments_by_base   # to refuse overlapping memory
    cdef bint expandable                  # expandable_segments:True (_core_expandable.pxi)
    cdef size_t vm_granularity            # the backend's mapping granularity then
    cdef size_t in_use_high_water         # what max_reserved_ratio bounds then (_core_holes.pxi)
    cdef object _vm_reserve               # the backend's virtual-memory calls then
    cdef object _vm_map
    cdef object _vm_unmap
    cdef object _vm_release
    cdef bint limit_in_bytes              # set_memory_limit (CuPy's set_limit), not a fraction
    cdef int64_t lost_segment_count       # segments whose backend free failed (forgotten)
    cdef int64_t lost_segment_bytes
    cdef BlockSlab slab
    cdef size_t n_pending_events          # in all the queues: stream_events.count (_core_event_queue.pxi)
    cdef vector[uintptr_t] deferred_frees   # freed on a runtime's thread, needing Python: events, or the cache off (_core_streams.pxi)

    # private pools (MemPool) and the cache switch: _core_pools.pxi
    cdef cmap[uint64_t, PrivatePool*] private_pools   # by id (creation order)
    cdef dict pool_backends               # pool id -> the allocator its segments come from
    cdef unordered_map[unsigned long, vector[PrivatePool*]] routes   # thread -> pools in use, innermost last
    cdef bint cache_off                   # caching_allocator_enable(False)

    # history and observers
    cdef bint recording
    cdef vector[TraceEvent] trace_buffer
    cdef HistoryDelivery history          # the hook and its batches (_core_history.pxi), or None
    cdef list oom_observers
    cdef bint poisoned
    cdef str poison_reason
    # Anything above that sends c_malloc off its fastest path (poisoned,
    # stream events pending, history recording, debug mode, asleep): one test.
    cdef bint unusual
    # How many times this thread holds the (recursive) lock: segments are
    # given back outside it only when it is held once.
    cdef int lock_depth
    # The alloc/free pair of one size without the free index (_core_pair.pxi):
    # the block the last cache hit split off, while nothing else has happened
    # since; and that block once freed, its merge with the rest put off.
    cdef Block* last_split
    cdef Block* unmerged

    # debug mode: free memory is filled and checked on reuse (_core_debug.pxi)
    cdef bint debug_on
    cdef DebugMode debug_mode           # its sites and reports, made at enable_debug

    # sleep mode (_core_sleep.pxi)
    cdef bint sleeping                      # the whole device asleep: allocation refused
    cdef unsigned long sleep_busy           # the thread whose sleep() or wake_up() is under way, or 0
    cdef cmap[uintptr_t, uintptr_t] sleep_marks   # sleeping Segment* -> its sleep
    cdef vector[Block*] sleep_held          # their blocks that were free, off the free index
    cdef vector[Block*] sleep_freed         # their blocks freed since, back at wake_up
    cdef dict sleep_states                  # tag -> the sleep's state

    # expandable segments' stream-ordered release (_core_holes.pxi); last, so
    # that the hot fields above keep their offsets (the typed core pair
    # measured 6% slower with these two among them)
    cdef object _vm_unmap_idle              # unmap_idle_pages, or None
    cdef size_t releasing_bytes             # mapped bytes of holes waiting to be unmapped
    cdef UMStreamEvents stream_events       # each stream's events waited for, in order (_core_event_queue.pxi)
    # Segments being asked of the backend with the lock let go (_alloc_block),
    # and expandable segments' virtual memory calls (_call_out: a map's bytes):
    # counted against the limits meanwhile, so that two misses cannot pass
    # them together.
    cdef size_t in_flight_bytes
    cdef vector[pair[unsigned long, uint64_t]] in_flight_calls   # (thread, number) of each call
    cdef uint64_t in_flight_numbered        # calls numbered so far
    # What the backend is told about streams, with the lock let go (_core_stream_notices.pxi)
    cdef UMStreamNotices stream_notices
    cdef object __weakref__

    cdef inline void _lock(self) noexcept
    cdef inline void _lock_hot(self) noexcept
    cdef inline void _unlock(self) noexcept nogil
    cdef inline size_t _round_size(self, size_t size) noexcept nogil
    cdef inline bint _should_split(self, Block* b, size_t size) noexcept nogil
    cdef inline bint _gc_enabled(self) noexcept nogil
    cdef inline FreeIndex* _pool(self, uintptr_t stream, bint is_small) noexcept nogil
    cdef StreamPools* _stream_pools(self, uintptr_t stream) noexcept nogil
    cdef void _drop_stream_if_unused(self, StreamPools* sp) noexcept nogil
    cdef void _drop_unused_streams(self) noexcept nogil
    cdef inline FreeIndex* _pool_of(self, Block* b) noexcept nogil
    cdef Block* _get_free_block(self, FreeIndex* fi, size_t size) noexcept nogil
    cdef Block* _alloc_found_block(self, Block* block, FreeIndex* fi, size_t size,
                                   size_t orig_size, bint by_handle, unsigned char client) noexcept nogil
    cdef inline int _reserve_for_alloc(self, FreeIndex* fi) noexcept nogil
    cdef inline Block* _malloc_cached(self, size_t orig_size, uintptr_t stream, bint by_handle,
                               unsigned char client, int* status) noexcept nogil
    cdef inline void _trace(self, int action, uintptr_t addr, size_t size, uintptr_t stream) noexcept nogil
    cdef inline void _link_segment(self, Segment* seg) noexcept nogil
    cdef inline void _unlink_segment(self, Segment* seg) noexcept nogil
    cdef size_t _try_merge(self, Block* dst, Block* src, FreeIndex* fi) noexcept nogil
    cdef void _free_block(self, Block* b) noexcept nogil
    cdef inline int _reserve_class(self, Block* b) noexcept nogil
    cdef inline int _free_fast(self, uintptr_t ptr, bint by_handle) noexcept nogil
    cdef inline Block* _hand_out(self, Block* block, size_t orig_size, bint by_handle,
                                 unsigned char client) noexcept nogil
    cdef inline void _account_free_merge(self, bint is_small, int64_t net_blocks, int64_t net_bytes,
                                         size_t original_size, size_t requested) noexcept nogil
    cdef inline void _account_free_request(self, Block* b) noexcept nogil
    cdef int _flush_trace(self) except -1
    cdef object _out_of_memory(self, object requested, object tried=*)
    cdef inline void _update_unusual(self) noexcept nogil
    cdef int _check_usable(self) except -1
    # client: who asks (a Client of _native/blocks.pxd; CLIENT_UNIMEM unless given)
    cdef uintptr_t c_malloc(self, size_t size, uintptr_t stream, bint by_handle=*,
                            unsigned char client=*) except? 0
    cdef int _try_free(self, uintptr_t ptr, bint by_handle, bint from_finalizer) except -1
    cdef int _after_free(self) except -1
    cdef int _free_slow(self, uintptr_t ptr, int rc) except -1
    cdef int c_free(self, uintptr_t ptr) except -1
    cdef int _refuse_free(self, uintptr_t ptr, int rc) except -1
    cdef void c_free_detached(self, uintptr_t ptr) noexcept nogil
    cdef bint c_owns(self, uintptr_t ptr) noexcept
    cdef int _refuse_huge(self, object n) except -1
    cdef bint _lock_for_fork(self)
    # Last, so that the methods above keep their places in the vtable.
    cdef uintptr_t c_malloc_nogil(self, size_t size, uintptr_t stream, unsigned char client, char* error,
                                  size_t error_size) noexcept nogil
    cdef inline void _trace_for(self, int action, uintptr_t addr, size_t size, uintptr_t stream,
                                unsigned char client) noexcept nogil


@cython.no_gc_clear
cdef class Allocation:
    cdef readonly CachingAllocator allocator
    cdef readonly uintptr_t ptr
    cdef readonly size_t size


