# Included by _core.pyx: sleep mode and private pools (MemPool.sleep, and
# the pools a whole-device sleep meets).
#
# A MemPool made with its own allocator (MemPool(allocator=...): the core's
# create_pool(pool_id, backend), pool_backends) gets its segments from that
# allocator's malloc and gives them back through its free; so its segments
# sleep through that allocator too, never through the device's backend
# (which did not hand them out: the host backend rejects them as unknown
# segments, another backend would give back memory it does not own). Each
# span of such a segment names its owner (_SleepSpan.owner), whose
# release_pages/restore_pages give the memory back and back it again, and
# whose host_accessible/copy_to_host/copy_from_host keep the live bytes
# (the Backend protocol's sleep-mode members, unimem/backends/base.py).
#
# An allocator that cannot give memory back while keeping the addresses
# (page_release_unavailable_reason() not "", or absent, as for a plain
# PluggableAllocator) is asked before anything happens, outside the lock:
# MemPool.sleep of its pool raises NotImplementedError naming the pool, the
# allocator and the reason, and so does a whole-device sleep while that pool
# holds a segment (a sleep promises memory_reserved() == 0; the same rule as
# for a pool's segments from malloc under expandable segments). Nothing is
# synchronized, marked, released or counted then.


cdef object _owner_of(CachingAllocator self, object span):
    """The allocator that gives ``span``'s memory back: its pool's own
    allocator, else the device's backend."""
    return self.backend if span.owner is None else span.owner


cdef str _owner_words(CachingAllocator self, object span):
    if span.owner is None:
        return f"the {self.device_name} backend ({type(self.backend).__name__})"
    return f"the allocator of memory pool (0, {span.pool}) ({type(span.owner).__name__})"


cdef str _release_reason(CachingAllocator self, object allocator):
    """Why ``allocator`` cannot give a segment's memory back and keep its
    addresses on this device ("" when it can): page_release_unavailable_reason."""
    ask = getattr(allocator, "page_release_unavailable_reason", None)
    if ask is None:
        return "it has no page_release_unavailable_reason/release_pages/restore_pages"
    reason = ask(self.device)
    return str(reason) if reason else ""


cdef dict _pool_release_reasons(CachingAllocator self):
    """``{n: (allocator, reason, holds a segment)}`` for every pool ``(0, n)``
    with its own allocator; the allocators are asked outside the lock."""
    cdef pair[uint64_t, PrivatePool*] entry
    self._lock()
    try:
        found = [(entry.first, self.pool_backends[entry.first], entry.second.n_segments > 0)
                 for entry in self.private_pools if entry.second.has_backend]
    finally:
        self._unlock()
    return {n: (allocator, _release_reason(self, allocator), holds) for n, allocator, holds in found}


cdef str _pool_refusal(CachingAllocator self, uint64_t n, object allocator, str reason, str what):
    return (f"{what}: memory pool (0, {n}) gets its memory from its own allocator "
            f"({type(allocator).__name__}), which cannot give it back while its addresses stay "
            f"reserved: {reason}. Its allocator needs page_release_unavailable_reason() returning \"\" "
            f"and release_pages/restore_pages (the Backend protocol's sleep-mode members)")


cdef bint _check_pools_can_sleep(CachingAllocator self, dict reasons, bint whole_device,
                                 uint64_t pool_number, bint offload) except -1:
    """NotImplementedError, before anything happens, for a pool with its own
    allocator that cannot sleep (cannot give memory back, or with
    ``offload`` cannot have its bytes copied): the pool ``(0, pool_number)``
    put to sleep, or for a whole-device sleep any such pool holding a
    segment. True when the sleep is of a pool with its own allocator (the
    device's backend then gives nothing back)."""
    what = (f"the {self.device_name} allocator of device {self.device} cannot sleep"
            if whole_device else "MemPool.sleep")
    for n, (allocator, reason, holds) in reasons.items():
        if not ((whole_device and holds) or n == pool_number):
            continue
        if reason:
            raise NotImplementedError(_pool_refusal(self, n, allocator, reason, what))
        if offload and not getattr(allocator, "host_accessible", False) and not (
                callable(getattr(allocator, "copy_to_host", None))
                and callable(getattr(allocator, "copy_from_host", None))):
            raise NotImplementedError(
                f"{what}: sleep(offload=True) copies the live blocks to host memory, and the allocator "
                f"of memory pool (0, {n}) ({type(allocator).__name__}) can neither be read by the host "
                f"(host_accessible) nor copy_to_host/copy_from_host; sleep(offload=False) gives the "
                f"memory back without keeping its contents")
    return pool_number != 0 and pool_number in reasons


cdef int _check_pool_segment(CachingAllocator self, Segment* seg, dict reasons) except -1:
    """_mark: NotImplementedError for a segment of a pool whose own
    allocator cannot give it back (asked before the lock: ``reasons``)."""
    entry = reasons.get(seg.pool.id)
    reason = entry[1] if entry is not None else "it was made while sleep() was under way"
    if reason:
        raise NotImplementedError(_pool_refusal(
            self, seg.pool.id, self.pool_backends[seg.pool.id], reason,
            f"sleep mode cannot give back the segment [{seg.base:#x}, {seg.base + seg.size:#x})"))
    return 0


# ---------------------------------------------------------------------------
# a pool's sleep (MemPool.sleep): the core's sleep, for its segments only
# ---------------------------------------------------------------------------
cdef bint _segment_in_pool(CachingAllocator self, uintptr_t base, uint64_t pool_number) noexcept:
    cdef cmap[uintptr_t, Segment*].iterator it = self.segments_by_base.find(base)
    return (it != self.segments_by_base.end() and deref(it).second.pool != NULL
            and deref(it).second.pool.id == pool_number)


cdef int _set_pool_sleeping(CachingAllocator self, object pool_id, bint sleeping) except -1:
    cdef PrivatePool* pool
    self._lock()
    try:
        pool = _live_pool(self, pool_id)
        if sleeping and not pool.sleeping and self.sleeping:
            # The device's sleep holds the pool's segments: the device's
            # wake_up would bring them back while the pool still sleeps.
            raise RuntimeError(f"the {self.device_name} allocator of device {self.device} is asleep, "
                               f"memory pool {pool_id!r} with it: wake_up() the device before "
                               f"putting the pool to sleep on its own")
        pool.sleeping = sleeping
    finally:
        self._unlock()
    return 0


cdef int _sleep_pool(CachingAllocator self, object pool_id, bint offload) except -1:
    """The segments of private pool ``pool_id`` sleep under its id; routed
    allocation into it is refused until :func:`_wake_up_pool`."""
    cdef uint64_t n = _pool_id_number(pool_id)
    reasons = _pool_release_reasons(self)
    _check_pools_can_sleep(self, reasons, False, n, offload)   # its own allocator: before anything
    _set_pool_sleeping(self, pool_id, True)          # raises for a pool that is not live

    def in_pool(base, size, stream):
        return _segment_in_pool(self, base, n)
    try:
        _sleep(self, offload, in_pool, pool_id, reasons, n)
    except BaseException:
        if not self.is_sleeping(pool_id):            # nothing sleeps: allocation is fine again
            _set_pool_sleeping(self, pool_id, False)
        raise
    return 0


cdef int _wake_up_pool(CachingAllocator self, object pool_id) except -1:
    _pool_id_number(pool_id)
    _wake_up(self, pool_id)                          # raises with the rest still asleep
    cdef PrivatePool* pool
    self._lock()
    try:
        pool = _find_pool(self, _pool_id_number(pool_id))
        # _wake_up ran Python after the wake (the history hook, outside the
        # lock), which may have put the pool back to sleep: it stays refused.
        if pool != NULL and pool_id not in self.sleep_states:
            pool.sleeping = False
    finally:
        self._unlock()
    return 0


# ---------------------------------------------------------------------------
# a private pool that dies asleep
# ---------------------------------------------------------------------------
cdef int _end_dead_pool_sleeps(CachingAllocator self, PrivatePool* only) except -1:
    """End the sleep of every dead private pool (of ``only`` when not NULL):
    its MemPool is gone, so nobody can wake it, and memory that sleeps is
    never given back. Called by _empty_dead_pool and empty_cache, whose
    release of the pool's free segments follows in the same hold of the
    lock. Not from inside another allocator call of this thread (a
    finalizer, a backend call): then at the next empty_cache."""
    cdef pair[uint64_t, PrivatePool*] entry
    if not self.sleep_states or self.lock_depth != 1 or self.sleep_busy:
        return 0
    dead = [(0, entry.first) for entry in self.private_pools
            if entry.second.use_count == 0 and (only == NULL or entry.second == only)]
    for tag in dead:
        if tag in self.sleep_states:
            _end_dead_sleep(self, tag)
    return 0


cdef int _end_dead_sleep(CachingAllocator self, object tag) except -1:
    """The segments of the sleep with a block still in use wake up (restore,
    copy back): a pool's blocks outlive its MemPool, as in PyTorch. The
    others, wholly free, are not backed again: their spans only count as
    reserved again, for the release here to take off (the peak stays: no
    memory was mapped). Released here, whatever the caller goes on to give
    back: empty_cache(stream=...) gives back one stream's segments, and
    those of the other streams stayed counted as reserved, unbacked, in the
    free index (a debug fill wrote into them). A restore that fails raises
    with the pool still asleep and the statistics right: the next
    empty_cache tries again."""
    cdef size_t i
    cdef bint debug_on = self.debug_on
    cdef vector[uintptr_t] unbacked          # the bases of the segments not backed again
    cdef vector[Segment*] victims
    cdef cmap[uintptr_t, Segment*].iterator it
    state = self.sleep_states[tag]
    held = {<uintptr_t>self.sleep_held[i] for i in range(self.sleep_held.size())}
    held.update(<uintptr_t>self.sleep_freed[i] for i in range(self.sleep_freed.size()))
    self.sleep_busy = PyThread_get_thread_ident()
    try:
        for span in state.spans:
            if span.expandable or not _wholly_held(self, span.address, held):
                if span.released:
                    _restore_span(self, span, False)
                _copy_back(self, state, span)
        # From here on no Python code runs until the caller's release.
        for span in state.spans:
            if span.released:
                span.released = False
                unbacked.push_back(<uintptr_t>span.address)    # a whole segment from malloc
                self.total_allocated_memory += <size_t>span.size
                pool_increase_without_peak(&self.stats, S_RESERVED_BYTES, span.is_small, <int64_t>span.size)
                _trace_span(self, T_SEGMENT_MAP, span)      # for the release's segment_free that follows
        # Debug mode's fill would write to memory not backed; the pool's
        # blocks are never handed out again, so no fill is needed.
        self.debug_on = False
        try:
            _end_sleep(self, state, tag)
        finally:
            self.debug_on = debug_on
    finally:
        self.sleep_busy = 0
    cdef PrivatePool* pool = _find_pool(self, tag[1])
    if pool != NULL:
        pool.sleeping = False
    for base in unbacked:       # no Python object made since the sleep ended
        it = self.segments_by_base.find(base)
        if it != self.segments_by_base.end() and _segment_is_free(self, deref(it).second) \
                and _releasable(deref(it).second):
            victims.push_back(deref(it).second)
    _release(self, victims)
    return 0


cdef bint _wholly_held(CachingAllocator self, uintptr_t base, object held) except -1:
    """Whether every block of the segment at ``base`` is free and held by a
    sleep (none in use, none waiting on a stream)."""
    cdef cmap[uintptr_t, Segment*].iterator it = self.segments_by_base.find(base)
    cdef Block* b
    if it == self.segments_by_base.end():
        return False
    b = deref(it).second.head
    while b != NULL:
        if <uintptr_t>b not in held:
            return False
        b = b.next
    return True
