# The checks every entry point makes on its Python arguments (sizes,
# addresses, stream handles): an integer as operator.index reads it, bools and
# floats refused, with a clear TypeError or ValueError. Inline, because the
# hot path runs exact_size() on every request.
from cpython.number cimport PyNumber_Index
from libc.stdint cimport uintptr_t


cdef inline object as_integer(object value, str what):
    """``value`` as a Python int, as ``operator.index`` reads it: bools,
    floats and objects whose ``__index__`` returns no int are refused."""
    if type(value) is int:
        return value
    if value is None or isinstance(value, (bool, float, complex, str, bytes)):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    try:
        return PyNumber_Index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None


cdef inline object check_size(object size):
    """A request size as a non-negative Python int, or a clear error."""
    n = as_integer(size, "size (a number of bytes)")
    if n < 0:
        raise ValueError(f"size must be non-negative, got {n}")
    return n


cdef extern from *:
    """
    /* An exact int that fits a size_t, read straight from the object: no
       Python-level operation and no try block (whose saving and restoring
       of the exception state the hot path would pay on every call). */
    static inline int um_exact_size_t(PyObject* o, size_t* out) {
        if (Py_TYPE(o) != &PyLong_Type)
            return 0;
        size_t v = PyLong_AsSize_t(o);
        if (v == (size_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();             /* negative, or beyond 2**64 */
            return 0;
        }
        *out = v;
        return 1;
    }
    """
    bint um_exact_size_t(object o, size_t* out)


cdef inline bint exact_size(object size, size_t* out):
    """The hot path's test: ``size`` is an int that fits a size_t (written
    to ``out``), read without any Python-level operation. False for
    anything else, which then goes through check_size."""
    return um_exact_size_t(size, out)


cdef inline uintptr_t check_pointer(object ptr) except? 0:
    """An address as a pointer, or a clear error: TypeError for what is not
    an integer, ValueError for an integer that is no address."""
    cdef size_t address
    if um_exact_size_t(ptr, &address):
        return address
    if type(ptr) is int:
        raise ValueError(f"invalid pointer {ptr!r}: not an address")
    ptr = as_integer(ptr, "an address")
    if ptr < 0 or ptr >= (1 << 64):
        raise ValueError(f"invalid pointer {ptr!r}: not an address")
    return ptr


cdef inline uintptr_t check_stream(object stream) except? 0:
    if stream is None:
        return 0
    stream = as_integer(stream, "a stream handle")
    if stream < 0:
        raise ValueError(f"stream handle must be non-negative, got {stream}")
    if stream >= (1 << 64):
        raise ValueError(f"stream handle {stream} does not fit in a pointer")
    return stream
