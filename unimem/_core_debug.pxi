# Included by _core.pyx: debug mode (UNIMEM_DEBUG=1). Free memory is filled
# with DEBUG_FILL and checked when it is handed out again; damage is reported
# with the site of the allocation that last owned the changed byte.


cdef class DebugMode:
    """Debug mode's state beside the core's debug_on: where each block was
    last allocated, the damage found under the lock, and the reports."""

    def __cinit__(self, site_fn):
        self.site_fn = site_fn
        self.sites = {}
        self.sequence = 0
        self.messages = []


cdef int _enable_debug(CachingAllocator self, object site_fn) except -1:
    """CachingAllocator.enable_debug, its arguments checked: the state is
    made (or its site function replaced) before the lock, the free blocks
    filled under it."""
    cdef DebugMode mode = self.debug_mode
    if mode is None:
        mode = DebugMode(site_fn)
    else:
        mode.site_fn = site_fn
    self._lock()
    self.debug_mode = mode          # None before, or this very object: nothing freed here
    self.debug_on = True
    self._update_unusual()
    _fill_free_blocks(self)
    self._unlock()
    return 0

cdef void _debug_check(CachingAllocator self, Block* block) noexcept nogil:
    """Debug mode: a block about to be handed out must still hold the fill
    byte everywhere; where it does not, something wrote after free."""
    cdef size_t offset = 0
    cdef size_t chunk
    cdef unsigned char* p = <unsigned char*>block.ptr
    cdef pair[uintptr_t, uintptr_t] damage
    while offset < block.size:
        chunk = block.size - offset
        if chunk > 4096:
            chunk = 4096
        if memcmp(p + offset, debug_fill_page, chunk) != 0:
            while p[offset] == DEBUG_FILL:
                offset += 1
            damage.first = block.ptr
            damage.second = block.ptr + offset
            self.debug_mode.damage.push_back(damage)
            return
        offset += chunk


cdef void _fill_free_blocks(CachingAllocator self) noexcept nogil:
    """Fill every free block (not waiting on a stream) with DEBUG_FILL. Lock held."""
    cdef Segment* seg
    cdef Block* b
    seg = self.segments
    while seg != NULL:
        b = seg.head
        while b != NULL:
            if not b.allocated and b.event_count == 0 and not b.unmapped:
                memset(<void*>b.ptr, DEBUG_FILL, b.size)
            b = b.next
        seg = seg.next_seg


cdef void _debug_after_malloc(CachingAllocator self, uintptr_t ptr, size_t size):
    """Debug mode, after the lock: remember where the block was allocated,
    and report damage found on the way (with the site of the allocation
    that last owned the changed byte)."""
    cdef vector[pair[uintptr_t, uintptr_t]] damage
    cdef DebugMode mode = self.debug_mode
    self._lock()
    damage.swap(mode.damage)
    mode.sequence += 1
    sequence = mode.sequence
    self._unlock()
    frames = mode.site_fn() if mode.site_fn is not None else []
    for entry in damage:
        culprit = None
        for start, (seq, length, site) in mode.sites.items():
            if start <= entry.second < start + length and (culprit is None or seq > culprit[0]):
                culprit = (seq, start, length, site)
        where = ("at " + ", called from ".join(f"{f['filename']}:{f['line']} in {f['name']}"
                                                for f in culprit[3][:3])
                 if culprit is not None and culprit[3] else "at an unknown place")
        message = (f"write after free: the byte at {entry.second:#x} (offset "
                   f"{entry.second - entry.first} of the block handed out at {entry.first:#x}) "
                   f"changed after it was freed; that memory was last allocated "
                   + (f"at {culprit[1]:#x} ({culprit[2]} bytes) " if culprit else "") + where)
        mode.messages.append(message)
        try:
            warnings.warn(WriteAfterFreeWarning(message), stacklevel=3)
        except BaseException as exc:      # warnings turned into errors: still report
            _report_unraisable(exc, "unimem debug mode")
    mode.sites[ptr] = (sequence, size, frames)
