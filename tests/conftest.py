"""Fixtures shared by every layer's tests. Tests are arranged by layer
(core/, backends/, runtime/, front/, integrations/, repository/); what they
share lives in tests/helpers, imported as ``tests.helpers`` (pytest puts the
repository's root on sys.path: ``pythonpath`` in pyproject.toml)."""
import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def make_sim():
    """Build a caching allocator over a fresh simulated device."""
    def make(capacity=8 * GiB, know_capacity=True, **options):
        backend = SimulatedBackend(capacity=capacity)
        allocator = _core.CachingAllocator(backend, 0, **options)
        if know_capacity:
            allocator.set_capacity(capacity)
        return allocator, backend
    return make
