"""Snapshots and history: ``memory_snapshot``, ``_record_memory_history``,
``_snapshot`` and ``_dump_snapshot``, in PyTorch's layout."""
from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Literal, Optional, Tuple

from .._observe import history as _history
from .._runtime.devices import DeviceLike
from .arguments import check_bool, native_bool
from .device_type import DeviceTypeAPI
from .mempool import _snapshot_filter


class HistoryAPI(DeviceTypeAPI):
    """The state of a device type's caching allocators, and their history."""

    def memory_snapshot(self, mempool_id: Optional[Tuple[int, int]] = None) -> List[Dict[str, Any]]:
        r"""Return a snapshot of the memory allocator state across all devices.

        Args:
            mempool_id (tuple[int, int] or None, optional): a ``MemPool.id``:
                only that pool's segments. None (default) or ``(0, 0)``: all
                segments, each naming its pool in ``segment_pool_id``.

        A list of segments, each with its blocks (``address``, ``size``,
        ``requested_size``, ``state``: ``active_allocated``,
        ``active_pending_free`` or ``inactive``, and the ``frames`` that
        allocated it while history is recorded), in PyTorch's field names.
        Interpreting the output of this function requires familiarity with the
        memory allocator internals.
        """
        return self._memory_snapshot(mempool_id)

    def _memory_snapshot_with_traces(self, mempool_id: Optional[Tuple[int, int]] = None,
                                     include_traces: bool = True) -> List[Dict[str, Any]]:
        r"""Return a snapshot of the memory allocator state across all devices.

        Interpreting the output of this function requires familiarity with the
        memory allocator internals.

        Args:
            mempool_id: Optional memory pool ID to get snapshot for a specific pool
            include_traces: accepted for PyTorch's signature (torch.cuda's): the
                segments of a snapshot carry no trace entries (``_snapshot()``
                has them).
        """
        check_bool("include_traces", include_traces)
        return self._memory_snapshot(mempool_id)

    def _memory_snapshot(self, mempool_id: Optional[Tuple[int, int]]) -> List[Dict[str, Any]]:
        only = _snapshot_filter(mempool_id)
        try:
            registry = self._type().registry
        except RuntimeError:
            return []
        segments = _history.snapshot(self.pool, registry)["segments"]
        if only is None:
            return segments
        return [segment for segment in segments if segment["segment_pool_id"] == only]

    def _record_memory_history(self, enabled: Optional[Literal["state", "all"]] = "all", *args: Any,
                               **kwargs: Any) -> None:
        r"""Enable recording of stack traces associated with memory
        allocations (see :meth:`_record_memory_history_impl` for the
        arguments). As in ``torch.cuda``, a bool ``enabled`` selects the
        legacy form, ``_record_memory_history(True, trace_alloc_max_entries=...)``
        (:meth:`_record_memory_history_legacy`).
        """
        if isinstance(enabled, bool):
            self._record_memory_history_legacy(enabled, *args, **kwargs)
        else:
            self._record_memory_history_impl(enabled, *args, **kwargs)

    def _record_memory_history_legacy(self, enabled: bool, record_context: bool = True,
                                      trace_alloc_max_entries: int = 1, trace_alloc_record_context: bool = False,
                                      device: DeviceLike = None, record_context_cpp: bool = False,
                                      clear_history: bool = False, compile_context: bool = False,
                                      global_record_annotations: bool = False,
                                      skip_actions: Optional[List[str]] = None) -> None:
        r"""``torch.cuda.memory._record_memory_history_legacy``: the bool form,
        in the current form's terms. ``enabled`` False stops recording; True
        keeps ``trace_alloc_max_entries`` alloc/free events ("state" when that
        is 1, as PyTorch's core treats it), with tracebacks of allocations
        (``trace_alloc_record_context``), of live memory (``record_context``)
        or none. ``record_context_cpp``: there are no C++ frames to add.
        """
        check_bool("record_context", record_context)
        check_bool("trace_alloc_record_context", trace_alloc_record_context)
        check_bool("record_context_cpp", record_context_cpp)
        if not enabled:
            self._record_memory_history_impl(None, device=device, clear_history=clear_history)
            return
        if isinstance(trace_alloc_max_entries, bool) or not isinstance(trace_alloc_max_entries, int):
            raise TypeError(f"trace_alloc_max_entries must be an int, not {type(trace_alloc_max_entries).__name__}")
        context = "alloc" if trace_alloc_record_context else ("state" if record_context else None)
        self._record_memory_history_impl("all" if trace_alloc_max_entries > 1 else "state", context, "python",
                                         trace_alloc_max_entries, device, clear_history, compile_context,
                                         global_record_annotations, skip_actions)

    def _record_memory_history_impl(self, enabled: Optional[Literal["state", "all"]] = "all",
                                    context: Optional[Literal["state", "alloc", "all"]] = "all",
                                    stacks: Literal["python", "all"] = "all", max_entries: int = sys.maxsize,
                                    device: DeviceLike = None, clear_history: bool = False,
                                    compile_context: bool = False, global_record_annotations: bool = False,
                                    skip_actions: Optional[List[str]] = None) -> None:
        r"""Enable recording of stack traces associated with memory
        allocations, so you can tell what allocated any piece of memory in
        :func:`_snapshot()`.

        In addition to keeping stack traces with each current allocation and free,
        this will also enable recording of a history of all alloc/free events.
        Up to ``max_entries`` entries are kept: newer entries overwrite the oldest.

        Args:
            enabled (Literal[None, "state", "all"], optional):
                `None`, disable recording memory history (the recorded
                alloc/free history is dropped, as in PyTorch; the frames of
                blocks still live stay until they are freed).
                `"state"`, keep information for currently allocated memory
                (and, as PyTorch, only the last alloc/free entry).
                `"all"`, additionally keep a history of all alloc/free calls.
                Defaults to "all".
            context (Literal[None, "state", "alloc", "all"], optional):
                `None`, Do not record any tracebacks.
                `"state"`, Record tracebacks for currently allocated memory.
                `"alloc"`, additionally keep tracebacks for alloc calls (the
                history entry of a free carries the traceback that allocated
                the memory).
                `"all"`, additionally keep tracebacks for free calls.
                Defaults to "all".
            stacks (Literal["python", "all"], optional): Python frames are
                recorded in both cases (there are no C++ frames to add).
                Defaults to "all", as in PyTorch.
            max_entries (int, optional): Keep a maximum of `max_entries`
                alloc/free events in the recorded history recorded.
            device: ignored; recording applies to every device of this type, as in PyTorch.
            clear_history (bool, optional): Clear history when enabling, defaults to False.
            compile_context (bool, optional), global_record_annotations (bool,
                optional): accepted where ``torch.cuda`` has them, with no
                effect: there is no compiled graph or annotation to record.
            skip_actions (list[str], optional): action types not to record
                (``"alloc"``, ``"free_requested"``, ``"free_completed"``,
                ``"segment_alloc"``, ``"segment_free"``, ``"oom"``).

        The arguments are ``torch.cuda.memory._record_memory_history``'s, in
        its order; the ``xpu`` namespace takes ``torch.xpu``'s, which has no
        ``device`` (:meth:`_record_xpu_memory_history`).
        """
        check_bool("compile_context", compile_context)
        check_bool("global_record_annotations", global_record_annotations)
        clear_history = native_bool("clear_history", clear_history)   # a pybind11 bool in PyTorch
        _history.record_memory_history(self.pool, self._type().registry, enabled, context,
                                       stacks, max_entries, clear_history, skip_actions)

    def _record_xpu_memory_history(self, enabled: Optional[Literal["state", "all"]] = "all",
                                   context: Optional[Literal["state", "alloc", "all"]] = "all",
                                   stacks: Literal["python", "all"] = "all", max_entries: int = sys.maxsize,
                                   clear_history: bool = False,
                                   skip_actions: Optional[List[str]] = None) -> None:
        r"""Enable recording of stack traces associated with memory
        allocations, so you can tell what allocated any piece of memory in
        :func:`_snapshot()`; ``torch.xpu.memory._record_memory_history``'s
        arguments, in its order (no ``device``). See
        :func:`unimem.cuda._record_memory_history` for what each means.
        """
        self._record_memory_history_impl(enabled, context, stacks, max_entries,
                                         clear_history=clear_history, skip_actions=skip_actions)

    # As torch.cuda's: the current form's parameters (what the arguments mean), either form taken.
    _record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)  # type: ignore[attr-defined]

    def _snapshot(self, device: DeviceLike = None, augment_with_fx_traces: bool = False) -> Dict[str, Any]:
        r"""Save a snapshot of memory state at the time it was called: a dict
        with ``segments`` and ``device_traces`` in PyTorch's layout (see
        ``torch.cuda.memory._snapshot``), readable by ``torch.cuda._memory_viz``
        and pytorch.org/memory_viz. ``augment_with_fx_traces`` (a bool) is
        taken with no effect: no torch.compile graph, so no FX frames to add."""
        check_bool("augment_with_fx_traces", augment_with_fx_traces)
        return _history.snapshot(self.pool, self._type().registry)

    def _dump_snapshot(self, filename: "_history.PathLike" = "dump_snapshot.pickle",
                       augment_with_fx_traces: bool = False) -> None:
        r"""Save a pickled version of the :func:`_snapshot` dictionary to a file.

        This file can be opened by the interactive snapshot viewer at pytorch.org/memory_viz

        Args:
            filename (str or os.PathLike, optional): Name of the file to create.
                Defaults to "dump_snapshot.pickle". Anything but a path (a file
                descriptor, say) is a ``TypeError``.
            augment_with_fx_traces (bool, optional): no effect (see :func:`_snapshot`).
        """
        check_bool("augment_with_fx_traces", augment_with_fx_traces)
        _history.dump_snapshot(self.pool, self._type().registry, filename)
