"""The provider ABI (unimem/_native/provider.h): a backend that publishes a C
malloc/free in a capsule is called through it only when the struct's version
is the one the core was built with; otherwise through its Python methods."""
import ctypes

import pytest

from unimem import _core
from unimem.backends.simulated import SimulatedBackend

CAPSULE_NAME = b"unimem.RawAllocatorAPI"
PROVIDER_VERSION = 2        # UM_PROVIDER_VERSION in provider.h

MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t))
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                        ctypes.c_int, ctypes.c_size_t)


class RawAllocatorAPI(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("ctx", ctypes.c_void_p), ("malloc", MALLOC), ("free", FREE)]


class CapsuleBackend(SimulatedBackend):
    """A simulated device that also publishes a C face (ctypes callbacks into
    the same simulation), counting which way the core called it."""

    def __init__(self, version):
        super().__init__()
        self.c_calls = {"malloc": 0, "free": 0}
        self.py_calls = {"malloc": 0, "free": 0}

        def c_malloc(ctx, size, device, stream, out):
            self.c_calls["malloc"] += 1
            out[0] = SimulatedBackend.malloc(self, size, device, stream)
            return 0

        def c_free(ctx, ptr, size, device, stream):
            self.c_calls["free"] += 1
            SimulatedBackend.free(self, ptr, size, device, stream)
            return 0

        self._callbacks = (MALLOC(c_malloc), FREE(c_free))
        self._api = RawAllocatorAPI(version, None, *self._callbacks)
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._raw_api = new_capsule(ctypes.addressof(self._api), CAPSULE_NAME, None)

    def malloc(self, size, device=0, stream=0):
        self.py_calls["malloc"] += 1
        return super().malloc(size, device, stream)

    def free(self, ptr, size, device=0, stream=0):
        self.py_calls["free"] += 1
        super().free(ptr, size, device, stream)


@pytest.mark.parametrize("version, way", [(PROVIDER_VERSION, "c_calls"), (1, "py_calls"), (3, "py_calls")])
def test_the_core_calls_a_provider_through_c_only_at_its_own_abi_version(version, way):
    backend = CapsuleBackend(version)
    allocator = _core.CachingAllocator(backend, 0)
    allocator.free(allocator.malloc(4096))
    allocator.empty_cache()
    assert getattr(backend, way) == {"malloc": 1, "free": 1}
    other = "py_calls" if way == "c_calls" else "c_calls"
    assert getattr(backend, other) == {"malloc": 0, "free": 0}
    allocator._check_invariants()
