# Included by _core.pyx: who holds what. Every block remembers the framework
# it was handed out to (Block.client, a Client of _native/blocks.pxd, set by
# the one byte store of _hand_out); each entry point says who it serves:
# CuPy's allocators (device and pinned), the dpnp hook and the SYCL
# interposer, Numba's EMM plugin, PyTorch's pluggable allocator and plain C
# through the C ABI, and unimem's own functions (the default). Nothing is
# counted on the hot path: the totals are summed over the live blocks when
# asked (a cold call).

#: The frameworks a block can be handed out to, as snapshots and
#: memory_allocated_by_client name them (Client's order, CLIENT_UNIMEM first).
CLIENTS = ("unimem", "torch", "cupy", "dpnp", "numba", "c")

# By Client code: None for CLIENT_NONE (no block, or one never handed out).
_CLIENT_NAMES = (None,) + CLIENTS
_CLIENT_CODES = {name: code for code, name in enumerate(_CLIENT_NAMES) if name is not None}


cdef unsigned char _client_code(object client) except 255:
    """The Client code of a client's name (one of CLIENTS)."""
    if not isinstance(client, str):
        raise TypeError(f"client must be a str (one of {', '.join(CLIENTS)}), not {type(client).__name__}")
    code = _CLIENT_CODES.get(client)
    if code is None:
        raise ValueError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")
    return code


cdef object _allocated_by_client(CachingAllocator self):
    """CachingAllocator.memory_allocated_by_client: the live blocks' bytes
    summed by client under the lock, the dict made after it."""
    cdef size_t totals[N_CLIENTS]
    cdef size_t i
    cdef int k
    cdef Block* b
    memset(totals, 0, sizeof(totals))
    self._lock()
    for i in range(self.active.mask + 1):
        if self.active.keys[i] != 0:
            b = <Block*>self.active.vals[i]
            totals[b.client if b.client < N_CLIENTS else CLIENT_NONE] += b.size
    self._unlock()
    return {_CLIENT_NAMES[k]: totals[k] for k in range(<int>CLIENT_UNIMEM, <int>N_CLIENTS) if totals[k]}


# sizeof(Block), for the test that keeps it at 120 bytes (blocks.pxd says why).
_BLOCK_BYTES = sizeof(Block)
