"""Which pages of device 0 a backend with virtual memory has mapped
(``mapped_pages``: the simulated devices and the cpu pool's host backend),
in 2 MiB pages."""

MiB = 1 << 20


def mapped(backend, ptr, size):
    """Whether every 2 MiB page of [ptr, ptr + size) is mapped."""
    return all(p in backend.mapped_pages[0] for p in range(ptr, ptr + size, 2 * MiB))


def unmapped(backend, ptr, size):
    return not any(p in backend.mapped_pages[0] for p in range(ptr, ptr + size, 2 * MiB))
