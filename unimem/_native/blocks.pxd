# Blocks, segments, and the free-block index of one (stream, pool).
#
# Why the free-block index looks the way it does: PyTorch keeps free blocks in a
# ``std::set`` ordered by (size, address). We keep, per stream and pool, one
# *size class* per distinct block size (a min-heap of blocks by address), found in
# O(1) through a hash table, plus an ordered map of the sizes for the best fit
# when the exact size is not cached. The answer is the same block PyTorch would
# pick; an exact-size hit, the common case in training loops, costs no tree walk
# however many different sizes are cached.
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc as sys_malloc, free as sys_free, calloc
from libc.string cimport memset
from libcpp.vector cimport vector
from libcpp.map cimport map as cmap
from libcpp.utility cimport pair
from libcpp.unordered_map cimport unordered_map

from unimem._native.addr_map cimport (U64Map, um_init, um_destroy, um_find, um_pop,
                                      um_put_unchecked, um_reserve)

cdef struct Segment
cdef cppclass FreeIndex
cdef cppclass SizeClass
cdef cppclass PrivatePool

cdef struct Block:
    uintptr_t ptr
    size_t size
    size_t requested_size
    uintptr_t stream               # the stream the block was allocated on
    Block* prev                    # neighbours inside the same segment
    Block* next
    Segment* segment
    FreeIndex* index               # the free index of its stream and pool
    vector[uintptr_t]* stream_uses # other streams that used it (record_stream)
    int64_t gc_count_base          # pool's get_free_block count when it was freed
    size_t heap_pos                # position in its size class while free
    SizeClass* size_class          # its size class while free (no lookup to take it out)
    int event_count                # outstanding stream events before reuse
    bint allocated
    bint is_small
    bint by_handle                 # handed out inside an Allocation: only it may free it
    # Expandable segments: a span of the reserved range with no memory behind
    # it (never in the free index, never merged with a mapped block); lost:
    # its unmap failed, so it is neither memory nor reusable address space.
    bint unmapped
    # (lost, releasing and client are bytes: with them the struct stays 120
    # bytes, as it was before releasing came; the typed core pair measured 6%
    # slower at 128; tests/core/history/test_block_clients.py checks the size)
    unsigned char lost
    # Whole free pages split off a hole to unmap (max_reserved_ratio), held
    # (event_count 1) until the work queued on their stream before the split
    # has completed: then unmapped without waiting (_core_holes.pxi).
    unsigned char releasing
    # Who asked for it (a Client below), set when it is handed out, kept
    # while its free waits on a stream, CLIENT_NONE once it is free.
    unsigned char client

# The framework whose entry point a block was handed out through
# (Block.client); unimem._core.CLIENTS names them, in this order.
cdef enum Client:
    CLIENT_NONE = 0                # no one: never handed out
    CLIENT_UNIMEM = 1              # unimem's own functions (caching_allocator_alloc, allocate, xpu.empty, ...)
    CLIENT_TORCH = 2               # PyTorch's pluggable allocator (unimem_torch_* of the C ABI)
    CLIENT_CUPY = 3                # unimem.cuda.allocator (cupy.cuda.set_allocator)
    CLIENT_DPNP = 4                # dpnp's arrays (the dpctl.memory hook) and its C++ scratch (the SYCL interposer)
    CLIENT_NUMBA = 5               # Numba's EMM plugin
    CLIENT_C = 6                   # C code through unimem.h
    N_CLIENTS = 7


cdef struct Segment:
    uintptr_t base
    size_t size
    uintptr_t stream
    bint is_small
    Block* head
    # Expandable segments: ``size`` is the reserved range, mapped and
    # unmapped in ``page``-byte pages (offsets from ``base``); ``mapped``
    # bytes of it have memory behind them.
    bint expandable
    size_t page
    size_t mapped
    # Some span was mapped by the backend's (smaller) granularity to stay
    # within a memory limit, so free spans are unmapped by it too.
    bint finely_mapped
    PrivatePool* pool              # the private pool (MemPool) it serves; NULL: the device's own
    Segment* prev_seg              # the allocator's list of all segments
    Segment* next_seg


# A pool of Block structs: splitting and merging on the hot path must not call
# malloc/free. Blocks are recycled through a singly linked free list.
cdef struct BlockSlab:
    Block* free_list

cdef inline Block* block_new(BlockSlab* slab) noexcept nogil:
    cdef Block* b = slab.free_list
    if b != NULL:
        slab.free_list = b.next
    else:
        b = <Block*>sys_malloc(sizeof(Block))
        if b == NULL:
            return NULL
    memset(b, 0, sizeof(Block))
    return b

cdef inline void block_delete(BlockSlab* slab, Block* b) noexcept nogil:
    if b.stream_uses != NULL:
        del b.stream_uses
        b.stream_uses = NULL
    b.next = slab.free_list
    slab.free_list = b

cdef inline bint block_mergeable(Block* b) noexcept nogil:
    """Whether a block being freed takes ``b``, its neighbour, in (PyTorch's
    free_block): free, no stream events or uses pending, and mapped."""
    return (b != NULL and not b.allocated and b.event_count == 0 and b.stream_uses == NULL
            and not b.unmapped)

cdef inline void slab_destroy(BlockSlab* slab) noexcept nogil:
    cdef Block* b = slab.free_list
    cdef Block* n
    while b != NULL:
        n = b.next
        sys_free(b)
        b = n
    slab.free_list = NULL



cdef cppclass SizeClass:
    size_t size
    vector[Block*] heap            # a min-heap of free blocks by address

cdef cppclass FreeIndex:
    cmap[size_t, SizeClass*] classes   # every size class, ordered by size
    U64Map by_size                     # size -> SizeClass*, for O(1) exact hits
    size_t n_blocks
    size_t n_empty_classes
    int64_t get_free_blocks_call_count # for garbage collection ages
    bint is_small
    # Expandable segments: the unmapped spans of the pool's ranges, by
    # address (PyTorch's BlockPool.unmapped), where a miss looks for room.
    cmap[uintptr_t, Block*] unmapped

cdef inline bint addr_less(Block* a, Block* b) noexcept nogil:
    return a.ptr < b.ptr

cdef inline void heap_sift_up(vector[Block*]* h, size_t i) noexcept nogil:
    cdef Block* item = h[0][i]
    cdef size_t parent
    while i > 0:
        parent = (i - 1) >> 1
        if not addr_less(item, h[0][parent]):
            break
        h[0][i] = h[0][parent]
        h[0][i].heap_pos = i
        i = parent
    h[0][i] = item
    item.heap_pos = i

cdef inline void heap_sift_down(vector[Block*]* h, size_t i) noexcept nogil:
    cdef size_t n = h.size()
    cdef Block* item = h[0][i]
    cdef size_t child
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and addr_less(h[0][child + 1], h[0][child]):
            child += 1
        if not addr_less(h[0][child], item):
            break
        h[0][i] = h[0][child]
        h[0][i].heap_pos = i
        i = child
    h[0][i] = item
    item.heap_pos = i

cdef inline void heap_push(SizeClass* sc, Block* b) noexcept nogil:
    sc.heap.push_back(b)
    heap_sift_up(&sc.heap, sc.heap.size() - 1)

cdef inline void heap_remove(SizeClass* sc, Block* b) noexcept nogil:
    cdef size_t i = b.heap_pos
    cdef Block* last = sc.heap.back()
    sc.heap.pop_back()
    if last == b:
        return
    sc.heap[i] = last
    last.heap_pos = i
    heap_sift_up(&sc.heap, i)
    heap_sift_down(&sc.heap, last.heap_pos)

cdef inline FreeIndex* fi_new(bint is_small) noexcept nogil:
    cdef FreeIndex* fi = new FreeIndex()
    if um_init(&fi.by_size, 6) != 0:
        del fi
        return NULL
    fi.n_blocks = 0
    fi.n_empty_classes = 0
    fi.get_free_blocks_call_count = 0
    fi.is_small = is_small
    return fi

cdef inline void fi_delete(FreeIndex* fi) noexcept nogil:
    cdef pair[size_t, SizeClass*] entry
    for entry in fi.classes:
        del entry.second
    um_destroy(&fi.by_size)
    del fi

cdef extern from *:
    """
    template <class It> static inline auto um_second(It it) { return it->second; }
    template <class It> static inline It um_next(It it) { return ++it; }
    template <class It> static inline It um_prev(It it) { return --it; }
    """
    SizeClass* um_second(cmap[size_t, SizeClass*].iterator it) nogil
    cmap[size_t, SizeClass*].iterator um_next(cmap[size_t, SizeClass*].iterator it) nogil
    cmap[uintptr_t, Segment*].iterator _map_prev "um_prev"(cmap[uintptr_t, Segment*].iterator it) nogil

cdef inline void fi_sweep_empty(FreeIndex* fi) noexcept nogil:
    """Drop size classes that have stayed empty (they are kept for a while so
    that an alloc/free pair of one size does not create and destroy one)."""
    cdef cmap[size_t, SizeClass*].iterator it = fi.classes.begin()
    cdef SizeClass* sc
    while it != fi.classes.end():
        sc = um_second(it)
        if sc.heap.empty():
            um_pop(&fi.by_size, sc.size)
            del sc
            it = fi.classes.erase(it)
        else:
            it = um_next(it)
    fi.n_empty_classes = 0

cdef inline void fi_remove(FreeIndex* fi, Block* b) noexcept nogil:
    fi_remove_from(fi, b.size_class, b)

cdef inline void fi_remove_from(FreeIndex* fi, SizeClass* sc, Block* b) noexcept nogil:
    heap_remove(sc, b)
    fi.n_blocks -= 1
    if sc.heap.empty():
        fi.n_empty_classes += 1
        if fi.n_empty_classes > 64 and fi.n_empty_classes > 2 * (fi.classes.size() - fi.n_empty_classes):
            fi_sweep_empty(fi)

cdef inline Block* fi_best_fit(FreeIndex* fi, size_t size, SizeClass** found) noexcept nogil:
    """The smallest free block of at least ``size`` bytes, lowest address
    first; ``found`` receives its size class."""
    cdef SizeClass* sc = <SizeClass*>um_find(&fi.by_size, size)
    if sc != NULL and not sc.heap.empty():
        found[0] = sc
        return sc.heap[0]
    if fi.n_blocks == 0:
        return NULL
    cdef cmap[size_t, SizeClass*].iterator it = fi.classes.upper_bound(size)
    while it != fi.classes.end():
        sc = um_second(it)
        if not sc.heap.empty():
            found[0] = sc
            return sc.heap[0]
        it = um_next(it)
    return NULL


# The free indexes of one stream. They live while the stream has segments:
# a program that uses many short-lived streams (a queue per task) must not
# keep an index per stream it ever saw.
cdef struct StreamPools:
    uintptr_t stream
    FreeIndex* small
    FreeIndex* large
    size_t n_segments
    size_t n_stream_uses           # live blocks of any stream that record_stream named it on
    # In the device's own table: segments of private pools on this stream
    # (the stream, and what the backend keeps for it, stays while they live).
    size_t n_private_segments

ctypedef unordered_map[uintptr_t, StreamPools*] StreamTable

cdef inline void stream_pools_delete(StreamPools* sp) noexcept nogil:
    if sp.small != NULL:
        fi_delete(sp.small)
    if sp.large != NULL:
        fi_delete(sp.large)
    sys_free(sp)

cdef inline StreamPools* stream_pools_new(uintptr_t stream) noexcept nogil:
    """Empty free indexes for ``stream``; NULL when host memory ran out."""
    cdef StreamPools* sp = <StreamPools*>calloc(1, sizeof(StreamPools))
    if sp == NULL:
        return NULL
    sp.stream = stream
    sp.small = fi_new(True)
    sp.large = fi_new(False)
    if sp.small == NULL or sp.large == NULL:
        stream_pools_delete(sp)
        return NULL
    return sp


# A private pool (PyTorch's PrivatePool behind torch.cuda.MemPool): its own
# free indexes by stream, inside the device's allocator. Its segments serve
# only its allocations; they count in the device's statistics and limits.
cdef cppclass PrivatePool:
    uint64_t id                    # MemPool.id is (0, id)
    StreamTable streams            # its free indexes, by stream
    int use_count                  # the MemPool object, plus each use_mem_pool context
    size_t n_segments              # its segments (PyTorch's cudaMalloc_count)
    bint use_on_oom                # a default-pool request about to fail may take its free blocks
    bint no_split                  # its blocks are handed out whole
    bint has_backend               # its segments come from its own allocator (pool_backends)
    bint sleeping                  # MemPool.sleep: allocation into it is refused
