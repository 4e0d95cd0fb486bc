"""Intel XPU (SYCL) memory through dpctl: USM device, shared and host allocations.

Device index N is the Nth SYCL device of the preferred type: GPUs if there
are any (of one backend, Level Zero first), otherwise the CPU device. Queues
play the role of CUDA streams: stream handle 0 is a device's default queue
(the one dpnp uses), other queues get handles when first seen. An event on a
queue is a SYCL barrier submitted to it.

The pip wheels of the Intel OpenCL CPU runtime (``intel-opencl-rt``) install
``libintelocl.so`` but register it under a path that does not exist, so the
OpenCL loader would not find the SYCL CPU device:
:func:`unimem.backends.opencl_env.ensure_opencl_cpu_runtime` points the loader
at it (``OCL_ICD_FILENAMES``) before dpctl is first imported.
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from . import _dpctl_api
from .address_ranges import as_int
from .base import Backend
from .opencl_env import OCL_ENV, ensure_opencl_cpu_runtime

USM_KINDS = ("device", "shared", "host")

#: Why an XPU backend offers no virtual memory (``expandable_segments``).
#: SYCL has it as an extension (``sycl_ext_oneapi_virtual_mem``: the
#: ``ext_oneapi_virtual_mem`` aspect, ``reserve_virtual_mem``,
#: ``physical_mem``, ``physical_mem::map``, ``unmap``), and the SYCL runtime
#: dpctl loads exports it, but only as C++: dpctl 0.22 binds none of it in
#: Python or in its C interface, and has no query for that aspect either.
VIRTUAL_MEMORY_UNAVAILABLE = (
    "dpctl 0.22 offers no route to SYCL's virtual memory extension (sycl_ext_oneapi_virtual_mem): "
    "no query of the ext_oneapi_virtual_mem aspect and no binding of reserve_virtual_mem, physical_mem "
    "or map, so unimem cannot reserve address space and map memory on any XPU device, whether or not "
    "the device has that aspect")
#: Why an XPU allocator cannot sleep.
PAGE_RELEASE_UNAVAILABLE = (
    "SYCL USM has no way to give an allocation's memory back while keeping its addresses "
    "(sycl::free gives both back), and the way that could, SYCL's virtual memory, is out of reach: "
    + VIRTUAL_MEMORY_UNAVAILABLE)
BACKEND_PREFERENCE = ("level_zero", "cuda", "hip", "opencl")


def _import_dpctl():
    # The loader reads the variable at dpctl's first device query, not at
    # import: it is not too late when dpnp (and so dpctl) is already imported.
    ensure_opencl_cpu_runtime()
    import dpctl
    return dpctl


def preferred_devices(dpctl) -> List[Any]:
    """The SYCL devices unimem numbers: GPUs of the most preferred backend,
    else CPU devices."""
    def rank(device) -> int:
        name = str(device.backend).rsplit(".", 1)[-1]
        return BACKEND_PREFERENCE.index(name) if name in BACKEND_PREFERENCE else len(BACKEND_PREFERENCE)

    for kind in ("gpu", "cpu"):
        try:
            found = dpctl.get_devices(device_type=kind)
        except Exception:   # no platform of that kind
            found = []
        if found:
            best = min(rank(d) for d in found)
            return [d for d in found if rank(d) == best]
    return []


def _default_queue(device):
    """The queue dpnp uses for ``device``, so that pool arrays and dpnp's own
    arrays share it (compute follows data needs the same queue)."""
    try:
        from dpctl._sycl_queue_manager import get_device_cached_queue
        return get_device_cached_queue(device)
    except ImportError:
        import dpctl
        return dpctl.SyclQueue(device)


# dpctl.SyclEvent(capsule) reads a DPCTLSyclEventRef from a capsule of this name
_EVENT_CAPSULE_NAME = b"SyclEventRef"
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


class _SyclRuntime:
    """What every XPU backend of this process shares: the devices, their
    default queues, dpctl's C functions and the queue <-> handle table."""

    _instance: Optional["_SyclRuntime"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        dpctl = _import_dpctl()
        self.dpctl = dpctl
        self.devices = preferred_devices(dpctl)
        self.default_queues = [_default_queue(d) for d in self.devices]
        self.c_library = ctypes.CDLL(os.path.join(os.path.dirname(dpctl.__file__), "libDPCTLSyclInterface.so"))
        self.functions = self.c_functions(("DPCTLaligned_alloc_device", "DPCTLaligned_alloc_shared",
                                           "DPCTLaligned_alloc_host", "DPCTLfree_with_queue", "DPCTLQueue_Wait"))
        # every queue wait of unimem's takes its turn (see _dpctl_api.wait_queue)
        _dpctl_api.set_queue_wait(self.functions["DPCTLQueue_Wait"])
        # Barriers (the events of record_stream) are submitted through ctypes,
        # which lets the GIL go during the call. dpctl's SyclQueue.submit_barrier
        # keeps it, and a submission waits for the SYCL scheduler, which a
        # thread waiting for the GIL may hold (another thread submitting
        # dpnp's next kernel while a keep-alive host task lets go of an
        # array): four threads of dpnp code with record_stream hung within
        # seconds (/tmp/adv_thr/thr2.py).
        barrier = self.c_functions(("DPCTLQueue_SubmitBarrier", "DPCTLEvent_Delete"))
        self._submit_barrier = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            barrier["DPCTLQueue_SubmitBarrier"])
        self._delete_event = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(barrier["DPCTLEvent_Delete"])
        # queue -> stream handle; a device's default queue is handle 0
        self.handles: Dict[Any, int] = {q: 0 for q in self.default_queues}
        self.queues: List[Any] = [None]          # handle -> queue (handle 0: per device; None: free)
        self.raw_allocators: List[Any] = []
        # A queue is let go of (and its handle reused) once every allocator
        # told this runtime it keeps nothing for its stream (release_stream:
        # no segment, and no live block that record_stream named it on), no
        # raw allocation is left on it, and no caller holds it.
        self.named_streams: List[Set[int]] = []         # per backend: handles record_stream named
        self.free_handles: Dict[int, List[int]] = {}    # device index -> handles to reuse
        self.handle_devices: Dict[int, int] = {}        # handle -> its queue's device index
        self.released: Set[int] = set()                 # handles the core no longer uses
        # device index -> a handle of its default queue other than 0 (own_handle),
        # kept for the process as the default queue is
        self.default_queue_own_handles: Dict[int, int] = {}
        # A released queue someone else still held (dpctl's
        # SequentialOrderManager, until its clear()) would stay here until
        # the next queue unimem sees; dpctl's queues take no weak reference,
        # so from the first such queue on, look again after each garbage
        # collection (gc.callbacks: about 1.5 us a collection, paid only then)
        self.sweeping_after_collections = False

    def submit_barrier(self, queue: Any) -> Any:
        """``queue.submit_barrier()``, submitted without the GIL: a
        ``dpctl.SyclEvent`` that completes once the work submitted to
        ``queue`` so far has."""
        ref = self._submit_barrier(queue.addressof_ref())
        if not ref:
            raise RuntimeError(f"dpctl could not submit a barrier to {queue!r}")
        try:      # dpctl's SyclEvent takes a copy of the reference in the capsule
            return self.dpctl.SyclEvent(_new_capsule(ref, _EVENT_CAPSULE_NAME, None))
        finally:
            self._delete_event(ref)

    def c_functions(self, names: Tuple[str, ...]) -> Dict[str, int]:
        """The addresses of functions of dpctl's C interface (libDPCTLSyclInterface)."""
        return {name: ctypes.cast(getattr(self.c_library, name), ctypes.c_void_p).value for name in names}

    @classmethod
    def get(cls) -> "_SyclRuntime":
        if cls._instance is None:
            with cls._lock:
                if cls._instance is None:
                    cls._instance = _SyclRuntime()
        return cls._instance

    def raw_allocator(self, kind: str):
        from ._dpctl_api import USMRawAllocator
        raw = USMRawAllocator(kind, self.functions[f"DPCTLaligned_alloc_{kind}"],
                              self.functions["DPCTLfree_with_queue"], list(self.default_queues))
        with self._lock:
            for handle, queue in enumerate(self.queues):
                if queue is not None:
                    self._add_queue(raw, queue, handle)
            self.raw_allocators.append(raw)
        return raw

    @staticmethod
    def _add_queue(raw, queue, handle: int) -> None:
        raw.add_queue(queue, handle)

    def device_index_of(self, queue) -> int:
        device = queue.sycl_device
        for index, known in enumerate(self.devices):
            if known == device:
                return index
        raise ValueError(f"the queue's device {device.name!r} ({device.filter_string}) is not one of "
                         f"unimem's XPU devices")

    def stream_handle(self, queue) -> int:
        """The handle of ``queue``: 0 for its device's default queue. A
        handle (an int) is taken as is if it names a queue unimem holds."""
        if isinstance(queue, int) and not isinstance(queue, bool):
            self.check_handle(queue)
            return queue
        if not isinstance(queue, self.dpctl.SyclQueue):
            raise TypeError(f"expected a dpctl.SyclQueue, got {type(queue).__name__}")
        handle = self.handles.get(queue)
        if handle is not None:
            return handle
        device = self.device_index_of(queue)          # a queue of an unknown device is refused
        with self._lock:
            handle = self.handles.get(queue)
            if handle is None:
                handle = self._new_handle(queue, device)
                self.handles[queue] = handle
                # A candidate for letting go of until the core uses it (memory
                # on it, or record_stream naming it): a handle asked for and
                # never used (a refused record_stream) must not keep its queue.
                self.released.add(handle)
                self._sweep_after_collections()
        return handle

    def own_handle(self, queue) -> int:
        """A handle of ``queue`` that is never 0: its :meth:`stream_handle`,
        and for a device's default queue a second handle of its own, made at
        its first use and kept as long as the default queue is. For a pool
        whose stream 0 names no queue: the pinned host pool caches host USM
        of every queue under stream 0, so a use on the default queue named
        by 0 would look like the block's own stream, ordered already."""
        handle = self.stream_handle(queue)
        if handle != 0:
            return handle
        if isinstance(queue, int):
            raise ValueError("stream handle 0 names the default queue of every device: name the queue")
        device = self.device_index_of(queue)
        handle = self.default_queue_own_handles.get(device)
        if handle is None:
            with self._lock:
                handle = self.default_queue_own_handles.get(device)
                if handle is None:
                    # never released (release() and abandoned() skip it), never swept
                    handle = self.default_queue_own_handles[device] = self._new_handle(queue, device)
        return handle

    def _new_handle(self, queue, device: int) -> int:
        """A handle for ``queue`` of ``device``, known to every raw allocator
        (the lock is held)."""
        self._drop_released_queues()
        reusable = self.free_handles.get(device)
        handle = reusable.pop() if reusable else len(self.queues)
        if handle == len(self.queues):
            if handle >= _dpctl_api.MAX_QUEUE_HANDLES:
                raise RuntimeError(f"more than {_dpctl_api.MAX_QUEUE_HANDLES - 1} SYCL queues hold "
                                   f"unimem memory at once")
            self.queues.append(None)
        for raw in self.raw_allocators:
            self._add_queue(raw, queue, handle)
        self.queues[handle] = queue
        self.handle_devices[handle] = device
        return handle

    def _is_default_queue_own_handle(self, handle: int) -> bool:
        return handle in self.default_queue_own_handles.values()

    def release(self, handle: int, sweep: bool = True) -> None:
        """The core keeps nothing for stream ``handle`` any more: let go of
        its queue once no allocation is left on it and nothing but this table
        refers to it (so no caller is about to allocate on it). Without
        ``sweep`` it is only noted (the core's call must not wait): :meth:`sweep`."""
        if handle <= 0 or self._is_default_queue_own_handle(handle):
            return
        self.released.add(handle)
        if sweep:
            self._sweep_unless_locked()

    def sweep(self) -> None:
        """Let go of the released queues nothing uses any more."""
        if self.released:
            self._sweep_unless_locked()

    def _sweep_after_collection(self, phase: str, info: Dict[str, int]) -> None:
        """``gc.callbacks``: drop the released queues nothing else holds any
        more (the last other holder may have gone since their release)."""
        if phase == "stop" and self.released:
            self._sweep_unless_locked()

    def _sweep_unless_locked(self) -> None:
        # never wait here: the core may release from a thread that holds the
        # lock already (a finalizer), a collection may run anywhere, and
        # whoever holds the lock sweeps later
        if self._lock.acquire(blocking=False):
            try:
                self._drop_released_queues()
            finally:
                self._lock.release()

    def _drop_released_queues(self) -> None:
        """Drop the released queues that nothing uses (the lock is held).
        Those the caller still holds stay candidates for the next sweep."""
        for handle in list(self.released):
            queue = self.queues[handle] if handle < len(self.queues) else None
            if queue is None:
                self.released.discard(handle)
                continue
            if any(handle in names for names in self.named_streams):
                # named again (record_stream): the core tells us when it lets go once more
                self.released.discard(handle)
                continue
            if any(raw.allocations_on(handle) for raw in self.raw_allocators):
                # memory still on it: a segment the core let go of and is giving
                # back now (or one of a pool made again): a candidate still,
                # for a later sweep (the collector's callback below)
                continue
            if not self._only_this_table_holds(queue):
                continue
            del queue
            self._drop_queue(handle)
        self._sweep_after_collections()

    def _sweep_after_collections(self) -> None:
        """While queues wait to be let go of, sweep after each collection
        (the last other holder of one may go at any time)."""
        if self.released and not self.sweeping_after_collections:
            self.sweeping_after_collections = True
            gc.callbacks.append(self._sweep_after_collection)

    def _only_this_table_holds(self, queue) -> bool:
        """Whether the only references to ``queue`` are this table's and the
        raw allocators' (and the caller's local name and this argument), or
        dpctl's order manager's: it keeps every queue dpnp ever used until
        its ``clear()``, keyed by the queue, and nobody gets a queue back
        from it to allocate on."""
        if sys.implementation.name != "cpython":
            return False        # no reliable reference count: keep the queue
        # self.queues, self.handles, one per raw allocator, the caller's
        # local, this argument and getrefcount's own
        references = sys.getrefcount(queue) - (5 + len(self.raw_allocators))
        return references <= 0 or (references == 1 and self._order_manager_holds(queue))

    def _order_manager_holds(self, queue) -> bool:
        """Whether dpctl's ``SequentialOrderManager`` (of this thread's
        context) has an entry for ``queue``."""
        managers = getattr(getattr(self.dpctl, "utils", None), "SequentialOrderManager", None)
        queue_map = getattr(managers, "_map", None)
        try:
            return queue in queue_map.get()
        except Exception:       # another dpctl's layout: count its reference as a holder
            return False

    def abandoned(self, handles: List[int], device: int) -> List[int]:
        """Of ``handles`` (queues of ``device`` the core keeps cached memory
        for), those whose queue nothing but unimem holds and whose work is
        done: nobody can allocate on it again. Queues record_stream named are
        kept (the core waits on their events). Never waits: a queue still at
        work, or the table locked by another call, is asked about again at
        the core's next new stream."""
        unheld = []
        if not self._lock.acquire(blocking=False):
            return []
        try:
            for handle in handles:
                queue = self.queues[handle] if 0 < handle < len(self.queues) else None
                if (queue is None or self.handle_devices.get(handle) != device
                        or self._is_default_queue_own_handle(handle)
                        or any(handle in names for names in self.named_streams)):
                    continue
                if self._only_this_table_holds(queue):
                    unheld.append(handle)
                del queue
            # Still under the lock (so no handle is dropped or given to another
            # queue meanwhile): a barrier's event completes once the work
            # queued before it has; nobody can queue more on a queue only
            # unimem holds, so its frees need not wait (mark_idle).
            complete = self.dpctl.event_status_type.complete
            abandoned = [handle for handle in unheld
                         if self.queues[handle].submit_barrier().execution_status == complete]
            for handle in abandoned:
                for raw in self.raw_allocators:
                    raw.mark_idle(handle)
        finally:
            self._lock.release()
        return abandoned

    def _drop_queue(self, handle: int) -> None:
        queue = self.queues[handle]
        for raw in self.raw_allocators:
            raw.remove_queue(handle)
        self.queues[handle] = None
        del self.handles[queue]
        self.released.discard(handle)
        self.free_handles.setdefault(self.handle_devices.pop(handle), []).append(handle)

    def check_handle(self, handle: int, device: Optional[int] = None) -> None:
        """Raise ValueError unless ``handle`` names a queue unimem holds (0:
        a device's default queue), of ``device`` when one is given."""
        if handle == 0:
            return
        queue = self.queues[handle] if 0 < handle < len(self.queues) else None
        if queue is None:
            raise ValueError(f"stream handle {handle} names no SYCL queue unimem holds")
        if device is not None and self.handle_devices.get(handle) != device:
            raise ValueError(f"stream handle {handle} names a queue of another device than {device}")

    def queue(self, handle: int, device: int):
        if handle == 0:
            return self.default_queues[device]
        queue = self.queues[handle] if 0 < handle < len(self.queues) else None
        if queue is None:
            raise ValueError(f"stream handle {handle} names no SYCL queue unimem holds")
        return queue


def reset_after_fork_in_child() -> None:
    """Called by unimem's fork handler in a forked child: the thread that
    held the runtime's lock in the parent does not exist in the child.
    The child drops no queue either (no sweep after a garbage collection):
    SYCL runtimes are not fork-safe."""
    _SyclRuntime._lock = threading.Lock()
    if _SyclRuntime._instance is not None:
        _SyclRuntime._instance.released.clear()


class XPUBackend(Backend):
    """SYCL USM memory of one kind on unimem's XPU devices.

    Args:
        kind: ``"device"`` (the default), ``"shared"`` or ``"host"``.
    """

    name = "XPU"
    api_name = "XPU"
    survives_fork = False      # SYCL runtimes are not fork-safe

    def __init__(self, kind: str = "device") -> None:
        if kind not in USM_KINDS:
            raise ValueError(f"USM kind must be one of {USM_KINDS}, got {kind!r}")
        self.kind = kind
        if kind != "device":           # out-of-memory messages name the memory: "XPU host USM out of memory"
            self.api_name = f"XPU {kind} USM"
        self.runtime = _SyclRuntime.get()
        self.raw = self.runtime.raw_allocator(kind)
        self._named_streams: Set[int] = set()      # handles record_stream named, until released
        self.runtime.named_streams.append(self._named_streams)
        self._raw_api = self.raw._raw_api
        self._raw_owner = self.raw           # the core keeps the C context alive
        if kind == "host":
            self.name = "host"
            self.pinning = "sycl"     # what unimem.host.backend_name() reports

    # raw memory (the core calls the C functions behind _raw_api; these are
    # the same operations for Python callers and for error reporting)
    def malloc(self, size: int, device: int, stream: int) -> int:
        return self.raw.malloc(size, device, stream)

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.raw.free(ptr, size, device, stream)

    def device_count(self) -> int:
        return len(self.runtime.devices)

    @property
    def host_accessible(self) -> bool:
        """Host and shared USM are; device USM is on CPU devices."""
        return self.kind != "device" or all(d.has_aspect_cpu for d in self.runtime.devices)

    def sycl_device(self, device: int):
        return self.runtime.devices[device]

    def default_queue(self, device: int):
        return self.runtime.default_queues[device]

    def memory_info(self, device: int) -> Tuple[int, int]:
        """(free, total): the device's global memory, and the free memory the
        driver reports (:meth:`reported_free_memory`); where it reports none
        (SYCL has no portable free-memory query), the global memory less what
        this backend holds on it, on a CPU device also bounded by the host's
        available memory."""
        dev = self.runtime.devices[device]
        total = int(dev.global_mem_size)
        free = self.reported_free_memory(device)
        if free is None:
            free = max(total - self.raw.held(device), 0)
            if dev.has_aspect_cpu:
                from ._host import _meminfo
                free = min(free, _meminfo()[0])
        return int(free), total

    def reported_free_memory(self, device: int) -> Optional[int]:
        """The free global memory the driver reports for ``device``, every
        process included: ``dpctl.utils.intel_device_info``'s
        ``"free_memory"`` (SYCL's ``ext_intel_free_memory``: Level Zero
        devices, where ``ZES_ENABLE_SYSMAN=1`` may be needed); None where
        the device reports none (OpenCL devices, the SYCL CPU device)."""
        from dpctl.utils import intel_device_info
        free = intel_device_info(self.runtime.devices[device]).get("free_memory")
        return None if free is None else int(free)

    def max_allocation_size(self, device: int) -> int:
        """SYCL's ``max_mem_alloc_size``: OpenCL CPU devices refuse more than
        half their memory in one allocation."""
        return int(self.runtime.devices[device].max_mem_alloc_size)

    # queues as streams
    def check_stream(self, stream: int, device: int) -> None:
        """``record_stream``: the handle must name a queue of ``device`` (of
        any device for host USM: the pinned pool, device 0, serves every
        queue of the context); the queue is kept at least until the core
        releases the stream."""
        self.runtime.check_handle(stream, None if self.kind == "host" else device)
        self._named_streams.add(stream)

    def release_stream(self, stream: int, device: int) -> None:
        """The core keeps nothing for ``stream`` any more on ``device``: its
        queue may be let go of (see :meth:`_SyclRuntime.release`), at
        :meth:`sweep_released_streams`."""
        self._named_streams.discard(stream)
        self.runtime.release(stream, sweep=False)

    def abandoned_streams(self, streams: List[int], device: int) -> List[int]:
        """Of ``streams``, those whose queue was dropped by everyone but
        unimem and has finished its work: their cached memory may go back
        (see :meth:`_SyclRuntime.abandoned`)."""
        return self.runtime.abandoned(streams, device)

    def sweep_released_streams(self) -> None:
        """Let go of the queues of released streams that nothing uses any more."""
        self.runtime.sweep()

    def synchronize(self, device: int) -> None:
        """Wait on the default queue of ``device`` and on every other queue of
        it that unimem holds (``torch.xpu.synchronize``)."""
        runtime = self.runtime
        queues = [runtime.default_queues[device]] + [
            q for handle, q in enumerate(list(runtime.queues))
            if q is not None and runtime.handle_devices.get(handle) == device
            and not runtime._is_default_queue_own_handle(handle)]
        for queue in queues:
            _dpctl_api.wait_queue(queue)    # not queue.wait(): two at once crash the OpenCL CPU runtime

    def record_event(self, stream: int, device: int):
        return self.runtime.submit_barrier(self.runtime.queue(stream, device))

    def event_done(self, event) -> bool:
        return event.execution_status == self.runtime.dpctl.event_status_type.complete

    def event_synchronize(self, event) -> None:
        event.wait()

    # virtual memory: none (see VIRTUAL_MEMORY_UNAVAILABLE); the other four
    # members keep the Backend defaults, which the core never calls then
    def virtual_memory_unavailable_reason(self, device: int) -> str:
        """Why ``device`` cannot map virtual memory: dpctl offers no route to it."""
        self._check_device(device)
        return VIRTUAL_MEMORY_UNAVAILABLE

    def virtual_memory_granularity(self, device: int) -> int:
        """Never a granularity: ``NotImplementedError`` saying why, which the
        core puts in its refusal of ``expandable_segments:True`` (so the
        option is refused on an XPU device, never silently ignored)."""
        raise NotImplementedError(self.virtual_memory_unavailable_reason(device))

    def page_release_unavailable_reason(self, device: int) -> str:
        """Why ``device`` cannot sleep: the refusal of ``sleep()`` quotes it."""
        self._check_device(device)
        return PAGE_RELEASE_UNAVAILABLE

    def _check_device(self, device: int) -> None:
        if not 0 <= as_int(device, "device") < len(self.runtime.devices):
            raise ValueError(f"XPU device {device} does not exist ({len(self.runtime.devices)} visible)")

    def pinned_host_backend(self) -> "XPUBackend":
        """Host USM on device 0's context: the pinned memory of ``unimem.host``."""
        return XPUBackend("host")

    def __repr__(self) -> str:
        return f"<unimem XPUBackend {self.kind} USM on {len(self.runtime.devices)} device(s)>"
