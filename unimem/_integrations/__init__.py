"""Each framework's glue, one module per framework over the core's and the
runtime's entry points (as RMM keeps ``rmm.allocators.{cupy,numba,torch}``):

- :mod:`.cupy` (``unimem.cuda.allocator``'s hot path) and :mod:`.cupy_memory`
  (CuPy's classes for pool blocks, its ``OutOfMemoryError``);
- :mod:`.dpnp` (``unimem.xpu.set_allocator()``), with :mod:`.usm_memory`
  (dpctl memory objects over pool blocks);
- :mod:`.sycl_interposer` (dpnp's C++ scratch buffers);
- :mod:`.torch` (PyTorch's pluggable allocators), :mod:`.numba` (Numba's
  memory manager), :mod:`.capi` (the C ABI's library, ``unimem.h``);
- :mod:`.install`: ``unimem.install_allocators``, which puts the namespaces'
  allocators into the frameworks (the one module here above the namespaces).

The glue never imports a namespace (``unimem.cuda``, ``unimem.xpu``, ...): a
namespace imports its glue and exports it (tests/repository/test_layers.py).
"""
