# Included by _core.pyx: handing the recorded history to its hook
# (set_trace_hook), outside the lock and without waiting for another thread.
#
# The events are recorded in C under the lock (CachingAllocator.trace_buffer,
# _trace). Each operation that recorded some takes the buffer when it has let
# the lock go, as one batch, numbered in the order taken. The hook then runs
# on that thread, so that what it looks at (the Python frames of the caller)
# is the caller's. When it returns a callable, the callable is the batch's
# commit: commits run in the order the batches were taken, each by whichever
# thread finds it next in turn, so the history keeps the order of the
# allocator's own operations while no thread waits for another's hook
# (a thread whose batch is not next leaves its commit for the thread that
# commits the one before). PyTorch calls its trace trackers with the
# allocator's mutex held, which orders them by making every thread wait.


cdef class HistoryDelivery:
    """The history hook and the batches prepared for it (see above)."""

    def __cinit__(self, hook):
        self.hook = hook
        self.committing = threading.Lock()
        self.ready = {}
        self.taken = 0
        self.committed = 0


cdef int _deliver_history(CachingAllocator self) except -1:
    """CachingAllocator._flush_trace: take the buffer as the next batch,
    prepare it with the hook on this thread, then commit what is in turn.
    An ordinary exception from the hook (either part) is reported as
    unraisable, since the operations it describes succeeded; a
    KeyboardInterrupt or SystemExit reaches the caller, the batch then
    counting as committed, so that later batches are not held up."""
    cdef vector[TraceEvent] events
    cdef HistoryDelivery delivery
    cdef uint64_t number
    self._lock()
    delivery = self.history
    if delivery is None or self.trace_buffer.empty():
        self._unlock()
        return 0
    events.swap(self.trace_buffer)
    number = delivery.taken
    delivery.taken += 1
    self._unlock()
    commit = None
    interrupt = None
    try:
        batch = [(TRACE_ACTIONS[e.action], e.addr, e.size, e.stream, e.time_ns, _CLIENT_NAMES[e.client])
                 for e in events]
        events.clear()
        commit = delivery.hook(batch)
        if not callable(commit):        # what a plain hook returns is not looked at
            commit = None
    except Exception as exc:
        _report_unraisable(exc, "unimem history hook")
    except BaseException as exc:
        interrupt = exc
    if delivery.committing.acquire(False):
        # Mostly this batch's turn, nobody else committing: no hand-over.
        try:
            if delivery.committed == number:
                delivery.committed += 1
                _run_commit(commit)
            else:
                delivery.ready[number] = commit
            _commit_ready(delivery)
        finally:
            delivery.committing.release()
    else:
        delivery.ready[number] = commit
    _commit_in_turn(delivery)
    if interrupt is not None:
        raise interrupt
    return 0


cdef inline int _run_commit(object commit) except -1:
    if commit is not None:
        try:
            commit()
        except Exception as exc:
            _report_unraisable(exc, "unimem history hook")
    return 0


cdef int _commit_ready(HistoryDelivery delivery) except -1:
    """Run the prepared commits in turn (the commit lock held)."""
    ready = delivery.ready
    while ready and delivery.committed in ready:
        commit = ready.pop(delivery.committed)
        delivery.committed += 1
        _run_commit(commit)
    return 0


cdef int _commit_in_turn(HistoryDelivery delivery) except -1:
    """Run the prepared commits whose turn it is, unless another thread is
    running them (it then runs this thread's too). A batch put in while
    another thread held the commit lock, after that thread last looked,
    is found here once it let the lock go."""
    while delivery.ready and delivery.committed in delivery.ready:
        if not delivery.committing.acquire(False):
            return 0
        try:
            _commit_ready(delivery)
        finally:
            delivery.committing.release()
    return 0


cdef int _set_trace_hook(CachingAllocator self, object hook) except -1:
    """CachingAllocator.set_trace_hook. A new hook starts a new numbering;
    batches taken for the old one still go to it."""
    if hook is not None and not callable(hook):
        raise TypeError(f"the history hook must be callable or None, got {type(hook).__name__}")
    delivery = HistoryDelivery(hook) if hook is not None else None
    self._lock()
    self.history = delivery
    self.recording = hook is not None
    self._update_unusual()
    if hook is None:
        self.trace_buffer.clear()
    self._unlock()
    return 0


cdef void _forget_deliveries_after_fork(CachingAllocator self) noexcept:
    """In a forked child: the batches other threads had taken never come,
    and the commit lock may have been held by one of them."""
    cdef HistoryDelivery delivery = self.history
    if delivery is not None:
        delivery.committing = threading.Lock()
        delivery.ready = {}
        delivery.committed = delivery.taken
