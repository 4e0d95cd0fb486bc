# Included by _core.pyx: sleep mode, as vLLM's CuMemAllocator does it for
# PyTorch (sleep, then wake up at the same addresses).
#
# sleep() gives back the memory of every segment (or of the segments a
# filter selects: a private pool's, later) while their addresses stay
# reserved, after copying the bytes of their live blocks to host memory
# (offload=True); wake_up() backs the same addresses with memory again and
# copies the bytes back. What is given back: a whole segment from malloc
# (the backend's release_pages/restore_pages), or each run of mapped pages
# of an expandable segment (unmap_pages/map_pages). A segment of a private
# pool with its own allocator (MemPool(allocator=...)) goes through that
# allocator, which handed it out: its release_pages/restore_pages, its
# host_accessible or copy_to_host/copy_from_host; one that cannot give
# memory back is refused before anything happens, by the pool's sleep and by
# a whole-device sleep while the pool holds a segment (_core_sleep_pools.pxi).
# Free cached memory goes with the rest and comes back at wake_up with its
# contents lost: the cache is as it was (empty_cache() before sleep() gives
# it back for good).
#
# In between, the sleeping segments are *marked* (sleep_marks: Segment* ->
# the id of the sleep). Their free blocks are off the free index and *held*
# (event_count + 1, as a block waiting for a stream event): no path hands
# them out, merges them away, unmaps or releases them, since every reclaim
# path already leaves a block waiting for an event alone. A live block freed
# meanwhile is held too (_free_block sends it here): it leaves
# allocated_bytes at once and active_bytes at wake_up, as a stream-ordered
# free does, and its offloaded copy is dropped. Held blocks never merge, so
# the Block of every live block stays where the sleep found it.
#
# A whole-device sleep also sets ``sleeping``, one of the ``unusual``
# conditions: c_malloc refuses with RuntimeError, its fast path untouched.
# With a segment filter the caller refuses allocation into what sleeps
# (a private pool's allocations, MemPool.sleep); its free blocks are held
# all the same, so no other request can get them.
#
# Statistics: reserved_bytes counts what is backed by memory (PyTorch's
# meaning for expandable segments), so it falls by every span given back
# and rises again at wake_up; num_device_free counts the release calls and
# num_device_alloc the restore calls (and device_free_time/alloc_time time
# them). Segment counts, allocated and active bytes stay: the segments and
# the live blocks still exist, at their addresses.
#
# Failures. Before anything is given back (the host copy, the copies) a
# failure undoes the sleep: the allocator is as before and the error is
# raised. A release that raises leaves that span's memory as it was (the
# backend's contract): the others are still given back, the allocator is
# asleep and the first error is raised; wake_up() copies that span's bytes
# back too. A restore (or copy back) that raises stops wake_up() there: what
# was woken stays woken, the rest stays asleep, the allocator is still
# asleep (nothing can be handed out twice) and wake_up() again goes on.
#
# The lock. Deciding (marking, holding, listing the spans) and committing
# (the statistics of each span given back or backed again, ending the sleep)
# happen under the lock; every call out (the segment filter, the copies,
# release_pages/restore_pages, the virtual memory calls) is made with it let
# go. Meanwhile the marks keep every other path away from the sleeping
# segments, and sleep_busy names the thread whose sleep or wake is under
# way: another thread's sleep() or wake_up() waits for it to end, one
# called from within those calls is refused, and a pool's memory backed again counts against
# the memory limit while the call is in flight (_note_call_in_flight).

from bisect import bisect_right

from libc.string cimport memcpy
from posix.mman cimport (mmap, munmap, madvise, PROT_READ, PROT_WRITE, MAP_PRIVATE,
                         MAP_ANONYMOUS, MAP_FAILED)

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_HUGEPAGE
    #define MADV_HUGEPAGE 14
    #endif
    #ifndef MADV_NOHUGEPAGE
    #define MADV_NOHUGEPAGE 15
    #endif
    """
    int MADV_HUGEPAGE
    int MADV_NOHUGEPAGE

# The host copy is mapped by 2 MiB pages where the system allows it
# (transparent huge pages on madvise): faulting in 512 times fewer pages
# makes the copy several times faster than into fresh 4 KiB pages.
cdef size_t STAGING_PAGE = <size_t>2 << 20


class _SleepSpan:
    """Memory of a sleeping segment given back in one call: a whole segment,
    or a run of mapped pages of an expandable one. ``copies``: the live
    blocks' bytes kept in the host copy, ``[Block*, address, size, offset]``,
    taken off the list as they are copied back. ``owner``: the allocator of
    the segment's pool (``pool``, the n of its id) when the pool has its own
    (_core_sleep_pools.pxi), else None: the device's backend."""
    __slots__ = ("address", "size", "is_small", "expandable", "released", "copies", "owner", "pool")

    def __init__(self, address, size, is_small, expandable):
        self.address = address
        self.size = size
        self.is_small = is_small
        self.expandable = expandable
        self.released = False
        self.copies = []
        self.owner = None
        self.pool = 0


class _SleepState:
    """One sleep: what it gave back and the host copy of the live bytes."""
    __slots__ = ("offload", "whole_device", "spans", "staging", "staging_base", "staging_length")

    def __init__(self, offload, whole_device):
        self.offload = offload
        self.whole_device = whole_device
        self.spans = []
        self.staging = 0            # the host copy (STAGING_PAGE aligned) ...
        self.staging_base = 0       # ... in this mapping
        self.staging_length = 0


cdef inline bint _hold_if_asleep(CachingAllocator self, Block* b) noexcept nogil:
    """_free_block of a block whose segment sleeps: hold it until wake_up."""
    if self.sleep_marks.count(<uintptr_t>b.segment) == 0:
        return False
    b.event_count += 1
    self.sleep_freed.push_back(b)
    return True


cdef object _busy_error(CachingAllocator self):
    return RuntimeError(f"sleep() or wake_up() is already under way on the {self.device_name} allocator "
                        f"of device {self.device} (called again from within a backend call)")


cdef int _refuse_asleep(CachingAllocator self) except -1:
    raise RuntimeError(f"the {self.device_name} allocator of device {self.device} is asleep "
                       f"(sleep() gave its memory back): call wake_up() before allocating")


cdef int _refuse_if_asleep(CachingAllocator self, PrivatePool* pool) except -1:
    """RuntimeError when the allocator sleeps, or ``pool`` (NULL: the device's
    own pools) does (MemPool.sleep). Lock held."""
    if self.sleeping:
        _refuse_asleep(self)
    if pool != NULL and pool.sleeping:
        raise RuntimeError(f"memory pool (0, {pool.id}) is asleep (MemPool.sleep): "
                           f"call its wake_up() before allocating from it")
    return 0


cdef str _check_can_sleep(CachingAllocator self, bint device_segments):
    """NotImplementedError, saying why, where the backend cannot give memory
    back and keep its addresses (and the sleep may take ``device_segments``:
    not that of a pool with its own allocator). Else why the backend cannot
    give back the memory of a segment from malloc ("" when it can): with
    expandable segments, a private pool's segments come from malloc all the
    same (_malloc_slow), and _mark refuses to put those to sleep."""
    reason = _release_reason(self, self.backend)
    if reason and not self.expandable and device_segments:   # expandable: the virtual memory calls
        raise NotImplementedError(
            f"sleep mode needs memory that can be given back while its addresses stay reserved; "
            f"the {self.device_name} backend ({type(self.backend).__name__}) cannot on device "
            f"{self.device}: {reason}")
    return reason or ""


cdef list _sleep_candidates(CachingAllocator self, object select):
    """``(address, size, stream)`` of the segments that may sleep, those
    ``select(address, size, stream)`` takes (all when None). Copied under
    the lock; the tuples are made and ``select`` runs with it let go, so
    _mark looks each segment up again."""
    cdef vector[uintptr_t] found       # base, size, stream of each
    cdef Segment* seg
    cdef size_t i
    self._lock()
    seg = self.segments
    while seg != NULL:
        if self.sleep_marks.count(<uintptr_t>seg) == 0 and (not seg.expandable or seg.mapped > 0):
            if (_push_address(found, seg.base) != 0 or _push_address(found, seg.size) != 0
                    or _push_address(found, seg.stream) != 0):
                self._unlock()
                raise MemoryError("host memory for the allocator's bookkeeping ran out")
        seg = seg.next_seg
    self._unlock()
    candidates = [(found[i], found[i + 1], found[i + 2]) for i in range(0, found.size(), 3)]
    if select is not None:
        candidates = [c for c in candidates if select(*c)]
    return candidates


cdef int _mark(CachingAllocator self, object state, list candidates, str reason, dict reasons) except -1:
    """Mark the segments of ``candidates`` (_sleep_candidates), hold their
    free blocks and list their spans. NotImplementedError, before anything
    is marked, when one of them is a segment from malloc that the backend
    cannot give back (``reason``), or a segment of a pool whose own
    allocator cannot (``reasons``). Lock held."""
    cdef Segment* seg
    cdef Block* b
    cdef Block* start
    cdef uintptr_t key = <uintptr_t>id(state)
    cdef cmap[uintptr_t, Segment*].iterator it
    for base, size, _ in candidates:
        it = self.segments_by_base.find(base)
        if it != self.segments_by_base.end() and deref(it).second.pool != NULL \
                and deref(it).second.pool.has_backend:
            _check_pool_segment(self, deref(it).second, reasons)
        elif reason and it != self.segments_by_base.end() and not deref(it).second.expandable:
            seg = deref(it).second
            raise NotImplementedError(
                f"sleep mode cannot give back the segment [{seg.base:#x}, {seg.base + seg.size:#x})"
                + (f" of memory pool (0, {seg.pool.id})" if seg.pool != NULL else "")
                + f": it is not an expandable segment (a MemPool's segments come from malloc even with "
                f"expandable_segments:True), and the {self.device_name} backend "
                f"({type(self.backend).__name__}) cannot give such memory back on device "
                f"{self.device}: {reason}")
    for base, size, _ in candidates:
        it = self.segments_by_base.find(base)
        if it == self.segments_by_base.end():
            continue
        seg = deref(it).second
        if seg.size != size or self.sleep_marks.count(<uintptr_t>seg) or (seg.expandable and seg.mapped == 0):
            continue
        self.sleep_marks[<uintptr_t>seg] = key
        b = seg.head
        while b != NULL:
            if not b.allocated and not b.unmapped and b.event_count == 0:
                fi_remove(b.index, b)
                b.event_count += 1
                self.sleep_held.push_back(b)
            b = b.next
        if not seg.expandable:
            span = _span_of(self, state, seg.head, NULL, seg.base, seg.size, seg.is_small, False)
            if seg.pool != NULL and seg.pool.has_backend:     # _core_sleep_pools.pxi
                span.owner, span.pool = self.pool_backends[seg.pool.id], seg.pool.id
            state.spans.append(span)
            continue
        b = seg.head
        while b != NULL:                 # each run of mapped blocks
            # Pages held to unmap (_core_holes.pxi) are not in a run: their
            # own path unmaps them once their stream's work is done (another
            # thread may be waiting for it now), and must find them mapped.
            if b.unmapped or b.releasing:
                b = b.next
                continue
            start = b
            while b != NULL and not b.unmapped and not b.releasing:
                b = b.next
            end = b.ptr if b != NULL else seg.base + seg.size
            state.spans.append(_span_of(self, state, start, b, start.ptr, end - start.ptr, seg.is_small, True))
    return 0


cdef object _span_of(CachingAllocator self, object state, Block* first, Block* stop, uintptr_t address,
                     size_t size, bint is_small, bint expandable):
    """A span, with the live blocks from ``first`` up to ``stop`` to copy."""
    span = _SleepSpan(address, size, is_small, expandable)
    cdef Block* b = first
    if state.offload:
        while b != stop:
            if b.allocated:
                span.copies.append([<uintptr_t>b, b.ptr, b.size, 0])
            b = b.next
    return span


cdef int _offload(CachingAllocator self, object state) except -1:
    """Copy the live blocks' bytes to one host mapping, with the lock let
    go. A block freed since it was marked is held by the sleep (nobody
    else can have its memory): copying it anyway is harmless."""
    cdef size_t total = 0
    cdef size_t length
    cdef void* p
    cdef uintptr_t staging
    for span in state.spans:
        for copy in span.copies:
            copy[3] = total
            total += (copy[2] + 63) // 64 * 64
    if total == 0:
        return 0
    length = _round_up(total, STAGING_PAGE) + STAGING_PAGE
    p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        raise MemoryError(f"sleep(offload=True): no host memory for the {total} bytes of the live blocks")
    staging = _round_up(<uintptr_t>p, STAGING_PAGE)
    madvise(<void*>staging, _round_up(total, STAGING_PAGE), MADV_HUGEPAGE)    # a hint: may be refused
    state.staging, state.staging_base, state.staging_length = staging, <uintptr_t>p, length
    for span in state.spans:
        if not span.copies:
            continue
        owner = _owner_of(self, span)
        direct = bool(getattr(owner, "host_accessible", False))
        copy_to_host = None if direct else getattr(owner, "copy_to_host", None)
        if not direct and copy_to_host is None:
            raise NotImplementedError(_no_copy_message(self, span, "copy_to_host"))
        for copy in span.copies:
            if direct:
                memcpy(<void*>(staging + <size_t>copy[3]), <void*><uintptr_t>copy[1], <size_t>copy[2])
            else:
                try:
                    copy_to_host(staging + copy[3], copy[1], copy[2], self.device)
                except NotImplementedError as exc:
                    raise NotImplementedError(f"{_no_copy_message(self, span, 'copy_to_host')} ({exc})") from None
    return 0


cdef str _no_copy_message(CachingAllocator self, object span, str call):
    return (f"sleep(offload=True) copies the live blocks to host memory, and {_owner_words(self, span)} "
            f"can neither be read by the host nor {call}; "
            f"sleep(offload=False) gives the memory back without keeping its contents")


cdef object _release_spans(CachingAllocator self, object state):
    """Give back each span's memory, with the lock let go, and count each
    under it; the first error, or None."""
    cdef int64_t t0
    cdef size_t size
    first_error = None
    for span in state.spans:
        t0 = um_now_ns()
        size = span.size
        try:
            if span.expandable:
                self._vm_unmap(span.address, size, self.device)
            else:
                _owner_of(self, span).release_pages(span.address, size, self.device)
        except BaseException as exc:     # the memory is as it was: the backend's contract
            if first_error is None:
                first_error = exc
            continue
        self._lock()
        duration_add(&self.stats.device_free_time, (um_now_ns() - t0) // 1000)
        span.released = True
        self.total_allocated_memory -= size
        pool_decrease(&self.stats, S_RESERVED_BYTES, span.is_small, size)
        self.stats.num_device_free += 1
        _trace_span(self, T_SEGMENT_UNMAP, span)
        self._unlock()
    return first_error


cdef int _trace_span(CachingAllocator self, int action, object span) except -1:
    """Record a span given back or backed again as the history's
    segment_unmap / segment_map, so that a timeline rebuilt from it follows
    reserved memory through a sleep (memory_viz handles both for any segment)."""
    cdef cmap[uintptr_t, Segment*].iterator it
    if self.recording:
        it = _map_prev(self.segments_by_base.upper_bound(span.address))
        self._trace(action, span.address, span.size, deref(it).second.stream)
    return 0


cdef int _restore_span(CachingAllocator self, object span, bint within_limit=True) except -1:
    """Back a released span with memory again, within the memory limit for a
    pool's sleep: the room it gave back may have gone to the device's
    allocations meanwhile (not ``within_limit``: a whole-device sleep, and
    blocks of a dead pool still in use, which nobody could wake later)."""
    cdef int64_t t0
    cdef size_t size = span.size
    cdef size_t reserved = 0
    cdef size_t allowed = 0
    cdef uint64_t call = 0
    # The limit is checked, and the span's bytes count against it while the
    # call is in flight, in one hold of the lock: two wakes (or a wake and a
    # miss) cannot pass it together.
    self._lock()
    if within_limit and self.set_fraction and _held_or_asked(self) + size > self.allowed_memory_maximum:
        reserved, allowed = _held_or_asked(self) + size, self.allowed_memory_maximum
    else:
        call = _note_call_in_flight(self, size)
    self._unlock()
    if call == 0:
        raise OutOfMemoryError(
            f"wake_up: backing [{span.address:#x}, {span.address + span.size:#x}) with memory again "
            f"would pass the memory limit ({reserved} bytes reserved, {allowed} allowed); the pool "
            f"stays asleep with the memory not yet woken: free the device's memory (and empty_cache()) "
            f"or raise the limit, and call wake_up() again",
            device=self.device, requested=span.size)
    t0 = um_now_ns()
    try:
        if span.expandable:
            self._vm_map(span.address, size, self.device)
        else:
            _owner_of(self, span).restore_pages(span.address, size, self.device)
    except BaseException as exc:
        self._lock()
        _end_call_in_flight(self, call, size)
        self._unlock()
        message = (f"wake_up: {_owner_words(self, span)} could not back [{span.address:#x}, "
                   f"{span.address + span.size:#x}) with memory again ({type(exc).__name__}: {exc}); "
                   f"the allocator stays asleep with the memory not yet woken: call wake_up() again")
        if isinstance(exc, MemoryError):
            raise MemoryError(message) from exc
        if isinstance(exc, Exception):
            raise RuntimeError(message) from exc
        raise                        # a KeyboardInterrupt stays one
    self._lock()
    _end_call_in_flight(self, call, size)
    duration_add(&self.stats.device_alloc_time, (um_now_ns() - t0) // 1000)
    span.released = False
    self.total_allocated_memory += size
    pool_increase(&self.stats, S_RESERVED_BYTES, span.is_small, size)
    self.stats.num_device_alloc += 1
    _trace_span(self, T_SEGMENT_MAP, span)
    self._unlock()
    return 0


cdef void _end_call_in_flight(CachingAllocator self, uint64_t call, size_t size) noexcept nogil:
    """A span's restore is no longer in flight (lock held)."""
    _forget_call_in_flight(self, call)
    self.in_flight_bytes = self.in_flight_bytes - size if self.in_flight_bytes > size else 0


cdef int _copy_back(CachingAllocator self, object state, object span) except -1:
    """Copy the live blocks' bytes back into a span that has memory again,
    with the lock let go; each copy leaves the list once done (a failure
    leaves the rest). Which blocks are still live is read under the lock:
    one freed since is held by the sleep until it ends, so a copy into it
    is harmless."""
    cdef Block* b
    cdef vector[char] live
    cdef char is_live
    cdef size_t i
    owner = _owner_of(self, span)
    direct = bool(getattr(owner, "host_accessible", False))
    copy_from_host = None if direct else getattr(owner, "copy_from_host", None)
    if span.copies and not direct and copy_from_host is None:
        raise NotImplementedError(_no_copy_message(self, span, "copy_from_host"))
    # Host memory where huge pages come only when asked for: the new pages
    # of a span with live bytes are asked for as huge pages while the bytes
    # are copied back (512 times fewer faults, several times faster). Not
    # memory of a pool's own allocator: its mappings are not ours to advise.
    cdef bint advise = bool(span.copies) and direct and span.owner is None and _thp_mode() == "madvise"
    if advise:
        madvise(<void*><uintptr_t>span.address, <size_t>span.size, MADV_HUGEPAGE)
    copies = list(span.copies)
    live.reserve(len(copies))
    self._lock()
    for block, address, _, _ in copies:     # no Python object made: the items exist
        b = <Block*><uintptr_t>block
        is_live = b.allocated and b.ptr == <uintptr_t>address
        live.push_back(is_live)        # room reserved
    self._unlock()
    try:
        i = live.size()
        while i > 0:
            i -= 1
            block, address, size, offset = copies[i]
            if live[i]:                     # not freed while asleep
                if direct:
                    memcpy(<void*><uintptr_t>address, <void*>(<uintptr_t>state.staging + <size_t>offset),
                           <size_t>size)
                else:
                    copy_from_host(address, state.staging + offset, size, self.device)
            span.copies.pop()
    finally:
        if advise:
            # ... and only then: left on, every later fault in the range
            # (a block handed out there) would take a 2 MiB page, and may
            # stall compacting memory for it, where before the sleep it took
            # 4 KiB. Before the hint the range had no advice (the restore
            # made a fresh mapping), and in "madvise" mode MADV_NOHUGEPAGE
            # faults as no advice does (no huge page, khugepaged passes it
            # by): the closest Linux has to taking advice back. The huge
            # pages the copy got stay. Under "always" nothing is asked (a
            # fresh mapping gets huge pages anyway) nor taken back.
            madvise(<void*><uintptr_t>span.address, <size_t>span.size, MADV_NOHUGEPAGE)
    return 0


cdef object _thp_mode_found = None


cdef str _thp_mode():
    """The system's transparent huge page mode ("always", "madvise" or
    "never"; "" without them), read once."""
    global _thp_mode_found
    if _thp_mode_found is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                text = f.read()
            _thp_mode_found = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            _thp_mode_found = ""
    return _thp_mode_found


cdef int _end_sleep(CachingAllocator self, object state, object tag) except -1:
    """Every span of ``state`` is awake: its held blocks go back (the blocks
    that were free first, then those freed meanwhile, merged as frees are),
    the marks and the host copy go. No Python code runs in between."""
    cdef uintptr_t key = <uintptr_t>id(state)
    cdef vector[Block*] kept
    cdef vector[Block*] freed
    cdef Block* b
    cdef size_t i
    cdef cmap[uintptr_t, uintptr_t].iterator it
    for i in range(self.sleep_held.size()):
        b = self.sleep_held[i]
        if self.sleep_marks[<uintptr_t>b.segment] == key:
            b.event_count -= 1
            if self.expandable:
                # A filtered sleep may have had pages mapped next to it
                # (inactive_split leaves expandable blocks out: no statistic)
                self._try_merge(b, b.prev, b.index)
                self._try_merge(b, b.next, b.index)
            fi_insert(b.index, b)
        else:
            kept.push_back(b)
    self.sleep_held.swap(kept)
    kept.clear()
    for i in range(self.sleep_freed.size()):
        b = self.sleep_freed[i]
        if self.sleep_marks[<uintptr_t>b.segment] == key:
            freed.push_back(b)
        else:
            kept.push_back(b)
    self.sleep_freed.swap(kept)
    it = self.sleep_marks.begin()
    while it != self.sleep_marks.end():
        if deref(it).second == key:
            it = self.sleep_marks.erase(it)
        else:
            inc(it)
    for i in range(freed.size()):         # unmarked now: _free_block frees for real
        b = freed[i]
        b.event_count -= 1
        if b.event_count == 0:
            self._free_block(b)
    if state.whole_device:       # another tag's whole-device sleep may still be in force
        self.sleeping = any(other.whole_device for other in self.sleep_states.values() if other is not state)
        self._update_unusual()
    if self.debug_on:
        _fill_free_blocks(self)            # the new pages hold zeros, not the fill
    if state.staging_base:
        munmap(<void*><uintptr_t>state.staging_base, <size_t>state.staging_length)
        state.staging = state.staging_base = state.staging_length = 0
    del self.sleep_states[tag]
    return 0


cdef int _sleep(CachingAllocator self, bint offload, object select, object tag,
                dict reasons=None, uint64_t pool_number=0) except -1:
    """CachingAllocator.sleep: see there. ``reasons``: _pool_release_reasons,
    when the caller asked already; ``pool_number``: the n of the pool
    ``(0, n)`` that sleeps alone (_sleep_pool)."""
    self._check_usable()
    if tag in self.sleep_states:
        return 0                           # asleep already (checked again under the lock)
    if reasons is None:
        reasons = _pool_release_reasons(self)
    own = _check_pools_can_sleep(self, reasons, select is None, pool_number, offload)
    reason = _check_can_sleep(self, not own)
    synchronize = getattr(self.backend, "synchronize", None)
    if synchronize is not None:
        synchronize(self.device)           # work still using the memory completes first
    state = _SleepState(offload, select is None)
    if not _begin_transition(self, tag, True):
        return 0                           # asleep already (another thread put it to sleep)
    try:
        candidates = _sleep_candidates(self, select)
        self._lock()
        try:
            _synchronize_and_free_events(self)
            self.sleep_states[tag] = state
            if state.whole_device:
                self.sleeping = True
                self._update_unusual()
            try:
                _mark(self, state, candidates, reason, reasons)
            except BaseException:
                _end_sleep(self, state, tag)   # nothing marked: as before
                raise
        finally:
            self._unlock()
        try:
            _offload(self, state)
        except BaseException:
            self._lock()
            try:
                _end_sleep(self, state, tag)   # nothing was given back: as before
            finally:
                self._unlock()
            raise
        error = _release_spans(self, state)
    finally:
        _end_transition(self)
    self._flush_trace()
    if error is not None:
        raise error
    return 0


cdef bint _begin_transition(CachingAllocator self, object tag, bint to_sleep) except -1:
    """Mark a sleep or wake as begun (sleep_busy: this thread), once any
    other thread's is over (waited for with the lock let go, without the
    GIL, as a thread waiting for the lock did before). RuntimeError for one
    re-entered from a call this thread's makes (or from a finalizer while
    the lock is held more than once). False when there is nothing
    to do: ``tag`` asleep already (``to_sleep``), or awake."""
    cdef unsigned long thread = PyThread_get_thread_ident()
    self._lock()
    # Held more than once (called from a finalizer inside another call),
    # letting go would not let the other thread commit: refused then.
    while self.sleep_busy != 0 and self.sleep_busy != thread and self.lock_depth == 1:
        self._unlock()
        with nogil:
            usleep(100)
        self._lock()
    if self.sleep_busy != 0:
        self._unlock()
        raise _busy_error(self)
    done = (tag in self.sleep_states) == to_sleep
    if not done:
        self.sleep_busy = thread
    self._unlock()
    return not done


cdef int _end_transition(CachingAllocator self) except -1:
    self._lock()
    self.sleep_busy = 0
    self._unlock()
    return 0


cdef size_t _wake_excess(CachingAllocator self, object state) except? 0:
    """The bytes still given back by a pool's sleep, when backing them all
    with memory again would pass the memory limit; else 0. A whole-device
    sleep is held to no limit: nothing else could take its room, and the
    limit may have been lowered since (with allocation refused, nothing
    could make room). Lock held."""
    cdef size_t needed = 0
    if state.whole_device or not self.set_fraction:
        return 0
    for span in state.spans:
        if span.released:
            needed += <size_t>span.size
    return needed if _held_or_asked(self) + needed > self.allowed_memory_maximum else 0


cdef object _wake_refused(CachingAllocator self, size_t needed, size_t reserved, size_t allowed):
    """The OutOfMemoryError of a wake_up the memory limit refuses, counted
    as every out-of-memory error is."""
    _count_out_of_memory(self, needed)
    return OutOfMemoryError(
        f"wake_up: backing the {needed} bytes the sleep gave back with memory again would pass "
        f"the memory limit ({reserved + needed} bytes reserved, {allowed} allowed); the sleep "
        f"stays in force and nothing changed: free the device's memory (and empty_cache()) or "
        f"raise the limit, and call wake_up() again",
        device=self.device, requested=needed)


cdef int _wake_up(CachingAllocator self, object tag) except -1:
    """CachingAllocator.wake_up: see there. A pool's wake that the memory
    limit refuses changes nothing: its memory is checked against the limit
    as a whole before any of it is backed again."""
    cdef size_t excess = 0
    cdef size_t reserved = 0
    if not _begin_transition(self, tag, False):
        return 0                       # awake already (or woken by another thread meanwhile)
    try:
        self._lock()
        state = self.sleep_states[tag]
        excess = _wake_excess(self, state)
        reserved = self.total_allocated_memory
        self._unlock()
        if excess == 0:
            _wake_spans(self, state, tag)
    finally:
        _end_transition(self)
        self._flush_trace()        # what was woken before a refused span too
    if excess:                     # raised outside the lock: the observers run Python
        raise _wake_refused(self, excess, reserved, self.allowed_memory_maximum)
    return 0


cdef int _wake_spans(CachingAllocator self, object state, object tag) except -1:
    """Back the sleep's spans with memory again and copy their bytes back,
    with the lock let go, then end the sleep under it."""
    for span in state.spans:
        if span.released:
            # checked as a whole (_wake_excess); span by span again, as
            # another thread (or the Python a backend call runs) may allocate
            _restore_span(self, span, not state.whole_device)
        _copy_back(self, state, span)
    self._lock()
    try:
        _end_sleep(self, state, tag)
    finally:
        self._unlock()
    return 0


def _sleep_accounting(CachingAllocator self):
    """For _check_invariants: ``({Segment*: bytes given back}, {held free Block*})``. Lock held."""
    cdef Segment* seg
    cdef cmap[uintptr_t, Segment*].iterator it
    released = {}
    for state in self.sleep_states.values():
        for span in state.spans:
            if span.released:
                it = _map_prev(self.segments_by_base.upper_bound(span.address))
                seg = deref(it).second
                released[<uintptr_t>seg] = released.get(<uintptr_t>seg, 0) + span.size
    held = {<uintptr_t>self.sleep_held[i] for i in range(self.sleep_held.size())}
    return released, held


# ---------------------------------------------------------------------------
# the snapshot of an allocator that sleeps
# ---------------------------------------------------------------------------
def _snapshot_awake(CachingAllocator self, pool_id=None):
    """CachingAllocator.snapshot: _snapshot_segments without the memory a
    sleep gave back. reserved_bytes counts backed memory only, and PyTorch's
    snapshot lists only the mapped runs of an expandable segment (unmapped
    addresses are not memory); so a segment with spans given back is listed
    as the runs of its blocks outside them (nothing for a whole segment from
    malloc), and the sizes add up to reserved_bytes asleep as awake. The
    live blocks given back go with their memory (their bytes are on the
    host, or gone); allocated_bytes still counts them, as the segment count
    counts their segments. A free block the sleep holds is "inactive" (free:
    active_bytes leaves it out), not waiting on a stream."""
    cdef size_t i
    cdef uint64_t only = _pool_id_number(pool_id)
    cdef vector[SnapshotSegment] copied_segments
    cdef vector[SnapshotBlock] copied_blocks
    cdef vector[uintptr_t] held_blocks
    # Copied in one hold of the lock, Python objects made after (_core_stats.pxi).
    self._lock()
    _copy_segments(self, only, &copied_segments, &copied_blocks)
    for i in range(self.sleep_held.size()):
        held_blocks.push_back(self.sleep_held[i].ptr)
    states = list(self.sleep_states.values())
    self._unlock()
    segments = _segments_of_copy(self, &copied_segments, &copied_blocks)
    released = sorted((span.address, span.address + span.size) for state in states
                      for span in state.spans if span.released)
    held = set(held_blocks)
    if not released and not held:
        return segments
    starts = [start for start, _ in released]
    out = []
    for segment in segments:
        run = []
        for block in segment["blocks"]:
            if block["address"] in held:
                block["state"] = "inactive"
            k = bisect_right(starts, block["address"]) - 1
            if k >= 0 and block["address"] < released[k][1]:    # given back: the run ends
                out.extend(_segment_of_run(segment, run))
                run = []
            else:
                run.append(block)
        out.extend(_segment_of_run(segment, run))
    return out


def _segment_of_run(dict segment, list blocks):
    """``segment``'s entry for a run of its blocks ([] for none), its sums
    counted again as _snapshot_segments counts them."""
    if not blocks:
        return []
    active = [block for block in blocks if block["state"] != "inactive"]
    return [dict(segment, address=blocks[0]["address"], blocks=blocks,
                 total_size=sum(block["size"] for block in blocks),
                 allocated_size=sum(block["size"] for block in active if block["state"] == "active_allocated"),
                 active_size=sum(block["size"] for block in active),
                 requested_size=sum(block["requested_size"] for block in active))]
