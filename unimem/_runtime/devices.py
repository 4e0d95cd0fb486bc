"""Device types: which backend serves ``cpu``, ``xpu`` and ``cuda``, which one is
the current accelerator, and how a ``device`` argument names a device.

Each device type owns a :class:`unimem._runtime.registry.DeviceRegistry` (one caching
allocator per device index, created on first use with the options of
``UNIMEM_ALLOC_CONF``). Backends are probed lazily: importing unimem neither
imports CuPy or dpctl nor touches a GPU.

The current accelerator is, in order: ``UNIMEM_DEVICE`` if set (``cuda``,
``xpu`` or ``cpu``), else CUDA if CuPy sees a GPU, else XPU if dpctl sees a
SYCL device, else ``cpu`` (plain host memory).
"""
from __future__ import annotations

import functools
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .. import _core
from .registry import DeviceRegistry, set_current_registry_resolver, set_device_index_resolver
from .config import AllocatorSettings, settings_from_env
from .pools import DEVICE_TYPES, Pool, PoolKind, register_named_pool
from ..backends import opencl_env
from ..backends.base import Backend

KNOWN_TYPES = DEVICE_TYPES
DEVICE_ENV_VAR = "UNIMEM_DEVICE"


class DeviceArgumentError(ValueError, RuntimeError):
    """A malformed device string, or a negative device index in one: the
    RuntimeError ``torch.device`` raises, and a ValueError as unimem's other
    bad arguments."""


class DeviceUnavailableError(RuntimeError):
    """A device type cannot be used on this machine: the message says why,
    the error of the runtime that said so is its ``__cause__``."""


def is_negative_index(device_arg: Any) -> bool:
    """``device_arg`` is a negative int index (for which PyTorch's set_device
    and set_device_index do nothing)."""
    return isinstance(device_arg, int) and not isinstance(device_arg, bool) and device_arg < 0


class device:
    """A device: a type (``"cpu"``, ``"xpu"``, ``"cuda"``) and an optional index,
    like ``torch.device``. ``device("xpu:1")`` and ``device("xpu", 1)`` are the same."""

    __slots__ = ("type", "index")

    def __init__(self, type: Union[str, "device"], index: Optional[int] = None) -> None:
        if isinstance(type, device):
            if index is not None:
                raise ValueError("device(device, index) takes no index")
            type, index = type.type, type.index
        elif isinstance(type, str):
            if ":" in type:
                if index is not None:
                    raise DeviceArgumentError(f"type (string) must not include an index because index was "
                                              f"passed explicitly: {type}")
                type, _, index_text = type.partition(":")
                # ASCII digits only: str.isdigit() and int() also take "٠" or "²"
                if not (index_text.isascii() and index_text.isdigit()):
                    raise DeviceArgumentError(f"Invalid device string: '{type}:{index_text}'")
                index = int(index_text)
        else:
            raise TypeError(f"device type must be a str, not {type.__class__.__name__}")
        if type not in KNOWN_TYPES:
            raise DeviceArgumentError(f"Expected one of {', '.join(KNOWN_TYPES)} device type at start of "
                                      f"device string: {type}")
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"device index must be an int, not {index.__class__.__name__}")
            if index < 0:
                raise DeviceArgumentError(f"Device index must not be negative, got {index}")
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("device is immutable")

    def __reduce__(self) -> Tuple[type, Tuple[str, Optional[int]]]:
        # pickle and copy rebuild it through __init__ (torch.device pickles; a
        # Dask task may return one); their default sets the slots one by one.
        return (device, (self.type, self.index))

    def __repr__(self) -> str:
        return f"device(type='{self.type}')" if self.index is None else \
            f"device(type='{self.type}', index={self.index})"

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))


DeviceLike = Union[None, int, str, device]

# How each device type is called in messages and summaries.
DISPLAY_NAMES = {"cuda": "GPU", "xpu": "XPU", "cpu": "CPU"}


class DeviceType:
    """One kind of device: its backend and the registry of its allocators."""

    #: Its backend came from change_current_allocator, not from unimem.
    user_backend = False

    def __init__(self, name: str, backend: Backend, *, device_count: Optional[int] = None,
                 current_device_fn: Optional[Callable[[], int]] = None,
                 set_device_fn: Optional[Callable[[int], None]] = None,
                 current_stream_fn: Optional[Callable[[], int]] = None,
                 stream_handle_fn: Optional[Callable[[Any], int]] = None) -> None:
        self.name = name
        self.pool = DEVICE_POOLS[name]
        self.backend = backend
        self.set_device_fn = set_device_fn
        count = backend.device_count() if device_count is None else device_count
        # The factory holds the backend, not this object: no reference cycle
        # through the backend, so allocators die (and give memory back) by
        # reference counting, with their backend still whole.
        self.registry = DeviceRegistry(
            name, count, functools.partial(new_allocator, self.pool, backend),
            current_device_fn=current_device_fn, current_stream_fn=current_stream_fn,
            stream_handle_fn=stream_handle_fn)

    @property
    def device_count(self) -> int:
        return self.registry.device_count

    def allocator(self, index: int) -> "_core.CachingAllocator":
        return self.registry.get(index)

    def current_index(self) -> int:
        return self.registry.current_index()

    def set_current_index(self, index: int) -> None:
        self.registry.set_current_index(index)
        if self.set_device_fn is not None:
            self.set_device_fn(index)

    def __repr__(self) -> str:
        return f"<unimem device type {self.name}: {self.device_count} device(s), backend {self.backend!r}>"


def new_allocator(pool: Pool, backend: Backend, index: int, *, device_options: bool = True,
                  **core_options: Any) -> "_core.CachingAllocator":
    """A caching allocator for device ``index`` of ``backend``, with the options
    of ``UNIMEM_ALLOC_CONF`` (unless ``device_options`` is False: the pinned
    host pool, which takes none, as PyTorch's CachingHostAllocator), told its
    device's capacity, and announced to the callbacks of
    :func:`on_allocator_created` (the observability layer).
    ``pool`` is what it serves. ``core_options`` go to
    :class:`unimem._core.CachingAllocator` over the configured ones
    (``exact_segments=True`` for CuPy's policy)."""
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a unimem Pool, not {type(pool).__name__}")
    if backend in _broken_by_fork:
        raise RuntimeError(pool.fork_message())
    settings = settings_from_env()           # read (and checked) whichever pool comes first
    if not device_options:
        settings = AllocatorSettings()
    allocator = _core.CachingAllocator(backend, index, **{**settings.core_kwargs(), **core_options})
    try:
        _, total = _core.backend_memory_info(backend, index)    # optional, as every capability
    except NotImplementedError:
        total = 0
    if total:
        allocator.set_capacity(total)
    max_allocation = getattr(backend, "max_allocation_size", None)    # optional for user backends
    if max_allocation is not None:
        allocator.set_max_allocation_size(max_allocation(index))
    if settings.per_process_memory_fraction is not None:
        allocator.set_memory_fraction(settings.per_process_memory_fraction)
    _pools_by_allocator[allocator] = pool
    for callback in list(_allocator_created_callbacks):
        callback(pool, allocator)
    return allocator


# Which pool each allocator serves, and the hooks the observability layer
# uses to attach itself to every new allocator.
_pools_by_allocator: "weakref.WeakKeyDictionary[_core.CachingAllocator, Pool]" = weakref.WeakKeyDictionary()
_allocator_created_callbacks: List[Callable[[Pool, "_core.CachingAllocator"], None]] = []


def on_allocator_created(callback: Callable[[Pool, "_core.CachingAllocator"], None]) -> None:
    """Call ``callback(pool, allocator)`` for every allocator created from now on."""
    _allocator_created_callbacks.append(callback)


DEBUG_ENV_VAR = "UNIMEM_DEBUG"


def debug_mode_requested() -> bool:
    """``UNIMEM_DEBUG=1``: fill freed memory and check it on reuse (where the
    host can read the memory), reporting writes after free. The observability
    layer turns it on for each new allocator: it records the Python frames."""
    return os.environ.get(DEBUG_ENV_VAR, "").lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------
# fork(): GPU runtimes do not survive it
# ---------------------------------------------------------------------------
_broken_by_fork: "weakref.WeakSet[Backend]" = weakref.WeakSet()


def reset_after_fork_in_child() -> None:
    """In a forked child (called by :mod:`unimem._runtime.fork`), every
    allocator whose device does not survive the fork refuses to work, saying
    why; host memory carries on. The table's lock starts unlocked: the thread
    that held it in the parent does not exist in the child and would never
    release it."""
    global _lock
    _lock = threading.RLock()
    for allocator, pool in list(_pools_by_allocator.items()):
        if not getattr(allocator.backend, "survives_fork", True):
            _broken_by_fork.add(allocator.backend)
            allocator._poison(pool.fork_message())


def pool_of(allocator: "_core.CachingAllocator") -> Optional[Pool]:
    """The pool an allocator made by :func:`new_allocator` serves."""
    return _pools_by_allocator.get(allocator)


# ---------------------------------------------------------------------------
# The table of device types
# ---------------------------------------------------------------------------
_lock = threading.RLock()
# Changed only through install_type, which retires the registry of the type
# it replaces (see there).
_types: Dict[str, DeviceType] = {}
_unavailable: Dict[str, str] = {}      # type -> why it cannot be used
_unavailable_causes: Dict[str, Optional[BaseException]] = {}     # type -> the error that said so
_current: Optional[str] = None


def _device_pool(name: str) -> Pool:
    def registry() -> "DeviceRegistry":
        return get_type(name).registry

    def existing_registry() -> "Optional[DeviceRegistry]":
        found = _types.get(name)
        return None if found is None else found.registry
    return register_named_pool(Pool(PoolKind.DEVICE, name, name, DISPLAY_NAMES[name], registry, existing_registry))


#: The pools of the device types, by name.
DEVICE_POOLS: Dict[str, Pool] = {name: _device_pool(name) for name in KNOWN_TYPES}


def make_cuda_type(runtime: Optional[Any] = None,
                   current_stream_fn: Optional[Callable[[int], Any]] = None) -> Union[DeviceType, str]:
    """The ``cuda`` device type, or a string saying why there is none;
    :class:`DeviceUnavailableError` (the runtime's error as its cause) when the
    CUDA runtime refuses to work here (no driver, for one).

    ``runtime`` is CuPy's runtime module by default; ``current_stream_fn(device)``
    gives the stream (a CuPy stream or a ``cudaStream_t``) requests use when
    they name none (CuPy's current stream by default). Pools key blocks by
    :func:`unimem.backends.cuda.stream_key`."""
    from ..backends import cuda as backend_module
    given_runtime = runtime
    if runtime is None:
        try:
            import cupy  # noqa: F401
            runtime = backend_module._default_runtime()
        except ImportError as exc:
            return (f"CuPy is not installed ({exc}); install unimem with its CUDA extra "
                    f"from the checkout: pip install -e \".[cuda]\"")
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:
        raise DeviceUnavailableError(backend_module.unusable_reason(exc, runtime)) from exc
    if count == 0:
        return "CUDA sees no GPU"
    stream_key = backend_module.stream_key
    if current_stream_fn is None:
        current_stream_key = backend_module.cupy_current_stream_key
    else:
        raw_current_stream = current_stream_fn

        def current_stream_key(device: int) -> int:
            return stream_key(raw_current_stream(device))

    # CuPy's own runtime is passed on as None: the backend then maps virtual
    # memory with the real driver (cuda-bindings); a runtime given here brings its own.
    return DeviceType("cuda", backend_module.CUDABackend(given_runtime), current_device_fn=runtime.getDevice,
                      set_device_fn=runtime.setDevice, current_stream_fn=current_stream_key,
                      stream_handle_fn=stream_key)


def make_xpu_type() -> Union[DeviceType, str]:
    """The ``xpu`` device type, or a string saying why there is none."""
    from ..backends import xpu as backend_module
    try:
        backend_module._import_dpctl()
    except ImportError as exc:
        return f'dpctl is not installed ({exc}); from unimem\'s checkout: pip install -e ".[xpu]"'
    runtime = backend_module._SyclRuntime.get()
    if not runtime.devices:
        late = opencl_env.late_import_reason()
        if late is not None:
            # Said out loud (once: a device type is probed once per process),
            # or the cpu fallback would hide an environment that has the runtime.
            warnings.warn(f"unimem: {late}", RuntimeWarning)
            return late
        hint = "" if os.environ.get(backend_module.OCL_ENV) else \
            " (no OpenCL CPU runtime found either: pip install intel-opencl-rt)"
        return f"dpctl finds no SYCL device{hint}"
    return DeviceType("xpu", backend_module.XPUBackend("device"), stream_handle_fn=runtime.stream_handle)


def _probe(name: str) -> Optional[DeviceType]:
    """Build the device type ``name`` from its backend, or None (and the reason
    in ``_unavailable``) when this machine has no such device."""
    if name == "cpu":
        from ..backends._host import PageAlignedBackend
        return DeviceType("cpu", PageAlignedBackend("CPU"))
    try:
        made = make_xpu_type() if name == "xpu" else make_cuda_type()
    except DeviceUnavailableError as exc:
        _unavailable[name] = str(exc)
        _keep_cause(name, exc.__cause__)
        return None
    except Exception as exc:  # a broken driver stack must not break import unimem
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        _keep_cause(name, exc)
        return None
    if isinstance(made, str):
        _unavailable[name] = made
        return None
    return made


def _keep_cause(name: str, cause: Optional[BaseException]) -> None:
    """Keep ``cause`` for the errors that say device type ``name`` cannot be
    used, without its traceback: its frames reach up the stack of the first
    probe, and would keep every object on it alive for good."""
    _unavailable_causes[name] = None if cause is None else cause.with_traceback(None)


def install_type(name: str, made: Optional[DeviceType]) -> None:
    """Make ``made`` device type ``name`` (None: none): the one way the table
    of types changes. The type it replaces has its registry marked
    ``retired``: the namespaces' fast functions keep the registry they found
    until then (unimem/_runtime/registry_hot.pxi), and the callbacks of
    :func:`on_type_replaced` are told."""
    old = _types.get(name)
    if old is not None and old is not made:
        old.registry.retired = True
        for callback in list(_type_replaced_callbacks):
            callback(name)
    if made is None:
        _types.pop(name, None)
        return
    made.registry.retired = False
    # Interned: those functions look their type up by this key, and an
    # identical key is found without comparing the strings (the name may
    # come from UNIMEM_DEVICE, made apart from theirs).
    _types[sys.intern(name)] = made


_type_replaced_callbacks: List[Callable[[str], None]] = []


def on_type_replaced(callback: Callable[[str], None]) -> None:
    """Call ``callback(name)`` whenever the device type ``name`` that was set
    up is replaced (or removed): what keeps its allocators outside the
    table (unimem's C ABI) forgets them then."""
    _type_replaced_callbacks.append(callback)


def get_type(name: str) -> DeviceType:
    """The device type ``name``; raises RuntimeError saying why when this
    machine has none."""
    if name not in KNOWN_TYPES:
        raise ValueError(f"unknown device type '{name}' (known: {', '.join(KNOWN_TYPES)})")
    found = _types.get(name)
    if found is not None:
        return found
    with _lock:
        if name not in _types and name not in _unavailable:
            made = _probe(name)
            if made is not None:
                install_type(name, made)
        if name in _types:
            return _types[name]
        raise RuntimeError(f"unimem: no {name} device is available: {_unavailable[name]}") \
            from _unavailable_causes.get(name)


def types_by_name() -> Dict[str, DeviceType]:
    """The table of device types set up so far, by name: the live dict, for
    hot paths that look a type up without probing (read it, never write it)."""
    return _types


def probed_types() -> List[DeviceType]:
    """The device types this process has set up so far (probing none)."""
    with _lock:
        return [_types[name] for name in KNOWN_TYPES if name in _types]


def is_available(name: str) -> bool:
    try:
        get_type(name)
    except RuntimeError:
        return False
    return True


def unavailable_reason(name: str) -> Optional[str]:
    return None if is_available(name) else _unavailable.get(name)


def current_type() -> DeviceType:
    """The current accelerator's device type (decided once per process)."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                wanted = os.environ.get(DEVICE_ENV_VAR)
                if wanted:
                    if wanted not in KNOWN_TYPES:
                        raise ValueError(f"{DEVICE_ENV_VAR}={wanted!r}: expected one of {', '.join(KNOWN_TYPES)}")
                    get_type(wanted)          # raises, saying why, if absent
                    _current = sys.intern(wanted)    # the table's key itself (see get_type)
                else:
                    _current = next(t for t in KNOWN_TYPES if is_available(t))
    return _types[_current]


def current_type_name() -> str:
    return current_type().name


set_current_registry_resolver(lambda: current_type().registry)
# unimem.accelerator.caching_allocator_alloc(n, "xpu:0"): read as every other
# accelerator function reads a device (device_index is defined below).
set_device_index_resolver(lambda device_arg: device_index(device_arg, current_type()))


def replace_backend(name: str, backend: Backend) -> DeviceType:
    """Serve device type ``name`` from ``backend`` from now on (before any
    allocation on it, as PyTorch's change_current_allocator requires)."""
    with _lock:
        old = _types.get(name)
        if old is not None and old.registry.is_initialized():
            raise RuntimeError("Can't swap an already initialized allocator")
        count = getattr(backend, "explicit_device_count", None)
        if count is None:
            count = old.device_count if old is not None else backend.device_count()
        if old is not None:
            made = DeviceType(name, backend, device_count=count,
                              current_device_fn=old.registry.current_device_fn,
                              set_device_fn=old.set_device_fn,
                              current_stream_fn=old.registry.current_stream_fn,
                              stream_handle_fn=old.registry.stream_handle_fn)
        else:
            made = DeviceType(name, backend, device_count=count)
        made.user_backend = True
        install_type(name, made)
        _unavailable.pop(name, None)
        set_current_registry_resolver(lambda: current_type().registry)
        return made


# ---------------------------------------------------------------------------
# device arguments, as torch.accelerator reads them
# ---------------------------------------------------------------------------
def device_index(device_arg: DeviceLike, dtype: DeviceType, *, optional: bool = True) -> int:
    """The device index ``device_arg`` names on device type ``dtype``.

    ``None`` is the current device; an int is taken as is (and must be in
    range); a string or :class:`device` must be of ``dtype``'s type, as
    ``torch.accelerator`` requires of the current accelerator.
    """
    if device_arg is None:
        if not optional:
            raise ValueError("Expected a device with a specified index or an integer, but got: None")
        return dtype.current_index()
    if isinstance(device_arg, bool):
        raise TypeError("a bool is not a device index")
    if isinstance(device_arg, int):
        index = device_arg
    else:
        if isinstance(device_arg, str):
            device_arg = device(device_arg)
        elif not isinstance(device_arg, device):
            kind = getattr(device_arg, "type", None)
            if isinstance(kind, str):            # torch.device and friends
                device_arg = device(kind, getattr(device_arg, "index", None))
            elif hasattr(device_arg, "__index__"):
                # operator.index refuses an __index__ that returns a non-int
                # (int() would truncate a float)
                device_arg = operator.index(device_arg)
            else:
                raise TypeError(f"Expected a device index, a device string or a device, "
                                f"got {type(device_arg).__name__}")
        if isinstance(device_arg, int):
            index = device_arg
        else:
            if device_arg.type != dtype.name:
                raise ValueError(f"{device_arg.type} doesn't match the current accelerator {dtype.name}.")
            if device_arg.index is None:
                if not optional:
                    raise ValueError(f"Expected a device with a specified index or an integer, "
                                     f"but got:{device_arg}")
                return dtype.current_index()
            index = device_arg.index
    if not 0 <= index < dtype.device_count:
        raise _core.InvalidDeviceError(f"device index {index} is out of range: {dtype.name} has "
                                       f"{dtype.device_count} device{'s' if dtype.device_count != 1 else ''}")
    return index
