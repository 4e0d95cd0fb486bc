# An open-addressing hash table from non-zero 64-bit keys to pointers, used
# for address -> allocated block and size -> size class. Linear probing with
# a Fibonacci hash, backward-shift deletion (no tombstones).
from libc.stdint cimport uint64_t
from libc.stdlib cimport free as sys_free, calloc

cdef struct U64Map:
    uint64_t* keys
    void** vals
    size_t mask
    size_t count
    int shift

cdef inline size_t um_slot(const U64Map* m, uint64_t key) noexcept nogil:
    return <size_t>((key * <uint64_t>0x9E3779B97F4A7C15) >> m.shift)

cdef inline int um_init(U64Map* m, size_t capacity_log2) noexcept nogil:
    cdef size_t cap = (<size_t>1) << capacity_log2
    m.keys = <uint64_t*>calloc(cap, sizeof(uint64_t))
    m.vals = <void**>calloc(cap, sizeof(void*))
    if m.keys == NULL or m.vals == NULL:
        sys_free(m.keys)
        sys_free(m.vals)
        m.keys = NULL
        m.vals = NULL
        return -1
    m.mask = cap - 1
    m.count = 0
    m.shift = 64 - <int>capacity_log2
    return 0

cdef inline void um_destroy(U64Map* m) noexcept nogil:
    sys_free(m.keys)
    sys_free(m.vals)
    m.keys = NULL
    m.vals = NULL
    m.count = 0

cdef inline void* um_find(const U64Map* m, uint64_t key) noexcept nogil:
    cdef size_t i = um_slot(m, key)
    cdef uint64_t k
    while True:
        k = m.keys[i]
        if k == key:
            return m.vals[i]
        if k == 0:
            return NULL
        i = (i + 1) & m.mask

cdef inline void um_put_unchecked(U64Map* m, uint64_t key, void* val) noexcept nogil:
    cdef size_t i = um_slot(m, key)
    while m.keys[i] != 0 and m.keys[i] != key:
        i = (i + 1) & m.mask
    if m.keys[i] == 0:
        m.count += 1
        m.keys[i] = key
    m.vals[i] = val

cdef inline int um_reserve(U64Map* m, size_t wanted) noexcept nogil:
    """Make room for ``wanted`` entries at a load of at most one half."""
    if wanted * 2 <= m.mask + 1:
        return 0
    return um_grow(m, wanted)

cdef inline int um_grow(U64Map* m, size_t wanted) noexcept nogil:
    cdef U64Map bigger
    cdef size_t log2 = 64 - m.shift
    while ((<size_t>1) << log2) < wanted * 2:
        log2 += 1
    if um_init(&bigger, log2) != 0:
        return -1
    cdef size_t i
    for i in range(m.mask + 1):
        if m.keys[i] != 0:
            um_put_unchecked(&bigger, m.keys[i], m.vals[i])
    um_destroy(m)
    m[0] = bigger
    return 0

cdef inline int um_put(U64Map* m, uint64_t key, void* val) noexcept nogil:
    if um_reserve(m, m.count + 1) != 0:
        return -1
    um_put_unchecked(m, key, val)
    return 0

cdef inline size_t um_find_slot(const U64Map* m, uint64_t key) noexcept nogil:
    """The slot holding ``key``, or one past the table when absent."""
    cdef size_t i = um_slot(m, key)
    cdef uint64_t k
    while True:
        k = m.keys[i]
        if k == key:
            return i
        if k == 0:
            return m.mask + 1
        i = (i + 1) & m.mask

cdef inline void* um_pop(U64Map* m, uint64_t key) noexcept nogil:
    """Remove ``key`` and return its value (NULL when absent)."""
    cdef size_t i = um_find_slot(m, key)
    if i > m.mask:
        return NULL
    return um_erase_slot(m, i)

cdef inline void* um_erase_slot(U64Map* m, size_t i) noexcept nogil:
    """Remove the entry in slot ``i``; return its value.

    Backward-shift deletion keeps probe sequences intact without tombstones,
    so lookups stay short however many frees happen.
    """
    cdef size_t j, home
    cdef void* val = m.vals[i]
    j = i
    while True:
        j = (j + 1) & m.mask
        if m.keys[j] == 0:
            break
        home = um_slot(m, m.keys[j])
        # Move the entry at j back to the hole at i unless its home lies
        # cyclically in (i, j].
        if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            m.keys[i] = m.keys[j]
            m.vals[i] = m.vals[j]
            i = j
    m.keys[i] = 0
    m.vals[i] = NULL
    m.count -= 1
    return val
