import os
import sys

import pytest

# Tests import the model beside them.
sys.path.insert(0, os.path.dirname(__file__))

from unimem import _core  # noqa: E402
from unimem.backends.simulated import SimulatedBackend  # noqa: E402

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
