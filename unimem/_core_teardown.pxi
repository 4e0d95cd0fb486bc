# Included by _core.pyx: what the allocator gives back when it dies.


cdef object _give_back_free_segments(CachingAllocator self):
    """CachingAllocator.__del__: the wholly free segments go back to the
    backend."""
    # Wholly free segments go back to the backend. This is a finalizer
    # (tp_finalize), not __dealloc__: when the allocator dies in a
    # reference cycle, finalizers run before the collector clears the
    # objects of the cycle, so the backend is still whole here. Segments
    # with live blocks stay: raw addresses from malloc() may still be in
    # use. At interpreter exit nothing is returned (the process is ending,
    # and the device runtime may already be shutting down).
    # Asleep, memory given back stays so (the address ranges with it):
    # waking up could fail, and the allocator is going.
    if self.unmerged != NULL:      # a whole segment must look whole (_core_pair.pxi)
        _merge_deferred(self)
    if self.poisoned or _interpreter_exiting() or self.sleep_states:
        return
    if self.releasing_bytes:
        # Pages of holes waiting for their stream's work go now, through
        # unmap_pages (which waits for the device where it must): their
        # events are not waited for after this.
        try:
            _unmap_held_now(self)
        except BaseException as exc:
            _report_unraisable(exc, "unimem allocator teardown")
    cdef Segment* seg = self.segments
    cdef Segment* nxt
    cdef Block* b
    cdef Block* bn
    while seg != NULL:
        nxt = seg.next_seg
        if seg.expandable:
            if _expandable_teardown(self, seg):
                self._unlink_segment(seg)
                b = seg.head
                while b != NULL:
                    bn = b.next
                    block_delete(&self.slab, b)
                    b = bn
                sys_free(seg)
        elif _segment_is_free(self, seg):
            _detach_segment(self, seg)
            try:
                _backend_free(self, seg.base, seg.size, seg.stream, False, _segment_free_fn(self, seg))
            except BaseException as exc:
                _report_unraisable(exc, "unimem allocator teardown")
            block_delete(&self.slab, seg.head)
            sys_free(seg)
        seg = nxt
