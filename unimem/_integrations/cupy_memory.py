"""CuPy's classes for unimem's pool blocks, made once CuPy is imported: the
``Memory`` classes ``unimem.cuda.allocator`` wraps a block in
(:class:`PooledMemory`, and :class:`EmptyMemory` for 0 bytes), and unimem's
``OutOfMemoryError`` that is also CuPy's.

Python code of the CuPy glue (its hot path is :mod:`unimem._integrations.cupy`,
which calls these). They bear the name of the namespace that exports them,
``unimem.cuda`` (``unimem.cuda.PooledMemory``, ``unimem.cuda.OutOfMemoryError``),
and need nothing of it.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

from .. import _core

#: The module these classes are exported from, and named after (reprs, docs).
PUBLIC_MODULE = "unimem.cuda"


def _cupy() -> Any:
    import cupy
    return cupy


def out_of_memory_class() -> type:
    """unimem's OutOfMemoryError that is also CuPy's, so that code written
    for CuPy's pool (``except cupy.cuda.memory.OutOfMemoryError``) keeps working."""
    global _OOM
    if _OOM is None:
        cupy_oom = _cupy().cuda.memory.OutOfMemoryError

        class OutOfMemoryError(_core.OutOfMemoryError, cupy_oom):  # type: ignore[misc, valid-type]
            __doc__ = _core.OutOfMemoryError.__doc__

            def __init__(self, error: _core.OutOfMemoryError) -> None:
                MemoryError.__init__(self, str(error))
                self.__dict__.update(error.__dict__)        # device, requested, capacity, ...
                # what CuPy's OutOfMemoryError keeps (size, total, limit)
                self._size, self._total, self._limit = error.requested, error.allocated, 0

            def __reduce__(self) -> Any:
                # Rebuilt by restore_out_of_memory_error, not by calling the class
                # with its message, so that the class and every attribute survive.
                return (restore_out_of_memory_error, (self.args,), dict(self.__dict__))

        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        OutOfMemoryError.__module__ = PUBLIC_MODULE
        _OOM = OutOfMemoryError
    return _OOM


_OOM: Optional[type] = None


def restore_out_of_memory_error(args: Tuple[Any, ...]) -> BaseException:
    """Unpickle :class:`OutOfMemoryError` (pickle then restores its attributes)."""
    cls = out_of_memory_class()
    error = cls.__new__(cls)
    error.args = args
    return error


def memory_classes() -> Tuple[type, type, type]:
    """CuPy's ``MemoryPointer`` and the ``Memory`` classes for pool blocks,
    made once CuPy is imported."""
    global _MEMORY_CLASSES
    if _MEMORY_CLASSES is not None:
        return _MEMORY_CLASSES
    with _MEMORY_CLASSES_LOCK:            # threads' first allocations: one PooledMemory class
        if _MEMORY_CLASSES is not None:
            return _MEMORY_CLASSES
        memory = _cupy().cuda.memory

        class PooledMemory(memory.UnownedMemory):
            """A block of a unimem pool, as CuPy's ``PooledMemory`` is one of
            its pool: ``size`` is the block's (rounded) size, and the block
            goes back to the pool when this object dies or at :meth:`free`.

            Attributes: ``ptr``, ``size``, ``device_id`` (CuPy's), ``allocation``
            (the unimem block it holds)."""

            __slots__ = ()

            @property
            def allocation(self) -> _core.Allocation:
                return self._owner

            def free(self) -> None:
                """Frees the memory buffer and returns it to the memory pool.

                This function actually does not free the buffer. It just returns
                the buffer to the memory pool for reuse. Later calls do nothing."""
                self._owner.release()
                self.ptr = 0

        class EmptyMemory(memory.Memory):
            """What a pool gives for 0 bytes: a CuPy ``Memory`` at address 0, as
            CuPy's pool gives (``Memory(0)``, made here without a CUDA call)."""

            __slots__ = ()

            def __init__(self, device_id: int) -> None:      # Memory.__init__ would call CUDA
                self.ptr = 0
                self.size = 0
                self.device_id = device_id

        for cls in (PooledMemory, EmptyMemory):
            cls.__module__, cls.__qualname__ = PUBLIC_MODULE, cls.__name__
        _MEMORY_CLASSES = (PooledMemory, EmptyMemory, memory.MemoryPointer)
    return _MEMORY_CLASSES


_MEMORY_CLASSES: Optional[Tuple[type, type, type]] = None
_MEMORY_CLASSES_LOCK = threading.Lock()
