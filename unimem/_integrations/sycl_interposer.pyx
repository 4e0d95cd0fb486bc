# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False
"""dpnp's C++ scratch buffers from unimem's pools: an opt-in interposer of SYCL's USM functions.

``unimem.xpu.set_allocator()`` serves every dpnp array allocated from Python.
dpnp's compiled extensions also allocate small scratch buffers (packed shapes
and strides, reduction, sort and indexing temporaries, LAPACK scratchpads)
with SYCL's C++ functions directly; dpnp 0.20's extension modules import
exactly ``sycl::aligned_alloc(align, size, device, context, usm::alloc, ...)``,
``sycl::aligned_alloc_device(align, size, device, context, ...)``,
``sycl::malloc_device/malloc_shared/malloc(size, queue, ...)`` and
``sycl::free(ptr, context | queue, ...)``. This module defines those symbols
(``sycl_interposer.hpp``); :func:`install` makes the dynamic linker bind
dpnp's imports to them, and each request is then served from a pool or
forwarded to libsycl.

How: Python loads extension modules ``RTLD_LOCAL``, and a module's
undefined symbols are looked up in the global scope first, then in its own
dependencies (where libsycl is). :func:`install` promotes this very module
to the global scope (``dlopen(its file, RTLD_NOLOAD | RTLD_GLOBAL)``), so it
must run before dpnp's extensions are loaded: it refuses with
``RuntimeError`` when they are. One module rather than a separate tiny
library: promoting the already-imported module needs no second file to load
and no table of function pointers handed between two objects; the link's
version script (setup.py) keeps everything but the interposed names and
``PyInit`` out of the dynamic symbol table, so the global scope gains
nothing else.

Served: calls from dpnp's own object files (oneMKL's SYCL libraries bind to
the same names but keep their memory to themselves), on a thread holding the
GIL (the pool's slow path may run Python), of more than zero bytes, with an
alignment of at most 512 (the pool's block alignment), for a device and SYCL
context unimem's pools serve (the context of unimem's default queue for the
device: the dpnp allocator's own routes decide which pool, if any, serves
each USM kind). A pool out of memory answers ``nullptr``, as SYCL does, and
dpnp raises its own error. Everything else goes to libsycl, counted by
reason (:data:`REASONS`).

Frees: a block handed out goes back through the core's GIL-free entry
(``c_free_detached``); any other pointer goes to libsycl. A free on a thread
without the GIL (a SYCL host task: dpctl's ``async_smart_free``, after the
kernels) returns the block at once; a free from Python code (an error path
right after a kernel submission, where the real free would block until the
kernels using the memory are done) first waits, without the GIL, for the
queue it names and for every queue of the device unimem holds.
"""
from cpython.exc cimport PyErr_SetInterrupt, PyErr_SetObject, PyErr_WriteUnraisable
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uintptr_t

from unimem._core cimport CachingAllocator
from unimem._native.blocks cimport CLIENT_DPNP

import importlib.util
import os
import struct
import sys
import threading

from unimem.backends import _dpctl_api


# The callbacks: all but the free are called with the GIL held.
cdef extern from "sycl_interposer.hpp":
    ctypedef uintptr_t (*um_si_pool_malloc_fn "um_si::pool_malloc_fn")(void* pool, size_t size, int* status) noexcept
    ctypedef void (*um_si_pool_free_fn "um_si::pool_free_fn")(void* pool, uintptr_t ptr) noexcept nogil
    ctypedef void* (*um_si_pool_find_fn "um_si::pool_find_fn")(int device, int kind) noexcept
    ctypedef void (*um_si_wait_fn "um_si::wait_fn")(int device, const void* queue) noexcept
    void um_si_set_callbacks(um_si_pool_malloc_fn m, um_si_pool_free_fn f, um_si_pool_find_fn p,
                             um_si_wait_fn w)

cdef extern from "sycl_interposer.hpp" nogil:
    void* um_si_defined(int entry)
    const char* um_si_mangled(int entry)
    const char* um_si_entry_name(int entry)
    int um_si_n_entries()
    int um_si_n_reasons()
    void um_si_set_real(int entry, void* fn)
    void um_si_set_dpctl(void* device_eq, void* context_eq, void* queue_device, void* queue_context,
                         void* device_delete, void* context_delete)
    int um_si_add_device(const void* device, const void* context)
    int um_si_prepare(const char* served_prefix)
    void um_si_set_installed(bint on)
    bint um_si_installed()
    const char* um_si_find_library(const char* prefix)
    long long um_si_calls(int entry)
    long long um_si_bypassed_calls(int reason)
    long long um_si_bypassed_bytes(int reason)
    long long um_si_counter(int which)

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flags)
    void* dlsym(void* handle, const char* symbol)
    char* dlerror()
    int RTLD_NOW, RTLD_GLOBAL, RTLD_NOLOAD


#: Why a request went to libsycl instead of a pool, in :func:`counters`' order:
#: the interposer was not installed (a refused install), unimem itself was
#: allocating on that thread, the caller is not one of dpnp's object files,
#: zero bytes, an alignment above 512 or not a power of two, an unknown USM
#: kind, no GIL on the calling thread (a SYCL thread, or the interpreter
#: exiting), a device or SYCL context the pools do not serve, no pool for that
#: USM kind, an error in the pool other than out-of-memory (reported as unraisable).
REASONS = ("not_installed", "unimem_itself", "other_library", "zero_size", "alignment", "other_arguments",
           "no_gil", "foreign_context", "no_pool", "pool_error")
#: The interposed functions, as :func:`counters` names their calls.
ENTRY_POINTS = tuple(um_si_entry_name(i).decode() for i in range(um_si_n_entries()))
#: Their mangled names: what dpnp's extensions import and libsycl exports.
MANGLED_NAMES = tuple(um_si_mangled(i).decode() for i in range(um_si_n_entries()))
USM_KINDS = ("host", "device", "shared")          # sycl::usm::alloc's values 0, 1, 2
# The SYCL USM functions of namespace sycl::_V1, as a mangled name spells them.
USM_FUNCTIONS = frozenset(("malloc", "malloc_device", "malloc_shared", "malloc_host", "aligned_alloc",
                           "aligned_alloc_device", "aligned_alloc_shared", "aligned_alloc_host", "free"))
SYCL_NAMESPACE = "_ZN4sycl3_V1"
DPCTL_FUNCTIONS = ("DPCTLDevice_AreEq", "DPCTLContext_AreEq", "DPCTLQueue_GetDevice", "DPCTLQueue_GetContext",
                   "DPCTLDevice_Delete", "DPCTLContext_Delete", "DPCTLQueue_Wait")

if len(REASONS) != um_si_n_reasons():
    raise ImportError("unimem._integrations.sycl_interposer: REASONS does not match the C++ side's reasons")

_lock = threading.Lock()
# Python's side of the callbacks, set by install(): (usm_type, index) -> pool
# or None; index -> wait for the device's queues.
cdef object _find_pool = None
cdef object _wait_device = None
cdef void* _queue_wait = NULL


cdef inline void _pin(object obj) noexcept:
    """Keep ``obj`` alive until the process ends, even through the
    interpreter's finalization (no container to be cleared): the C registry
    and the blocks handed out point at it, and SYCL's threads free blocks
    until the very end."""
    Py_INCREF(obj)


# ---------------------------------------------------------------------------
# the callbacks the C++ side calls (with the GIL, except _pool_free)
# ---------------------------------------------------------------------------
cdef void _unraisable(BaseException exc, str where) noexcept:
    """Report an error no C++ caller can be told of, as Python does for
    ``__del__``; a Ctrl-C is raised again at Python's next check instead."""
    if isinstance(exc, KeyboardInterrupt):
        PyErr_SetInterrupt()
        return
    PyErr_SetObject(type(exc), exc)
    PyErr_WriteUnraisable(where)


cdef uintptr_t _pool_malloc(void* pool, size_t size, int* status) noexcept:
    status[0] = 0
    try:
        return (<CachingAllocator>pool).c_malloc(size, 0, False, CLIENT_DPNP)     # dpnp's C++ scratch
    except MemoryError:                 # OutOfMemoryError included: SYCL answers nullptr
        status[0] = 1
    except BaseException as exc:
        status[0] = 2
        _unraisable(exc, "unimem: a SYCL scratch request from the pool (passed to libsycl)")
    return 0


cdef void _pool_free(void* pool, uintptr_t ptr) noexcept nogil:
    (<CachingAllocator>pool).c_free_detached(ptr)


cdef void* _pool_find(int device, int kind) noexcept:
    cdef object pool
    try:
        pool = _find_pool(USM_KINDS[kind], device)
    except BaseException as exc:
        _unraisable(exc, "unimem: looking up the pool of SYCL scratch requests (passed to libsycl)")
        return NULL
    if pool is None:
        return NULL
    _pin(pool)                           # its blocks' frees point at it, from any thread, until exit
    return <void*>pool


ctypedef void (*queue_wait_fn)(const void* queue) noexcept nogil


cdef void _wait_for_device(int device, const void* queue) noexcept:
    if queue != NULL:                    # the queue the caller named, first
        with nogil:
            (<queue_wait_fn>_queue_wait)(queue)
    try:
        _wait_device(device)             # unimem.xpu's synchronize: each wait lets the GIL go
    except BaseException as exc:
        _unraisable(exc, "unimem: waiting for a device's queues before a SYCL scratch block goes back")


um_si_set_callbacks(_pool_malloc, _pool_free, _pool_find, _wait_for_device)


# ---------------------------------------------------------------------------
# what install() checks: dpnp's imports, libsycl's exports, the global scope
# ---------------------------------------------------------------------------
def dpnp_directory():
    """dpnp's package folder, found without importing dpnp (``None`` if dpnp
    is not installed)."""
    spec = importlib.util.find_spec("dpnp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def loaded_objects():
    """The file names of every object file loaded in this process."""
    names = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                names.append(parts[5].rstrip("\n"))
    return sorted(set(names))


def loaded_under(folder):
    """The object files loaded from under ``folder`` (a real path)."""
    prefix = folder.rstrip(os.sep) + os.sep
    return [name for name in loaded_objects() if os.path.realpath(name).startswith(prefix)]


def _elf_dynamic(path):
    """``(undefined dynamic symbols, DT_NEEDED names)`` of a 64-bit
    little-endian ELF shared object (what ``nm -D --undefined-only`` and
    ``readelf -d`` print), read from its section headers."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def read(section):
            f.seek(section[4])
            return f.read(section[5])
        undefined, needed = [], []
        for section in sections:
            kind, link = section[1], section[6]
            if kind == 11:                                   # SHT_DYNSYM
                strings, symbols = read(sections[link]), read(section)
                for offset in range(24, len(symbols), 24):   # entry 0 is the null symbol
                    name, info, other, shndx = struct.unpack_from("<IBBH", symbols, offset)
                    if shndx == 0 and name:
                        undefined.append(strings[name:strings.index(b"\0", name)].decode())
            elif kind == 6:                                  # SHT_DYNAMIC
                strings, entries = read(sections[link]), read(section)
                for offset in range(0, len(entries), 16):
                    tag, value = struct.unpack_from("<qQ", entries, offset)
                    if tag == 1:                             # DT_NEEDED
                        needed.append(strings[value:strings.index(b"\0", value)].decode())
    return undefined, needed


def _usm_function(mangled):
    """The name of the ``sycl::_V1`` USM function ``mangled`` names, or None."""
    if not mangled.startswith(SYCL_NAMESPACE):
        return None
    rest = mangled[len(SYCL_NAMESPACE):]
    digits = len(rest) - len(rest.lstrip("0123456789"))
    if not digits:
        return None
    length = int(rest[:digits])
    name = rest[digits:digits + length]
    # "E" closes the nested name: a function of sycl::_V1 itself, not of a class in it
    if rest[digits + length:digits + length + 1] != "E" or name not in USM_FUNCTIONS:
        return None
    return name


def check_dpnp_imports(folder, libsycl_soname):
    """Raise ``RuntimeError`` unless every SYCL USM function that dpnp's
    object files under ``folder`` import is one this module defines, and
    they take it from ``libsycl_soname``; returns ``{file: [names]}``."""
    imports = {}
    unknown = set()
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if ".so" not in name:
                continue
            path = os.path.join(root, name)
            undefined, needed = _elf_dynamic(path)
            usm = sorted(s for s in undefined if _usm_function(s))
            if not usm:
                continue
            imports[os.path.relpath(path, folder)] = usm
            unknown.update(s for s in usm if s not in MANGLED_NAMES)
            sycl = [n for n in needed if n.startswith("libsycl.so")]
            if sycl and libsycl_soname not in sycl:
                raise RuntimeError(f"dpnp's {name} links {', '.join(sycl)}, not the loaded {libsycl_soname}: "
                                   f"the SYCL interposer would forward its calls to another libsycl")
    if unknown:
        raise RuntimeError(f"dpnp's extensions import SYCL USM functions the interposer does not define "
                           f"({', '.join(sorted(unknown))}): a block could reach a free it does not see; "
                           f"this dpnp is not the one it was written for (0.20)")
    if not imports:
        raise RuntimeError(f"no object file under {folder} imports a SYCL USM function: nothing to interpose")
    return imports


def _bind_libsycl():
    """Find the loaded libsycl and each real function; returns its path."""
    found = um_si_find_library(b"libsycl.so")
    if found == NULL:
        raise RuntimeError("libsycl is not loaded (dpctl loads it): cannot find SYCL's real functions")
    path = found.decode()
    cdef void* handle = dlopen(found, RTLD_NOW | RTLD_NOLOAD)
    if handle == NULL:
        raise RuntimeError(f"cannot open the loaded {path}: {(<bytes>dlerror()).decode()}")
    missing = []
    cdef void* fn
    for i, name in enumerate(MANGLED_NAMES):
        fn = dlsym(handle, name.encode())
        if fn == NULL:
            missing.append(name)
        else:
            um_si_set_real(i, fn)
    if missing:
        raise RuntimeError(f"{path} does not export {', '.join(missing)}: the interposer would have nothing "
                           f"to forward to (another SYCL version than dpnp 0.20's)")
    return path


def _soname(path):
    """The SONAME-like file name of a loaded library (libsycl.so.9 for libsycl.so.9.0.0)."""
    base = os.path.basename(path)
    parts = base.split(".so.")
    return parts[0] + ".so." + parts[1].split(".")[0] if len(parts) == 2 else base


def _global_definitions():
    """``{mangled name: address}`` of the interposed names the global scope
    defines now. (The main program's handle searches exactly the global scope;
    RTLD_DEFAULT would search this module's own scope too, which holds it.)"""
    cdef void* fn
    cdef void* main_program = dlopen(NULL, RTLD_NOW)
    found = {}
    for name in MANGLED_NAMES:
        fn = dlsym(main_program, name.encode())
        if fn != NULL:
            found[name] = <uintptr_t>fn
    return found


# ---------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------
def _bind_dpctl(runtime):
    global _queue_wait
    address = runtime.c_functions(DPCTL_FUNCTIONS)
    um_si_set_dpctl(<void*><uintptr_t>address["DPCTLDevice_AreEq"], <void*><uintptr_t>address["DPCTLContext_AreEq"],
                    <void*><uintptr_t>address["DPCTLQueue_GetDevice"],
                    <void*><uintptr_t>address["DPCTLQueue_GetContext"],
                    <void*><uintptr_t>address["DPCTLDevice_Delete"],
                    <void*><uintptr_t>address["DPCTLContext_Delete"])
    # unimem's serialized wait (see unimem.backends._dpctl_api.wait_queue), not DPCTLQueue_Wait itself
    _queue_wait = <void*><uintptr_t>_dpctl_api.queue_wait_address()


def install(pool_for):
    """Serve dpnp's C++ scratch buffers from unimem's pools, for the rest of
    the process. Must run before dpnp is imported; a second call is a no-op.
    ``pool_for(usm_type, index, queue)`` says which pool serves a request:
    unimem.xpu's (``unimem.xpu._pool_for``), which the dpnp allocator routes by too.

    Raises ``RuntimeError``, changing nothing, when dpnp's extensions are
    already loaded, when there is no SYCL device, or when dpnp and libsycl
    are not the ones the interposer was written for (dpnp's extensions import
    a SYCL USM function it does not define, libsycl lacks one it forwards to,
    or something in the global scope already defines them)."""
    global _find_pool, _wait_device
    cdef uintptr_t device_ref, context_ref
    if not callable(pool_for):
        raise TypeError(f"pool_for must be callable (unimem.xpu._pool_for), got {type(pool_for).__name__}")
    with _lock:
        if um_si_installed():
            return
        folder = dpnp_directory()
        if folder is None:
            raise RuntimeError("dpnp is not installed: there is nothing to interpose")
        loaded = loaded_under(folder)
        if "dpnp" in sys.modules or loaded:
            seen = ", ".join(map(os.path.basename, loaded)) or "dpnp imported"
            raise RuntimeError(f"dpnp's extensions are already loaded ({seen}): the SYCL interposer must be "
                               f"installed before dpnp is imported (python -m unimem run --sycl-interpose, or "
                               f"unimem.install_allocators(sycl_interpose=True) first)")
        # dpctl's own references to SYCL are bound to libsycl before ours are
        # visible (its _memory module imports sycl::free: it needs no detour).
        import dpctl
        import dpctl.memory  # noqa: F401
        from .._runtime.devices import get_type
        from ..backends import xpu as _backend
        from . import dpnp as _dpnp_allocator
        xpu_type = get_type("xpu")              # raises, saying why, when there is no SYCL device
        runtime = _backend._SyclRuntime.get()
        libsycl = _bind_libsycl()
        check_dpnp_imports(folder, _soname(libsycl))
        already = _global_definitions()
        if already:
            raise RuntimeError(f"the global scope already defines {', '.join(sorted(already))} "
                               f"(libsycl preloaded, or another interposer): dpnp would not bind to unimem's")
        _bind_dpctl(runtime)
        if um_si_prepare(os.path.join(folder, "").encode()) != 0:
            raise RuntimeError(f"cannot set up the SYCL interposer for {folder}")
        # The dpnp allocator's routes decide which pool serves which USM kind
        # for a device's default queue (same SYCL context, host USM only when
        # the pinned pool is SYCL host memory of that context). No guard: the
        # real sycl::aligned_alloc never let the GIL go either.
        routes = _dpnp_allocator._Routes(dpctl, pool_for, lambda index: None)

        def find_pool(usm_type, index, routes=routes, queues=runtime.default_queues):
            routed = routes(usm_type, queues[index])
            return routed[0] if isinstance(routed, tuple) else None
        _find_pool = find_pool
        _wait_device = xpu_type.backend.synchronize
        for index, (device, queue) in enumerate(zip(runtime.devices, runtime.default_queues)):
            context = queue.sycl_context
            for obj in (device, queue, context):        # the C registry points into them
                _pin(obj)
            device_ref = device.addressof_ref()
            context_ref = context.addressof_ref()
            if um_si_add_device(<const void*>device_ref, <const void*>context_ref) != index:
                raise RuntimeError("too many SYCL devices for the interposer's table")
        um_si_set_installed(True)
        _promote()


def _promote():
    """Put this module in the global scope and check that every interposed
    name now resolves to it."""
    if dlopen(__file__.encode(), RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL) == NULL:
        um_si_set_installed(False)
        raise RuntimeError(f"cannot promote {__file__} to the global scope: {(<bytes>dlerror()).decode()}")
    found = _global_definitions()
    wrong = [name for i, name in enumerate(MANGLED_NAMES) if found.get(name) != <uintptr_t>um_si_defined(i)]
    if wrong:
        um_si_set_installed(False)
        raise RuntimeError(f"after promotion the global scope resolves {', '.join(wrong)} elsewhere")


def installed():
    """Whether :func:`install` has made the interposer the definition of SYCL's USM functions."""
    return bool(um_si_installed())


COUNTER_NAMES = ("pooled.calls", "pooled.bytes", "refused.calls", "refused.bytes", "frees.after_wait",
                 "frees.at_once", "frees.at_once_holding_gil", "frees.bypassed", "live.blocks")


def counters():
    """What the interposer did since the process started, all zero before
    :func:`install`:

    * ``pooled.calls``, ``pooled.bytes``: requests served from the pools;
    * ``refused.calls``, ``refused.bytes``: requests a pool refused (out of
      memory: ``nullptr`` went back, as SYCL's own functions answer);
    * ``bypassed.calls``, ``bypassed.bytes`` and by reason
      ``bypassed.<reason>.calls``, ``.bytes`` (:data:`REASONS`): requests
      forwarded to libsycl;
    * ``frees.at_once`` (a thread without the GIL: SYCL host tasks),
      ``frees.at_once_holding_gil`` (the GIL held but no Python code running:
      a host task dropping Python references), ``frees.after_wait`` (from
      Python code: after waiting for the device's queues): pool blocks given
      back, by path; ``frees.bypassed``: frees of other pointers, forwarded;
    * ``live.blocks``: pool blocks handed out and not yet freed;
    * ``calls.<function>`` (:data:`ENTRY_POINTS`): every call that reached
      each interposed function, from any caller.
    """
    out = {name: um_si_counter(i) for i, name in enumerate(COUNTER_NAMES)}
    out["bypassed.calls"] = sum(um_si_bypassed_calls(i) for i in range(len(REASONS)))
    out["bypassed.bytes"] = sum(um_si_bypassed_bytes(i) for i in range(len(REASONS)))
    for i, reason in enumerate(REASONS):
        out[f"bypassed.{reason}.calls"] = um_si_bypassed_calls(i)
        out[f"bypassed.{reason}.bytes"] = um_si_bypassed_bytes(i)
    for i, name in enumerate(ENTRY_POINTS):
        out[f"calls.{name}"] = um_si_calls(i)
    return out
