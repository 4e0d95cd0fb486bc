# Included by _core.pyx (after CachingAllocator): fork(), whose child would
# keep the locks other threads held.
#
# Before fork() each allocator's lock is taken (waiting a little at most), so
# that the child gets allocators in a consistent state, not one caught half-way
# through another thread's update. A lock that cannot be had in time (its
# holder waits on something) is reset in the child as before.
cdef list _held_for_fork = []


def _before_fork():
    cdef CachingAllocator allocator
    _held_for_fork.clear()
    for allocator in list(_live_allocators):
        if allocator._lock_for_fork():
            _held_for_fork.append(allocator)


def _after_fork_in_parent():
    cdef CachingAllocator allocator
    for allocator in _held_for_fork:
        allocator._unlock()
    _held_for_fork.clear()


def _after_fork_in_child():
    _held_for_fork.clear()
    for allocator in list(_live_allocators):
        allocator._reset_lock_after_fork()


cdef object _reset_after_fork(CachingAllocator self):
    """In the child: only this thread survived. The lock is free, the
    events another thread was waiting on are pending again, and the
    other threads' uses of pools are over."""
    self.lock.reset_after_fork()
    self.lock_depth = 0
    self.in_flight_bytes = 0                # the backend calls of threads that are gone
    self.in_flight_calls.clear()
    # A sleep() or wake_up() another thread had under way stops where it
    # was: its state stays, and wake_up() in the child ends it.
    self.sleep_busy = 0
    _forget_tellers_after_fork(self)        # another thread was telling the backend about streams
    _untake_after_fork(self)                # another thread was asking about events, or recording them
    _forget_other_threads_routes(self)
    self.trace_buffer.clear()
    _forget_deliveries_after_fork(self)


cdef int _forget_tellers_after_fork(CachingAllocator self) except -1:
    """The streams another thread was telling the backend about have no
    teller in the child: each is told again at the next release told, what
    the table says of it then (a release if it has no entry)."""
    cdef cmap[uintptr_t, uint8_t].iterator it = self.stream_notices.telling.begin()
    while it != self.stream_notices.telling.end():
        self.stream_notices.dropped.push_back(deref(it).first)
        inc(it)
    self.stream_notices.telling.clear()
    return 0
