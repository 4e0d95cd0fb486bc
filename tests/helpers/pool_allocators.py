"""Allocators for a MemPool of its own (``MemPool(allocator=...)``, the core's
``create_pool(pool_id, backend)``) over real host memory, for the sleep-mode
tests of such pools.

:class:`PageAllocator` offers the Backend protocol's sleep-mode members:
``release_pages`` gives a segment's pages back (``madvise(MADV_DONTNEED)``:
the bytes read as zeros afterwards, so bytes seen after ``wake_up`` came from
the sleep's copy), ``restore_pages`` takes them back. It checks every call
against what it handed out, so a core that asks it about memory it does not
own, or releases twice, fails loudly. With ``host_accessible=False`` it plays
a device memory the host cannot read: the core must then copy through its
``copy_to_host``/``copy_from_host``."""
import ctypes

from unimem.backends.base import Backend

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, MADV_DONTNEED = 3, 0x22, 4


class PageAllocator(Backend):
    """A pool's own allocator with sleep mode; ``calls`` records each call
    as ``(name, address, size)``; ``hook(name)``, when set, runs first in
    release_pages/restore_pages/copy_to_host/copy_from_host (it may re-enter
    the allocator)."""

    name = "pages"

    def __init__(self, host_accessible=True):
        self.host_accessible = host_accessible
        self.live = {}              # address -> size
        self.released = set()
        self.calls = []
        self.hook = None

    def malloc(self, size, device, stream):
        p = _libc.mmap(None, size, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, -1, 0)
        if p in (None, ctypes.c_void_p(-1).value):
            return 0
        self.live[p] = size
        self.calls.append(("malloc", p, size))
        return p

    def free(self, ptr, size, device, stream):
        assert self.live.pop(ptr) == size and ptr not in self.released
        self.calls.append(("free", ptr, size))
        _libc.munmap(ptr, size)

    def page_release_unavailable_reason(self, device):
        return ""

    def _run_hook(self, name):
        if self.hook is not None:
            self.hook(name)

    def release_pages(self, address, size, device):
        self._run_hook("release")
        if self.live.get(address) != size or address in self.released:
            raise ValueError(f"release_pages({address:#x}, {size}): not a segment of this allocator")
        _libc.madvise(address, size, MADV_DONTNEED)
        self.released.add(address)
        self.calls.append(("release", address, size))

    def restore_pages(self, address, size, device):
        self._run_hook("restore")
        if self.live.get(address) != size or address not in self.released:
            raise ValueError(f"restore_pages({address:#x}, {size}): not a released segment of this allocator")
        self.released.discard(address)
        self.calls.append(("restore", address, size))

    def _owned(self, address, size):
        return any(base <= address and address + size <= base + n and base not in self.released
                   for base, n in self.live.items())

    def copy_to_host(self, host_address, address, size, device):
        assert not self.host_accessible and self._owned(address, size)
        self._run_hook("copy_to_host")
        ctypes.memmove(host_address, address, size)
        self.calls.append(("copy_to_host", address, size))

    def copy_from_host(self, address, host_address, size, device):
        assert not self.host_accessible and self._owned(address, size)
        self._run_hook("copy_from_host")
        ctypes.memmove(address, host_address, size)
        self.calls.append(("copy_from_host", address, size))

    def names(self):
        return [name for name, _, _ in self.calls]


class PlainAllocator:
    """A pool's own allocator with malloc and free only (PyTorch's
    dummy_alloc / dummy_free): it cannot give memory back and keep it."""

    def __init__(self):
        self.pages = PageAllocator()
        self.malloc, self.free = self.pages.malloc, self.pages.free


def in_pool(allocator, pool, size):
    """Allocate ``size`` bytes of a core allocator with this thread routed to ``pool``."""
    allocator.begin_pool(pool)
    try:
        return allocator.malloc(size)
    finally:
        allocator.end_pool(pool)
