"""Fixtures of the backend tests: every backend unimem ships, one at a time
(tests/helpers/backend_cases.py), for the conformance suite."""
import pytest

from tests.helpers.backend_cases import CASES, allocator_library  # noqa: F401  (fixture)


@pytest.fixture(params=[case.param() for case in CASES])
def backend_case(request):
    """A :class:`~tests.helpers.backend_cases.BackendCase`."""
    return request.param


@pytest.fixture
def conforming_backend(backend_case, request):
    """A fresh backend of ``backend_case`` (skipped where its runtime is absent)."""
    return backend_case.make(request)
