# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""Page-aligned host memory: the backend of the ``cpu`` device pool, and the
fallback of the pinned host pool when neither CUDA nor SYCL can pin memory.

Segments come straight from the operating system (``mmap``) and go back to it
(``munmap``), as device memory goes back to a device: ``empty_cache()`` really
returns host memory, which glibc's malloc would keep in its heap. Its malloc
and free are published to the core as C functions (no Python, no GIL on a
cache miss).

It also offers virtual memory (``expandable_segments``): an address range is
reserved with ``mmap(PROT_NONE, MAP_NORESERVE)`` (no memory, no commit
charge) and pages are mapped into it and out of it by the host page (see
:meth:`PageAlignedBackend.map_pages` for how, and why that way).

And sleep mode: the memory behind a segment from malloc is given back while
its addresses stay reserved (:meth:`PageAlignedBackend.release_pages`) and
mapped again at the same addresses (:meth:`PageAlignedBackend.restore_pages`).
For that the segments handed out are recorded (a C table under its own
lock, on the miss path only), and those two calls are refused on any span
that is not exactly one of them."""
from cpython.pycapsule cimport PyCapsule_New
from libc.errno cimport errno, ENOMEM
from libc.stdint cimport uintptr_t
from libcpp.unordered_map cimport unordered_map
from posix.mman cimport (mmap, munmap, mprotect, madvise, PROT_NONE, PROT_READ, PROT_WRITE, MAP_PRIVATE,
                         MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE, MAP_FAILED, MADV_DONTNEED)
from posix.unistd cimport sysconf, _SC_PAGESIZE
from cython.operator cimport dereference as deref

from unimem._native.provider cimport (RawAllocatorAPI, RAW_OK, RAW_OUT_OF_MEMORY, RAW_ERROR,
                                      UM_PROVIDER_CAPSULE, UM_PROVIDER_VERSION)

import os

from .address_ranges import AddressRanges, as_int

#: The host page: what the virtual memory calls map and unmap by.
PAGE_SIZE = sysconf(_SC_PAGESIZE)

cdef extern from "csupport.hpp" nogil:
    cppclass UMLock:
        void lock()
        void unlock()
        void reset_after_fork()

# The segments malloc handed out and free has not taken back (address ->
# size): release_pages and restore_pages put mappings over memory with
# MAP_FIXED, and act only on exactly one of these.
cdef unordered_map[uintptr_t, size_t] held_segments
cdef UMLock held_segments_lock


cdef inline bint is_held_segment(uintptr_t address, size_t size) noexcept nogil:
    """Whether ``[address, address+size)`` is exactly a live segment. Lock held."""
    cdef unordered_map[uintptr_t, size_t].iterator it = held_segments.find(address)
    return it != held_segments.end() and deref(it).second == size


cdef int host_malloc(void* ctx, size_t size, int device, uintptr_t stream,
                     uintptr_t* out) noexcept nogil:
    cdef void* p
    out[0] = 0
    if size == 0:
        return RAW_OUT_OF_MEMORY
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        return RAW_OUT_OF_MEMORY
    held_segments_lock.lock()
    held_segments[<uintptr_t>p] = size
    held_segments_lock.unlock()
    out[0] = <uintptr_t>p
    return RAW_OK


cdef int host_free(void* ctx, uintptr_t ptr, size_t size, int device,
                   uintptr_t stream) noexcept nogil:
    """munmap a segment malloc handed out, whole: munmap would as readily take
    away someone else's mapping, or part of a segment (leaving the rest
    mapped and unknown), so anything else is refused with nothing done."""
    held_segments_lock.lock()
    if not is_held_segment(ptr, size):
        held_segments_lock.unlock()
        return RAW_ERROR
    held_segments.erase(ptr)
    held_segments_lock.unlock()
    return RAW_OK if munmap(<void*>ptr, size) == 0 else RAW_ERROR


def reset_after_fork_in_child():
    """After fork() in the child: a thread that held the segment table's lock
    is gone. Called by the package's one fork handler (unimem/_runtime/fork.py)."""
    held_segments_lock.reset_after_fork()


cdef RawAllocatorAPI HOST_API
HOST_API.version = UM_PROVIDER_VERSION
HOST_API.ctx = NULL
HOST_API.malloc = host_malloc
HOST_API.free = host_free


def _meminfo():
    """(available, total) physical memory in bytes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available, total


cdef void* reserve_pages(void* at, size_t n) noexcept nogil:
    """``n`` bytes of address space with no memory and no commit charge
    behind them (any access faults): anywhere when ``at`` is NULL, else
    replacing whatever is mapped at ``at`` (``MAP_FIXED``)."""
    cdef int fixed = MAP_FIXED if at != NULL else 0
    return mmap(at, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | fixed, -1, 0)


def _not_a_segment(a, n):
    return (f"[{a:#x}, {a + n:#x}) is not a segment this backend handed out (give the address "
            f"malloc returned and the size it was asked for)")


def _segment_span(address, size, device):
    """``(address, size)`` of a release_pages/restore_pages call, as numbers
    a segment can have (which one is checked under the table's lock)."""
    _check_host_device(device)
    a = as_int(address, "address")
    n = as_int(size, "size")
    if a <= 0 or n <= 0 or a + n > 1 << 64:
        raise ValueError(_not_a_segment(a, n))
    return a, n


def _checked_size(size):
    """A size as malloc and free take it: an int (``operator.index``), not
    negative."""
    n = as_int(size, "size")
    if n < 0 or n >= 1 << 64:
        raise ValueError(f"size must be a byte count from 0 to 2**64 - 1, got {n}")
    return n


def _check_host_device(device):
    """The host is one device, 0."""
    if as_int(device, "device") != 0:
        raise ValueError(f"the host has one device, 0; got device {device}")


cdef class PageAlignedBackend:
    """Plain host memory from ``mmap`` (page aligned, not pinned).

    Args:
        name: what the device is called in messages ("CPU" for the cpu pool).
    """

    cdef readonly str name
    cdef readonly object _raw_api
    cdef readonly bint host_accessible      # debug mode may fill and check it
    cdef readonly bint survives_fork        # plain memory: the child has a copy
    #: The exact record of the address ranges reserved and the pages mapped
    #: (``unimem.backends.address_ranges``): every virtual memory call is
    #: checked against it before any system call, since mmap(MAP_FIXED) and
    #: madvise would silently act on memory that is not the pool's.
    cdef readonly object address_ranges

    def __init__(self, str name="CPU"):
        self.name = name
        self._raw_api = PyCapsule_New(&HOST_API, UM_PROVIDER_CAPSULE, NULL)
        self.host_accessible = True
        self.survives_fork = True
        self.address_ranges = AddressRanges(PAGE_SIZE)

    def malloc(self, size, int device=0, stream=0):
        cdef uintptr_t out = 0
        cdef size_t n = _checked_size(size)
        if host_malloc(NULL, n, device, 0, &out) != RAW_OK:
            raise MemoryError(f"mmap could not provide {n} bytes")
        return out

    def free(self, ptr, size, int device=0, stream=0):
        """Give ``size`` bytes at ``ptr`` (as allocated) back to the system.
        ``ValueError`` for anything but a segment :meth:`malloc` handed out
        and its size (nothing is unmapped then)."""
        address = as_int(ptr, "ptr")
        cdef size_t n = _checked_size(size)
        if not 0 < address < 1 << 64:
            raise ValueError(_not_a_segment(address, n))
        cdef uintptr_t a = address
        held_segments_lock.lock()
        held = is_held_segment(a, n)
        held_segments_lock.unlock()
        if not held:
            raise ValueError(_not_a_segment(a, n))
        if host_free(NULL, a, n, device, 0) != RAW_OK:
            raise OSError(f"munmap({a:#x}, {n}) failed")

    def device_count(self):
        return 1

    def memory_info(self, int device=0):
        return _meminfo()

    def record_event(self, stream, device):
        return None

    def event_done(self, event):
        return True

    def event_synchronize(self, event):
        pass

    # The rest of the Backend protocol (unimem.backends.base), with its
    # defaults: plain memory has no queues, events or allocation limit.
    def max_allocation_size(self, int device=0):
        return 0

    def check_stream(self, stream, device):
        pass

    def release_stream(self, stream, device):
        pass

    def abandoned_streams(self, streams, device):
        return []

    def sweep_released_streams(self):
        pass

    def release_event(self, event):
        pass

    def synchronize(self, device):
        pass

    # -- virtual memory (expandable segments) -----------------------------
    # Called by the core with the GIL; the lock of the record is held from
    # the check to the record, the GIL is not held in the system calls.
    def virtual_memory_granularity(self, device=0):
        """The host page (``sysconf(_SC_PAGESIZE)``): mmap maps by it."""
        _check_host_device(device)
        return PAGE_SIZE

    def reserve_address_range(self, size, device=0):
        """``mmap(PROT_NONE, MAP_NORESERVE)``: address space only, no memory
        and no commit charge; any access faults until pages are mapped."""
        cdef size_t n
        cdef void* p
        cdef int err = 0
        _check_host_device(device)
        ranges = self.address_ranges
        checked = ranges.check_size(size)
        if checked > <size_t>-1:
            raise MemoryError(f"cannot reserve {checked} bytes: more than the address space")
        n = checked
        with ranges.lock:
            with nogil:
                p = reserve_pages(NULL, n)
                if p == MAP_FAILED:
                    err = errno
            if p == MAP_FAILED:
                raise MemoryError(f"mmap could not reserve {n} bytes of address space: {os.strerror(err)}")
            ranges.record_reserve(<uintptr_t>p, n)
        return <uintptr_t>p

    def map_pages(self, address, size, device=0):
        """Back the span with memory: a fresh read-write private mapping put
        over it with ``MAP_FIXED``, without ``MAP_NORESERVE``.

        Why that and not ``mprotect``: the new mapping is charged against the
        kernel's commit limit at once, so a span the system cannot back fails
        here with ``ENOMEM`` (a ``MemoryError``): always under strict
        overcommit (``vm.overcommit_memory=2``), and for a span larger than
        RAM and swap under the default heuristic. ``mprotect`` of the
        ``MAP_NORESERVE`` reservation is never charged (except under strict
        overcommit), and touching or ``MAP_POPULATE`` cannot report a failure
        at all: Linux answers a shortage while faulting pages in with the OOM
        killer, never with an error. Pages are not touched here (faulted in
        on first use, as ``malloc``'s ``mmap`` memory is), so mapping costs
        no time proportional to the size."""
        cdef uintptr_t a
        cdef size_t n
        cdef void* p
        cdef int err = 0
        _check_host_device(device)
        ranges = self.address_ranges
        with ranges.lock:
            a, n = ranges.check_map(address, size)
            with nogil:
                p = mmap(<void*>a, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                if p == MAP_FAILED:
                    err = errno
                    # Linux before 6.12 could remove the old mapping before
                    # failing the charge: put the reservation back, so the
                    # span stays reserved and no other mmap lands in it.
                    reserve_pages(<void*>a, n)
            if p == MAP_FAILED:
                if err == ENOMEM:
                    raise MemoryError(f"the system cannot commit {n} more bytes of host memory "
                                      f"(mmap: {os.strerror(err)})")
                raise OSError(err, f"mmap could not map [{a:#x}, {a + n:#x}): {os.strerror(err)}")
            ranges.record_map(a, n)

    #: Unmapping host pages waits for nothing: unmap_pages serves the core's
    #: allocation path as it is (Backend.unmap_idle_pages).
    unmap_idle_pages = None

    def unmap_pages(self, address, size, device=0):
        """Give the pages back: a fresh ``PROT_NONE``, ``MAP_NORESERVE``
        mapping is put over the span, which frees its pages (RSS falls at
        once), gives back the commit charge (``mprotect(PROT_NONE)`` would
        keep it) and makes any later access fault. Should that fail (the
        kernel's limit on mappings), ``madvise(MADV_DONTNEED)`` and
        ``mprotect(PROT_NONE)`` free the pages all the same."""
        cdef uintptr_t a
        cdef size_t n
        cdef int err = 0
        _check_host_device(device)
        ranges = self.address_ranges
        with ranges.lock:
            a, n = ranges.check_unmap(address, size)
            with nogil:
                if reserve_pages(<void*>a, n) == MAP_FAILED:
                    if madvise(<void*>a, n, MADV_DONTNEED) != 0 or mprotect(<void*>a, n, PROT_NONE) != 0:
                        err = errno
            if err:
                raise OSError(err, f"could not unmap [{a:#x}, {a + n:#x}): {os.strerror(err)}")
            ranges.record_unmap(a, n)

    def release_address_range(self, address, size, device=0):
        """``munmap`` a reserved range with no page mapped."""
        cdef uintptr_t a
        cdef size_t n
        cdef int rc
        _check_host_device(device)
        ranges = self.address_ranges
        with ranges.lock:
            a, n = ranges.check_release(address, size)
            with nogil:
                rc = munmap(<void*>a, n)
            if rc != 0:
                raise OSError(f"munmap({a:#x}, {n}) failed")
            ranges.record_release(a)

    # -- sleep mode (segments from malloc) ----------------------------------
    def page_release_unavailable_reason(self, device=0):
        """"": a segment's memory can be given back and its addresses kept."""
        _check_host_device(device)
        return ""

    def release_pages(self, address, size, device=0):
        """Give back the memory of the segment ``[address, address+size)``
        (exactly one malloc returned) and keep its addresses: the same
        ``PROT_NONE``, ``MAP_NORESERVE`` mapping as :meth:`unmap_pages` puts
        over it (RSS falls at once, the commit charge goes, any access
        faults); should that fail, ``madvise(MADV_DONTNEED)`` and
        ``mprotect(PROT_NONE)``. Raises with the memory still readable (its
        contents may be gone if only the madvise worked)."""
        cdef uintptr_t a
        cdef size_t n
        cdef int err = 0
        cdef bint known
        a, n = _segment_span(address, size, device)
        with nogil:
            held_segments_lock.lock()
            known = is_held_segment(a, n)
            if known and reserve_pages(<void*>a, n) == MAP_FAILED:
                if madvise(<void*>a, n, MADV_DONTNEED) != 0 or mprotect(<void*>a, n, PROT_NONE) != 0:
                    err = errno
            held_segments_lock.unlock()
        if not known:
            raise ValueError(_not_a_segment(a, n))
        if err:
            raise OSError(err, f"could not give back the memory of [{a:#x}, {a + n:#x}): {os.strerror(err)}")

    # The Backend protocol's copies between device and host memory: this
    # memory is host memory, which the core's sleep copies itself
    # (host_accessible), so they are never needed; declared so that the
    # backend meets the protocol, refusing as its defaults do.
    def copy_to_host(self, host_address, address, size, device=0):
        """Not needed for host memory (the core copies it): ``NotImplementedError``."""
        raise NotImplementedError("host memory is copied by the caller itself (host_accessible)")

    def copy_from_host(self, address, host_address, size, device=0):
        """Not needed for host memory (the core copies it): ``NotImplementedError``."""
        raise NotImplementedError("host memory is copied by the caller itself (host_accessible)")

    def restore_pages(self, address, size, device=0):
        """Back the segment ``[address, address+size)`` with memory again, at
        the same addresses: a fresh read-write mapping over it, charged to the
        commit limit at once (``ENOMEM`` is a ``MemoryError`` and the
        addresses stay reserved, as :meth:`map_pages`). Its bytes are zero."""
        cdef uintptr_t a
        cdef size_t n
        cdef void* p = NULL
        cdef int err = 0
        cdef bint known
        a, n = _segment_span(address, size, device)
        with nogil:
            held_segments_lock.lock()
            known = is_held_segment(a, n)
            if known:
                p = mmap(<void*>a, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                if p == MAP_FAILED:
                    err = errno
                    reserve_pages(<void*>a, n)
            held_segments_lock.unlock()
        if not known:
            raise ValueError(_not_a_segment(a, n))
        if err == ENOMEM:
            raise MemoryError(f"the system cannot commit {n} more bytes of host memory (mmap: {os.strerror(err)})")
        if err:
            raise OSError(err, f"mmap could not map [{a:#x}, {a + n:#x}) again: {os.strerror(err)}")

    def pinned_host_backend(self):
        """The pinned pool of a host-only machine: page-aligned memory too."""
        return PageAlignedBackend("host")

    @property
    def api_name(self):
        return None

    @property
    def explicit_device_count(self):
        return None

    @property
    def pinning(self):
        return "page-aligned"

    @property
    def _raw_owner(self):
        return self         # the capsule's functions need no context

    def __repr__(self):
        return f"<unimem PageAlignedBackend {self.name}>"

