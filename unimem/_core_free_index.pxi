# Included by _core.pyx: adding a block to a free index (the index itself is
# in _native/blocks.pxd). These two live here, not in the .pxd, because a
# .pxd holds inline functions only, and the rare path (a size class made on
# first use) must stay out of line: inlined, it made fi_insert too big to be
# inlined itself, and the call cost the hot path ~70 instructions a pair.

cdef inline int fi_insert(FreeIndex* fi, Block* b) noexcept nogil:
    """Add a free block. Returns -1 (and changes nothing) when out of host memory."""
    cdef SizeClass* sc = <SizeClass*>um_find(&fi.by_size, b.size)
    if sc == NULL:
        sc = fi_new_class(fi, b.size)
        if sc == NULL:
            return -1
    elif sc.heap.empty():
        fi.n_empty_classes -= 1
    heap_push(sc, b)
    b.size_class = sc
    b.gc_count_base = fi.get_free_blocks_call_count
    fi.n_blocks += 1
    return 0


cdef SizeClass* fi_new_class(FreeIndex* fi, size_t size) noexcept nogil:
    """A new (empty) size class for ``size``; NULL when out of host memory."""
    if um_reserve(&fi.by_size, fi.by_size.count + 1) != 0:
        return NULL
    cdef SizeClass* sc = new SizeClass()
    sc.size = size
    fi.classes[size] = sc
    um_put_unchecked(&fi.by_size, size, sc)
    return sc
