# Included by _core.pyx: what the backend is told about streams. A stream
# record_stream names is checked (``check_stream(stream, device)``, which
# may also begin a hold on it: the XPU backend keeps the stream's SYCL
# queue), and a stream the core keeps nothing for any more is released
# (``release_stream(stream, device)``, then ``sweep_released_streams()``).
#
# Both calls run with the lock let go, so a naming and a release of one
# stream may be told by two threads at once, in either order. What the
# backend ends up holding must still be what the core's table says: a
# stream dropped, then named again (record_stream, an allocation on it)
# while its release was being told, keeps what the backend holds for it (a
# SYCL queue, whose handle would otherwise go to another queue while blocks
# wait for the first one's work). So one thread at a time is a stream's
# teller (stream_notices.telling, _native/stream_notices.hpp): after each
# call it compares, under the lock, what it told last with the table, and
# tells again until they agree (_settle_streams). A thread that names a
# stream while another tells about it marks it UM_TOLD_UNKNOWN, and the
# teller then tells what the table says once more.


cdef int _tell_backend_dropped_streams(CachingAllocator self) except -1:
    """Tell the backend of the streams this allocator no longer keeps
    anything for (``release_stream``, optional), then let it let go of what
    it held for them (``sweep_released_streams``, optional), which may wait
    for the device. All with the lock let go."""
    cdef vector[uintptr_t] dropped
    cdef vector[uintptr_t] mine
    cdef uintptr_t s
    cdef size_t i
    if self.stream_notices.dropped.empty() or self.lock.held_here():
        return 0        # held: this thread's outer call tells them once it lets the lock go
    self._lock()
    try:
        dropped.swap(self.stream_notices.dropped)
        mine.reserve(dropped.size())
        for i in range(dropped.size()):
            s = dropped[i]
            if self.streams.find(s) != self.streams.end():
                continue        # named again before its release was told: the backend keeps it
            if self.stream_notices.telling.find(s) != self.stream_notices.telling.end():
                continue        # its teller finds it out of the table and releases it
            if um_notices_tell(self.stream_notices, s, 0) == 0:
                mine.push_back(s)     # room reserved: cannot fail
            # else no host memory: the backend keeps its hold on the stream
    finally:
        self._unlock()
    if not mine.empty() and _settle_streams(self, mine):
        sweep = getattr(self.backend, "sweep_released_streams", None)
        if sweep is not None:
            _tell_each(sweep, [()], "unimem: a backend's sweep_released_streams")
    _drain_inbox(self)      # frees a finalizer made during the calls
    return 0


cdef bint _settle_streams(CachingAllocator self, vector[uintptr_t]& streams) except -1:
    """Tell the backend what the table says of each of ``streams``, whose
    teller this thread is: released if the table has no entry for it any
    more, named (``check_stream``) if it has one. Each call is made with
    the lock let go, then compared with the table under it, until what was
    told last agrees. True if a release was told. A backend's error is
    reported as unraisable; a Ctrl-C is raised once every stream is settled
    (its teller must finish, or no other thread would tell about it)."""
    cdef vector[uintptr_t] current
    cdef vector[uintptr_t] to_release
    cdef vector[uintptr_t] to_name
    cdef cmap[uintptr_t, uint8_t].iterator it
    cdef uintptr_t s
    cdef uint8_t told
    cdef bint want_release
    cdef bint released_any = False
    cdef bint released_last = False
    cdef size_t i
    release_stream = getattr(self.backend, "release_stream", None)
    check_stream = getattr(self.backend, "check_stream", None)
    interrupt = None
    current.swap(streams)
    while not current.empty():
        to_release.clear()
        to_name.clear()
        to_release.reserve(current.size())      # so that nothing allocates under the lock
        to_name.reserve(current.size())
        self._lock()
        if released_last:
            self.stream_notices.releases_told += 1   # read by record_stream (_record_stream)
        for i in range(current.size()):
            s = current[i]
            it = self.stream_notices.telling.find(s)
            if it == self.stream_notices.telling.end():
                continue        # a fork's child forgot the tellers (_core_fork.pxi): told again there
            told = deref(it).second
            want_release = self.streams.find(s) == self.streams.end()
            if told != UM_TOLD_UNKNOWN and want_release == (told == UM_TOLD_RELEASE):
                self.stream_notices.telling.erase(it)       # agreed: no longer told about
            elif want_release:
                deref(it).second = UM_TOLD_RELEASE
                to_release.push_back(s)
            else:
                deref(it).second = 0
                to_name.push_back(s)
        self._unlock()
        released_last = not to_release.empty()
        released_any = released_any or released_last
        try:
            if release_stream is not None and released_last:
                _tell_each(release_stream, [(s, self.device) for s in to_release],
                           "unimem: a backend's release_stream")
            if check_stream is not None and not to_name.empty():
                _tell_each(check_stream, [(s, self.device) for s in to_name],
                           "unimem: a backend's check_stream, naming a stream again")
        except BaseException as exc:
            interrupt = exc
        current.swap(to_release)
        current.insert(current.end(), to_name.begin(), to_name.end())
    if interrupt is not None:
        raise interrupt
    return released_any


cdef object _record_stream(CachingAllocator self, ptr, stream):
    """CachingAllocator.record_stream."""
    cdef uintptr_t p = check_pointer(ptr)
    cdef uintptr_t s = check_stream(stream)
    cdef uint64_t releases_before = 0
    cdef vector[uintptr_t] settle
    cdef int status
    check = getattr(self.backend, "check_stream", None)
    self._lock()
    status = _stream_use_status(self, p, s)
    self._unlock()
    if status == 1:
        raise InvalidPointerError(f"pointer {p:#x} is not a live allocation of this allocator")
    if status == 2:
        return
    if check is not None:
        # Asked before the record and with the lock let go: a refused handle
        # leaves nothing behind. A release of the stream another thread
        # tells meanwhile could undo the backend's hold that begins here:
        # the teller, or this thread, settles it below.
        releases_before = self.stream_notices.releases_told
        check(s, self.device)
    settle.reserve(1)
    self._lock()
    status = _stream_use_status(self, p, s)
    if status == 0:
        status = _add_stream_use(self, p, s)
    if check is not None:
        if self.stream_notices.telling.find(s) != self.stream_notices.telling.end():
            self.stream_notices.telling[s] = UM_TOLD_UNKNOWN     # its teller tells the table's answer again
        elif ((self.stream_notices.releases_told != releases_before
               or self.streams.find(s) == self.streams.end())
              and um_notices_tell(self.stream_notices, s, UM_TOLD_UNKNOWN) == 0):
            settle.push_back(s)     # a release told since, or a naming the table has no entry for
    self._unlock()
    if not settle.empty() and _settle_streams(self, settle):
        sweep = getattr(self.backend, "sweep_released_streams", None)
        if sweep is not None:
            _tell_each(sweep, [()], "unimem: a backend's sweep_released_streams")
    if status == 1:
        raise InvalidPointerError(f"pointer {p:#x} is not a live allocation of this allocator "
                                  f"(it was freed while the stream was checked)")
    if status == 3:
        raise MemoryError("host memory for the allocator's bookkeeping ran out")


cdef int _stream_use_status(CachingAllocator self, uintptr_t p, uintptr_t s) noexcept nogil:
    """0: the block at ``p`` is to be recorded on ``s``; 1: no live block
    there; 2: ``s`` is its stream or recorded already. Lock held."""
    cdef Block* b = <Block*>um_find(&self.active, p)
    cdef size_t i
    if b == NULL:
        return 1
    if s == b.stream:
        return 2
    if b.stream_uses != NULL:
        for i in range(b.stream_uses.size()):
            if b.stream_uses[0][i] == s:
                return 2
    return 0


cdef int _add_stream_use(CachingAllocator self, uintptr_t p, uintptr_t s) noexcept nogil:
    """Record ``s`` on the block at ``p``: 0, or 3 when host memory ran out
    (nothing changed then). The stream's table entry counts its uses, so
    that it is not dropped (nor its release told) while a block may need an
    event on it. Lock held."""
    cdef Block* b = <Block*>um_find(&self.active, p)
    cdef StreamPools* sp = self._stream_pools(s)
    if sp == NULL:
        return 3
    if b.stream_uses == NULL:
        b.stream_uses = _new_stream_uses()
        if b.stream_uses == NULL:
            self._drop_stream_if_unused(sp)
            return 3
    if _push_address(b.stream_uses[0], s) != 0:
        self._drop_stream_if_unused(sp)
        return 3
    sp.n_stream_uses += 1
    return 0
