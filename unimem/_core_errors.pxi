# Included by _core.pyx: the errors the core raises and how it reports those
# it must not raise (from finalizers and observers), and the out-of-memory
# message, worded as PyTorch's.

class InvalidDeviceError(ValueError, RuntimeError):
    """A device index that names no device of its type (out of range, or
    negative). A ``ValueError``, as unimem's other bad arguments, and a
    ``RuntimeError``, as PyTorch's "Invalid device argument" is:
    ``except RuntimeError`` written for PyTorch catches it."""


class InvalidPointerError(ValueError, RuntimeError):
    """Freeing an address the allocator does not hold (never allocated by
    it, freed already, or inside a block). A ``ValueError``, as unimem's
    other bad arguments, and a ``RuntimeError``, as PyTorch's "invalid device
    pointer" is: ``except RuntimeError`` written for PyTorch catches it."""


class WriteAfterFreeWarning(RuntimeWarning):
    """Debug mode (``UNIMEM_DEBUG=1``) found memory changed after it was
    freed: something wrote through a pointer it no longer owned."""


class OutOfMemoryError(MemoryError, RuntimeError):
    """Raised when a device allocation cannot be satisfied, even after the cache
    was released (the analogue of ``torch.OutOfMemoryError``).

    It is a ``MemoryError`` and, as ``torch.OutOfMemoryError`` is, a
    ``RuntimeError``: ``except RuntimeError`` written for PyTorch catches it.

    Attributes: ``device`` (the device index), ``requested`` (bytes asked),
    ``capacity``, ``free``, ``allocated``, ``reserved`` (bytes, as reported
    when the error was raised).
    """

    def __init__(self, message, device=None, requested=0, capacity=0, free=0,
                 allocated=0, reserved=0):
        super().__init__(message)
        self.device = device
        self.requested = requested
        self.capacity = capacity
        self.free = free
        self.allocated = allocated
        self.reserved = reserved

    def __reduce__(self):
        # BaseException pickles as cls(*args): keep the class and the attributes.
        return (type(self), (str(self),), dict(self.__dict__))




cdef extern from "Python.h":
    void PyErr_SetObject(object exc_type, object value)
    void PyErr_WriteUnraisable(object where)


cdef void _report_unraisable(BaseException exc, str where):
    """Report an error from a callback that must not raise (a finalizer, an
    observer) through sys.unraisablehook, as Python does for __del__."""
    PyErr_SetObject(type(exc), exc)
    PyErr_WriteUnraisable(where)


cdef int _tell_each(object callback, list calls, str where) except -1:
    """``callback(*args)`` for each of ``calls``, a backend's optional
    notification: an error is reported as unraisable and the others still
    run; a Ctrl-C (KeyboardInterrupt, SystemExit) is raised once all ran."""
    interrupt = None
    for args in calls:
        try:
            callback(*args)
        except Exception as exc:
            _report_unraisable(exc, where)
        except BaseException as exc:
            interrupt = exc
    if interrupt is not None:
        raise interrupt
    return 0


def format_size(size):
    """Bytes as PyTorch's out-of-memory messages write them (c10's
    format_size): up to 1024 in bytes, then KiB, MiB, and GiB however large
    ("800000000.00 GiB")."""
    if size is None:
        return "unknown"
    size = int(size)
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


HANDLE_OWNED_MESSAGE = (
    "pointer {:#x} belongs to an unimem Allocation: release it with Allocation.release() "
    "or drop the Allocation (freeing its address directly would let the Allocation "
    "free another owner's block later)")


cdef object _out_of_memory_error(CachingAllocator self, object requested, object tried):
    """Build (and report) the OutOfMemoryError for a failed request of
    ``requested`` bytes, for which a segment of ``tried`` bytes was asked
    (PyTorch's message names the latter)."""
    self._lock()
    allowed_text = ""
    if self.set_fraction:
        allowed_text = f"{format_size(self.allowed_memory_maximum)} allowed; "
    if self.max_allocation and tried > self.max_allocation:
        allowed_text += (f"It allows at most {format_size(self.max_allocation)} "
                         f"in one allocation. ")
    self._unlock()
    allocated, reserved, free, total = _count_out_of_memory(self, requested)
    name = self.device_name
    api = getattr(self.backend, "api_name", None) or name
    if requested >= ONE_EXABYTE:
        message = f"{api} out of memory. Tried to allocate more than 1EB memory."
    else:
        capacity_text = (f"has a total capacity of {format_size(total)} of which "
                         f"{format_size(free)} is free. " if total is not None and free is not None
                         else "has an unknown capacity. ")
        message = (
            f"{api} out of memory. Tried to allocate {format_size(tried)}. "
            f"{name} {self.device} {capacity_text}{allowed_text}"
            f"Of the allocated memory {format_size(allocated)} is allocated by unimem, "
            f"and {format_size(reserved - allocated)} is reserved by unimem but unallocated."
        )
    return OutOfMemoryError(message, device=self.device, requested=requested,
                            capacity=total or 0, free=free or 0,
                            allocated=allocated, reserved=reserved)


cdef tuple _count_out_of_memory(CachingAllocator self, object requested):
    """What every OutOfMemoryError raised for ``requested`` bytes does first:
    count it (``num_ooms``), record it in the history, and call the
    out-of-memory observers. Returns ``(allocated, reserved, free, total)``
    as the observers were told (free and total None when the backend cannot
    say). Not with the lock held: the observers and the history hook run
    Python."""
    self._lock()
    self.stats.num_ooms += 1
    allocated = pool_current(&self.stats, S_ALLOCATED_BYTES)
    reserved = pool_current(&self.stats, S_RESERVED_BYTES)
    if self.recording:
        self._trace(T_OOM, 0, min(self._round_size(min(requested, MAX_REQUEST)), <object>INT64_MAX), 0)
    observers = list(self.oom_observers)
    self._unlock()
    self._flush_trace()
    try:
        free, total = backend_memory_info(self.backend, self.device)
    except Exception:
        free, total = None, (self.capacity or None)
    for observer in observers:
        try:
            observer(self.device, requested, allocated, reserved, free)
        except Exception as exc:        # a Ctrl-C in an observer reaches the caller
            _report_unraisable(exc, "unimem out-of-memory observer")
    return allocated, reserved, free, total
