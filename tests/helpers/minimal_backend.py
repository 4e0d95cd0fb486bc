"""A backend with only the two required members (malloc and free) that does
not subclass Backend: what the core must serve with its defaults."""
from unimem.backends.simulated import SimulatedBackend


class MinimalBackend:
    """malloc and free of a simulated device, nothing else."""

    def __init__(self):
        self.inner = SimulatedBackend()

    def malloc(self, size, device, stream):
        return self.inner.malloc(size, device, stream)

    def free(self, ptr, size, device, stream):
        self.inner.free(ptr, size, device, stream)
