# Included by _core.pyx: the alloc/free pair of one size, without the free
# index (issue 25).
#
# A training loop allocates and frees the same sizes over and over. A cache
# hit takes a free block B, splits it into the block handed out (b) and the
# rest (r), and puts r in the free index; freeing b merges it with r, takes
# r out of the index and puts B back. The next request of the same size does
# it all again: half of the pair's work undoes the other half.
#
# Here that work is put off while it cannot change an answer:
#
# * ``last_split``: the block the last cache hit split off, as long as
#   nothing else has happened since (every other operation clears it).
# * Freeing ``last_split`` does the statistics of the merge with r, but not
#   the merge: b stays out of the index, r stays in it (``unmerged``).
# * The next request of b's size on b's stream and pool takes b back. That is
#   exact: nothing has happened since B was the best fit for that size (the
#   index is as it was then, B in it), so PyTorch's policy picks B again and
#   splits it into the same b and r. The statistics are those of that split.
# * Anything else first does the merge that was put off (_merge_deferred),
#   so that it sees the index and the segments exactly as PyTorch's would be:
#   every lock taken (_lock: snapshots, statistics, empty_cache, threads),
#   any other request (_malloc_cached), any free (_free_fast), and teardown.
#
# It is only done where nothing else reads a block's state at the free: not
# with history recording, debug mode, stream events, sleep, private-pool
# routes or the cache off (``unusual``), not with expandable segments (their
# best fit prefers mapped memory) and not with garbage collection (it ages
# blocks by the calls of the best fit).


cdef inline bint _may_defer_merge(CachingAllocator self) noexcept nogil:
    """Whether a cache hit's split may be undone and redone without the
    index (see above): checked when the split is made."""
    return not (self.unusual or self.expandable or self._gc_enabled() or not self.sleep_marks.empty())


cdef inline bint _merge_can_wait(CachingAllocator self, Block* b) noexcept nogil:
    """Whether freeing ``b`` may put its merge off: it is the block the last
    cache hit split off, nothing has happened since, and the free block after
    it (the rest of that split) is the only neighbour it merges with."""
    if b != self.last_split or self.lock_depth > 1:   # (depth > 1: never set there; a guard)
        return False
    return block_mergeable(b.next) and not block_mergeable(b.prev)


cdef inline void _free_unmerged(CachingAllocator self, Block* b) noexcept nogil:
    """_free_block for a block whose merge with the free block after it is
    put off: the statistics of that merge (PyTorch's free_block), b left out
    of the index."""
    cdef Block* rest = b.next
    cdef size_t requested = b.requested_size
    b.requested_size = 0
    if b.prev != NULL or rest.next != NULL:   # the merged block is a piece of its segment
        self._account_free_merge(b.is_small, 0, <int64_t>b.size, b.size, requested)
    else:
        self._account_free_merge(b.is_small, -1, -<int64_t>rest.size, b.size, requested)
    self.unmerged = b


cdef inline Block* _split_again(CachingAllocator self, size_t orig_size, bint by_handle,
                                unsigned char client, int* status) noexcept nogil:
    """Hand the unmerged block out again, for a request of its size on its
    stream and pool: what splitting the merged block would do, statistics
    included (_alloc_found_block). NULL with ``status`` -1 when host memory
    for the bookkeeping ran out (the block stays unmerged)."""
    cdef Block* b = self.unmerged
    if um_reserve(&self.active, self.active.count + 1) != 0:
        status[0] = -1
        return NULL
    self.unmerged = NULL
    cdef Block* rest = b.next
    if b.prev != NULL or rest.next != NULL:   # the merged block was already split
        pool_decrease(&self.stats, S_INACTIVE_SPLIT_BYTES, b.is_small, b.size)
    else:
        pool_increase(&self.stats, S_INACTIVE_SPLIT_BYTES, b.is_small, rest.size)
        pool_increase(&self.stats, S_INACTIVE_SPLIT, b.is_small, 1)
    return self._hand_out(b, orig_size, by_handle, client)


cdef void _merge_deferred(CachingAllocator self) noexcept nogil:
    """Do the merge a free put off, before anything else looks at the
    index: the unmerged block takes in the free block after it and goes back
    in the index (its size class was reserved when it was freed)."""
    cdef Block* b = self.unmerged
    self.unmerged = NULL
    self.last_split = NULL
    self._try_merge(b, b.next, b.index)
    b.client = CLIENT_NONE           # (as _free_block's)
    fi_insert(b.index, b)
