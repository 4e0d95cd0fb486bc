# The facade's fastest functions: ``caching_allocator_alloc`` and
# ``caching_allocator_delete`` of ``unimem.accelerator`` and of each device
# namespace (``unimem.xpu``, ...). Included by registry.pyx.
#
# Why they are built this way (issue 25: the Python-API pair against a pair of
# ``dict.get`` calls, counted with callgrind):
#
# * Each public function is a *builtin* function (``PyCFunction``,
#   ``METH_FASTCALL | METH_KEYWORDS``), not a Cython ``def``. The interpreter
#   specialises a call of a builtin in its own loop (3.11's
#   PRECALL_BUILTIN_FAST_WITH_KEYWORDS, 3.12's CALL_BUILTIN_FAST_WITH_KEYWORDS:
#   the path ``dict.get`` takes); a Cython function is called through the
#   generic vectorcall, its result checked, and its keyword parser run even
#   for one positional argument: about 180 instructions a pair more.
# * The builtin handles the call PyTorch code makes on every step, one
#   positional argument, itself. Any other call (keywords, a device, a stream,
#   a wrong number of arguments) is handed unchanged to a Cython function of
#   the full signature (``size, device=None, stream=None`` / ``mem_ptr``),
#   which parses and checks it: its errors, with its name, are the ones the
#   caller sees, as before.
# * The last address handed out keeps its Python int (see _address_object).
from cpython.object cimport PyObject
from cpython.long cimport PyLong_FromSize_t

import sys


cdef extern from *:
    """
    /* A builtin function over ``fn`` (a METH_FASTCALL | METH_KEYWORDS entry,
       declared by Cython as returning ``object``): ``def`` is filled in and
       must live as long as the function (it is a field of ``self``, whose
       reference the function holds, or a static). */
    static PyObject* um_fastcall_function(PyMethodDef* def, const char* name, void* fn,
                                          const char* doc, PyObject* self, PyObject* module) {
        def->ml_name = name;
        def->ml_meth = (PyCFunction)(void (*)(void))fn;
        def->ml_flags = METH_FASTCALL | METH_KEYWORDS;
        def->ml_doc = doc;
        return PyCFunction_NewEx(def, self, module);
    }
    """
    ctypedef struct PyMethodDef:
        pass
    object um_fastcall_function(PyMethodDef* definition, const char* name, void* fn, const char* doc,
                                PyObject* self, object module)
    object PyObject_Vectorcall(object callable, PyObject** args, size_t nargsf, PyObject* kwnames)


# ---------------------------------------------------------------------------
# The last address handed out, with its Python int
# ---------------------------------------------------------------------------
# A loop that frees and allocates the same size gets the same block back, so
# the same address: its int is returned again (a reference more) instead of a
# new one made and, one call later, freed (about 170 instructions a pair,
# half the Python layer's own work). An int is immutable, so sharing it is
# invisible; only the identity test on the free path relies on the pairing
# (the int still holds the address it was made from).
cdef size_t _last_address = 0
cdef object _last_address_int = 0


cdef inline object _address_object(size_t p):
    global _last_address, _last_address_int
    if p == _last_address:
        return _last_address_int
    value = PyLong_FromSize_t(p)
    _last_address_int = value
    _last_address = p
    return value


cdef inline object _alloc_one(DeviceRegistry registry, object size):
    """The common request (no device, no stream) on ``registry``: straight to
    a one-device registry's allocator when it has no current-stream function
    and ``size`` is an exact int in range; the checked path otherwise."""
    cdef size_t n = 0
    cdef CachingAllocator a = registry.only
    if (a is not None and registry.current_stream_fn is None and exact_size(size, &n)
            and n <= MAX_REQUEST):
        return _address_object(a.c_malloc(n, 0))
    return registry._alloc(size, None, None)


cdef inline int _delete_one(DeviceRegistry registry, object ptr) except -1:
    """Free ``ptr`` on ``registry``: on a one-device registry's allocator when
    the address is live there; the checked path (which says why not, or finds
    it on another device) otherwise."""
    cdef size_t p = 0
    cdef CachingAllocator a = registry.only
    if a is not None:
        if ptr is _last_address_int:
            p = _last_address               # the int made from this address
        elif not exact_size(ptr, &p):
            p = 0
        if p != 0 and a._try_free(p, False, False) == 0:
            return 0
    return registry._delete(ptr)


# ---------------------------------------------------------------------------
# unimem.accelerator's pair: the current accelerator's registry
# ---------------------------------------------------------------------------
_ALLOC_DOC = r"""Perform a memory allocation using the current accelerator's caching allocator.

Memory is allocated for a given device and a stream, this
function is intended to be used for interoperability with other
frameworks. Allocated memory is released through
:func:`~unimem.accelerator.caching_allocator_delete`.

Args:
    size (int): number of bytes to be allocated.
    device (int, optional): selected device. If it is
        ``None`` the current device is used.
    stream (int or stream object, optional): selected stream. If is ``None`` then
        the default stream for the selected device is used.

Returns:
    int: the address of the allocated memory (0 when ``size`` is 0).
"""

_DELETE_DOC = r"""Delete memory allocated using the current accelerator's caching allocator.

Memory allocated with :func:`~unimem.accelerator.caching_allocator_alloc`.
is freed here. The associated device and stream are tracked inside
the allocator.

Args:
    mem_ptr (int): memory address to be freed by the allocator.
"""

_ALLOC_SIGNATURE = "caching_allocator_alloc(size, device=None, stream=None)\n--\n\n"
_DELETE_SIGNATURE = "caching_allocator_delete(mem_ptr)\n--\n\n"


def _checked_functions():
    """The full-signature functions every other call goes to (named as the
    public ones: their argument errors name them)."""
    def caching_allocator_alloc(size, device=None, stream=None):
        registry = _current()
        if (device is not None and _device_index_resolver is not None
                and (isinstance(device, bool) or not isinstance(device, int))):
            device = _device_index_resolver(device)    # "xpu:0", a device: as every accelerator function
        return registry._alloc(size, device, stream)

    def caching_allocator_delete(mem_ptr):
        _current()._delete(mem_ptr)

    return caching_allocator_alloc, caching_allocator_delete


cdef object _checked_alloc, _checked_delete
_checked_alloc, _checked_delete = _checked_functions()


cdef object _accelerator_alloc(PyObject* unused, PyObject** args, Py_ssize_t nargs, PyObject* kwnames):
    if nargs == 1 and kwnames == NULL:
        return _alloc_one(_current(), <object>args[0])
    return PyObject_Vectorcall(_checked_alloc, args, <size_t>nargs, kwnames)


cdef object _accelerator_delete(PyObject* unused, PyObject** args, Py_ssize_t nargs, PyObject* kwnames):
    if nargs == 1 and kwnames == NULL:
        _delete_one(_current(), <object>args[0])
        return None
    return PyObject_Vectorcall(_checked_delete, args, <size_t>nargs, kwnames)


cdef PyMethodDef _alloc_definition, _delete_definition
# The docstrings of the two definitions, as C strings kept alive with the module.
cdef bytes _alloc_doc = (_ALLOC_SIGNATURE + _ALLOC_DOC).encode()
cdef bytes _delete_doc = (_DELETE_SIGNATURE + _DELETE_DOC).encode()
caching_allocator_alloc = um_fastcall_function(
    &_alloc_definition, "caching_allocator_alloc", <void*>_accelerator_alloc, _alloc_doc, NULL, __name__)
caching_allocator_delete = um_fastcall_function(
    &_delete_definition, "caching_allocator_delete", <void*>_accelerator_delete, _delete_doc, NULL, __name__)


# ---------------------------------------------------------------------------
# A namespace's pair (unimem.xpu, ...): the device type looked up every call
# ---------------------------------------------------------------------------
@cython.final
cdef class NamespaceAllocFunctions:
    """What one namespace's ``caching_allocator_alloc``/``delete`` (builtins
    bound to this object) work with. The device type is looked up in
    ``types`` (the front's live table), and its registry kept until the
    type leaves the table: a replaced type's registry is marked ``retired``
    (devices.install_type), so a replaced backend is seen at the next call,
    and a call costs one flag test instead of a dict lookup (about 60
    instructions each, a quarter of the namespace's own cost)."""
    cdef PyMethodDef alloc_definition, delete_definition
    cdef bytes alloc_doc, delete_doc    # the definitions' docstrings, as C strings
    cdef dict types
    cdef str type_name
    cdef DeviceRegistry cached_registry
    cdef object checked_alloc, checked_delete

    cdef inline DeviceRegistry registry(self):
        """The type's registry, or None when the type is not set up."""
        cdef DeviceRegistry found = self.cached_registry
        if found is not None and not found.retired:
            return found
        dtype = self.types.get(self.type_name)
        if dtype is None:
            return None
        self.cached_registry = <DeviceRegistry?>dtype.registry
        return self.cached_registry


cdef object _namespace_alloc(NamespaceAllocFunctions self, PyObject** args, Py_ssize_t nargs,
                             PyObject* kwnames):
    cdef DeviceRegistry registry
    if nargs == 1 and kwnames == NULL:
        registry = self.registry()
        if registry is not None:
            return _alloc_one(registry, <object>args[0])
    return PyObject_Vectorcall(self.checked_alloc, args, <size_t>nargs, kwnames)


cdef object _namespace_delete(NamespaceAllocFunctions self, PyObject** args, Py_ssize_t nargs,
                              PyObject* kwnames):
    cdef DeviceRegistry registry
    if nargs == 1 and kwnames == NULL:
        registry = self.registry()
        if registry is not None:
            _delete_one(registry, <object>args[0])
            return None
    return PyObject_Vectorcall(self.checked_delete, args, <size_t>nargs, kwnames)


def namespace_alloc_functions(dict types, str type_name, slow_alloc, slow_delete):
    """``caching_allocator_alloc`` and ``caching_allocator_delete`` for the
    namespace of device type ``type_name`` (``unimem.xpu``, ...): the device
    type is looked up in ``types`` (the front's live table) on every call, so
    a replaced backend is seen at once; a call naming a device, or on a type
    not set up yet, goes to ``slow_alloc`` / ``slow_delete`` (the front's
    checked methods, whose docstrings and module the functions take)."""
    def caching_allocator_alloc(size, device=None, stream=None):
        dtype = types.get(type_name)
        if dtype is None or device is not None:
            return slow_alloc(size, device, stream)
        return (<DeviceRegistry?>dtype.registry)._alloc(size, None, stream)

    def caching_allocator_delete(mem_ptr):
        dtype = types.get(type_name)
        if dtype is None:
            return slow_delete(mem_ptr)
        (<DeviceRegistry?>dtype.registry)._delete(mem_ptr)

    cdef NamespaceAllocFunctions functions = NamespaceAllocFunctions.__new__(NamespaceAllocFunctions)
    functions.types = types
    # Interned, as the table's keys are (devices.get_type): the lookup then
    # matches the key by identity instead of comparing the strings' bytes
    # (about 50 instructions a call when the names were made apart).
    functions.type_name = sys.intern(type_name)
    functions.checked_alloc = caching_allocator_alloc
    functions.checked_delete = caching_allocator_delete
    functions.alloc_doc = (_ALLOC_SIGNATURE + _cleandoc(slow_alloc)).encode()
    functions.delete_doc = (_DELETE_SIGNATURE + _cleandoc(slow_delete)).encode()
    module = getattr(slow_alloc, "__module__", __name__)
    alloc = um_fastcall_function(&functions.alloc_definition, "caching_allocator_alloc",
                                 <void*>_namespace_alloc, functions.alloc_doc, <PyObject*>functions, module)
    delete = um_fastcall_function(&functions.delete_definition, "caching_allocator_delete",
                                  <void*>_namespace_delete, functions.delete_doc, <PyObject*>functions, module)
    return alloc, delete


def _cleandoc(function):
    import inspect
    return inspect.cleandoc(function.__doc__ or "")
