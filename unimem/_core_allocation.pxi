# Included by _core.pyx (after CachingAllocator): Allocation handles, a
# block that frees itself when its last user lets go.


@cython.no_gc_clear     # __dealloc__ frees through self.allocator: a collected cycle must not clear it first
cdef class Allocation:
    """A live block, freed when this object is garbage collected (or at
    :meth:`release`). Array libraries keep one alive for as long as any array
    views the memory.

    Attributes: ``ptr`` (address), ``size`` (bytes requested), ``allocator``,
    ``block_size`` (the block's rounded size).
    """

    @property
    def block_size(self):
        """The size of the block: ``size`` rounded as the allocator rounds
        requests (0 for an empty allocation)."""
        return self.allocator._round_size(self.size) if self.size else 0

    def __dealloc__(self):
        cdef uintptr_t ptr = self.ptr
        if ptr != 0 and self.allocator is not None:
            self.ptr = 0
            try:
                if self.allocator._try_free(ptr, True, True) != 0:
                    raise ValueError(f"the block at {ptr:#x} was freed behind its Allocation's back")
                _give_back_segment_at(self.allocator, ptr)     # with the cache off
            except BaseException as exc:
                _report_unraisable(exc, "unimem Allocation finalizer")

    def release(self):
        """Free the block now; later calls do nothing."""
        cdef uintptr_t ptr = self.ptr
        if ptr != 0:
            self.ptr = 0
            try:
                rc = self.allocator._try_free(ptr, True, True)   # no Python code after the free
            except BaseException:
                self.ptr = ptr          # not freed (an event could not be recorded): still ours
                raise
            if rc != 0:
                raise ValueError(f"the block at {ptr:#x} was freed behind its Allocation's back")
            # With the cache off the segment goes back, once the handle is
            # empty: a backend free that raises (a Ctrl-C) comes after the
            # free, which stays done.
            _give_back_segment_at(self.allocator, ptr)
            self.allocator._after_free()    # a Ctrl-C here leaves the handle empty, as it should

    def __int__(self):
        return self.ptr

    def __index__(self):
        return self.ptr

    def __repr__(self):
        return (f"<unimem.Allocation {self.size} bytes at {self.ptr:#x} on "
                f"{self.allocator.device_name}:{self.allocator.device}>")


cdef Allocation _make_allocation(CachingAllocator allocator, uintptr_t ptr, size_t size):
    cdef Allocation a = Allocation.__new__(Allocation)
    a.allocator = allocator
    a.ptr = ptr
    a.size = size
    return a
