"""``unimem.cpu``: a device-style caching pool on plain host memory.

The accelerator of last resort (no GPU, no SYCL device), with the full device
statistics: the same functions as ``unimem.xpu`` and ``unimem.cuda``.
Not to be confused with :mod:`unimem.host`, the pinned staging pool.
"""
from ._memory_api import PUBLIC_FUNCTIONS, MemoryAPI

_api = MemoryAPI("cpu")
globals().update(_api.functions())

__all__ = list(PUBLIC_FUNCTIONS)
