"""``unimem.capi``: unimem's pools from C and C++, and as PyTorch's allocator.

A shared library with a C ABI (the header ``unimem.h`` in :func:`get_include`)
allocates from the same caching pools as unimem's Python side, so that PyTorch
(through its pluggable allocators), CuPy (``unimem.cuda.allocator``), dpnp
(``unimem.xpu.set_allocator()``) and C code share one cache and one set of
statistics::

    cc -shared -fPIC mylib.c -I"$(python -c 'import unimem.capi as c; print(c.get_include())')" \\
        -L<dir of library_path()> -l:<its file name> -Wl,-rpath,<that dir>

The library is unimem's extension module ``unimem._integrations.capi``: it works in a
process whose Python imported unimem (``import unimem`` sets it up); called
before that, its functions return ``NULL`` and ``unimem_last_error()`` says
why. :func:`pluggable_allocator` builds PyTorch's ``CUDAPluggableAllocator`` /
``XPUPluggableAllocator`` over it (``unimem.cuda.pluggable_allocator()``,
``unimem.xpu.pluggable_allocator()``); ``unimem.install_allocators(torch=True)``
installs them.
"""
from __future__ import annotations

import os

from ._integrations import capi as _capi
# PyTorch's allocator over the library: the PyTorch glue's, exported here
from ._integrations.torch import pluggable_allocator

__all__ = ["ABI_VERSION", "library_path", "get_include", "pluggable_allocator"]

#: The version of the C ABI: ``UNIMEM_ABI_VERSION`` of ``unimem.h``, and what
#: the library's ``unimem_abi_version()`` returns.
ABI_VERSION: int = _capi.ABI_VERSION


def library_path() -> str:
    """The path of the shared library that exports ``unimem.h``'s functions."""
    return os.path.abspath(_capi.__file__)


def get_include() -> str:
    """The folder that holds ``unimem.h`` (pass it to the compiler with ``-I``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
