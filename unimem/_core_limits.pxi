# Included by _core.pyx: the memory limits (PyTorch's set_per_process_memory_fraction,
# CuPy's MemoryPool.set_limit) and the policy in force, as set up by __init__
# (_set_policy, in _core_checks.pxi) and read back by ``settings``. The limit is checked where a
# segment is made (_alloc_block) and where a sleep's memory comes back
# (_restore_span).


cdef object _set_memory_fraction(CachingAllocator self, double fraction):
    """CachingAllocator.set_memory_fraction."""
    if not (0.0 <= fraction <= 1.0):
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    free, total = backend_memory_info(self.backend, self.device)
    self._lock()
    self.capacity = total
    self.fraction = fraction
    self.set_fraction = True
    self.limit_in_bytes = False
    self.allowed_memory_maximum = <size_t>(fraction * total)
    self._unlock()


cdef object _set_memory_limit(CachingAllocator self, limit):
    """CachingAllocator.set_memory_limit."""
    cdef object n = check_size(limit)
    if n > MAX_RESERVED:
        raise ValueError(f"memory limit too large: {n} bytes")
    self._lock()
    if n == 0:
        self.set_fraction = False
        self.limit_in_bytes = False
        self.fraction = 1.0
    else:
        self.set_fraction = True
        self.limit_in_bytes = True
        self.allowed_memory_maximum = n
        self.fraction = (<double>n / self.capacity) if self.capacity else 1.0
    self._unlock()


cdef object _settings(CachingAllocator self):
    """CachingAllocator.settings."""
    return {
        "max_split_size": -1 if self.policy.max_split_size == SIZE_UNSET else self.policy.max_split_size,
        "max_non_split_rounding": self.policy.max_non_split_rounding,
        "roundup_power2_divisions": [self.policy.roundup_divisions[i] for i in range(K_ROUNDUP_INTERVALS)],
        "garbage_collection_threshold": self.policy.gc_threshold,
        "max_reserved_ratio": self.policy.max_reserved_ratio or None,
        "memory_fraction": self.fraction if self.set_fraction else None,
        "exact_segments": bool(self.policy.exact_segments),
        "expandable_segments": bool(self.expandable),
    }
