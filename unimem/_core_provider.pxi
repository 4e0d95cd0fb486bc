# Included by _core.pyx: the calls into the backend. Through the provider ABI
# (C, no GIL) when the backend publishes one of this version, else through its
# Python methods; timed for backend_timing(). Cache misses and returns only.

cdef int _backend_malloc(CachingAllocator self, size_t size, uintptr_t stream, uintptr_t* out,
                         PrivatePool* pool, bint unlocked, int64_t* took_us) except -1:
    """Ask the backend (or the allocator of private pool ``pool``, when it
    has one) for ``size`` bytes. 0: got it; 1: out of memory. ``unlocked``:
    the allocator's lock is not held, so a C provider is called without the
    GIL. It writes nothing of the allocator: the time it took goes to
    ``took_us``, for the caller to count under the lock."""
    cdef int rc
    cdef int64_t t0 = um_now_ns()
    py_malloc = self._py_malloc
    out[0] = 0
    took_us[0] = 0
    if pool != NULL and pool.has_backend:
        py_malloc = self.pool_backends[pool.id].malloc
    elif self._has_raw:
        if unlocked:
            with nogil:
                rc = self._raw.malloc(self._raw.ctx, size, self.device, stream, out)
        else:
            rc = self._raw.malloc(self._raw.ctx, size, self.device, stream, out)
        if rc == RAW_OK and out[0] != 0:
            took_us[0] = (um_now_ns() - t0) // 1000
            return 0
        if rc == RAW_OUT_OF_MEMORY:
            return 1
        # Anything else: let the Python method explain itself below.
    try:
        ptr = py_malloc(size, self.device, stream)
    except MemoryError:
        return 1
    if ptr is None or ptr == 0:
        return 1
    try:
        out[0] = as_integer(ptr, "an address")   # 4096.5 is no address, True no pointer
    except (TypeError, OverflowError):
        # The memory (if any) cannot be described, so it cannot be given back.
        raise TypeError(f"backend malloc must return an address as a positive int, got {ptr!r}") from None
    took_us[0] = (um_now_ns() - t0) // 1000
    return 0


cdef int _backend_free(CachingAllocator self, uintptr_t ptr, size_t size, uintptr_t stream,
                       bint release_gil, object free_fn=None) except -1:
    """Give memory back. ``release_gil`` only when the lock is not held.
    ``free_fn``: a private pool's allocator's free, for its segments."""
    cdef int rc
    cdef int64_t t0 = um_now_ns()
    if free_fn is not None:
        free_fn(ptr, size, self.device, stream)
        duration_add(&self.stats.device_free_time, (um_now_ns() - t0) // 1000)
        return 0
    if self._has_raw:
        if release_gil:
            with nogil:
                rc = self._raw.free(self._raw.ctx, ptr, size, self.device, stream)
        else:
            rc = self._raw.free(self._raw.ctx, ptr, size, self.device, stream)
        if rc == RAW_OK:
            duration_add(&self.stats.device_free_time, (um_now_ns() - t0) // 1000)
            return 0
    self._py_free(ptr, size, self.device, stream)
    duration_add(&self.stats.device_free_time, (um_now_ns() - t0) // 1000)
    return 0


def backend_memory_info(backend, int device):
    """``backend.memory_info(device)`` as ``(free, total)`` ints, checked:
    ``NotImplementedError`` when the backend has no ``memory_info`` (it is
    optional), ``RuntimeError`` when what it returned is no pair of
    byte counts (neither can be used as a capacity)."""
    memory_info = getattr(backend, "memory_info", None)
    if memory_info is None:
        raise NotImplementedError(f"the backend {type(backend).__name__} has no memory_info: "
                                  f"the device's free and total memory are not known")
    answer = memory_info(device)
    try:
        free, total = answer
        free, total = as_integer(free, "free bytes"), as_integer(total, "total bytes")
        if not (0 <= free < 1 << 64 and 0 <= total < 1 << 64):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise RuntimeError(f"the backend {type(backend).__name__}'s memory_info({device}) returned "
                           f"{answer!r}: expected (free, total) bytes as two non-negative ints") from None
    return free, total
