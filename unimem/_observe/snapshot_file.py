"""Reading a memory snapshot file safely: the restricted unpickler and the
check that the file holds a snapshot.

Snapshots are pickles, and an ordinary ``pickle.load`` runs whatever code a
crafted file names. :func:`load_snapshot` reads them with an unpickler that
builds only builtin containers and scalars (all that PyTorch's and unimem's
snapshot format holds) and refuses any class or function the file names.
"""
from __future__ import annotations

import numbers
import os
import pickle
from typing import Any, Dict, Union


class SnapshotError(ValueError):
    """A file that is not a memory snapshot unimem can read (or one that
    names code to run, which is refused)."""


class _BuiltinsOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings, bytes, numbers,
    booleans and None, and nothing else.

    Every one of those has its own pickle opcode, so ``find_class`` (the only
    way a pickle reaches a class or function, and so code) is never needed by
    a snapshot: it refuses everything.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"refused to load {module}.{name}: a memory snapshot holds only "
                            "builtin containers and scalars, and this file asks for code")


def load_snapshot(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Read a snapshot written by ``_dump_snapshot`` (unimem's or
    ``torch.cuda.memory._dump_snapshot``), or a pickled ``memory_snapshot()``
    list of segments, without running any code the file names.

    Returns the snapshot as a dict with ``segments`` and ``device_traces``.
    Raises ``OSError`` when the file cannot be read and :class:`SnapshotError`
    (a ``ValueError``) when it is not a snapshot: truncated, empty, not a
    pickle, the wrong shape, or naming a class or function.
    """
    with open(path, "rb") as f:
        try:
            snapshot = _BuiltinsOnlyUnpickler(f).load()
        except SnapshotError:
            raise
        except EOFError:
            raise SnapshotError("the file is empty or truncated") from None
        except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                OverflowError, MemoryError, RecursionError) as exc:
            # What a damaged or foreign file makes the unpickler raise.
            raise SnapshotError(f"not a pickled snapshot ({type(exc).__name__}: {exc})") from None
    if isinstance(snapshot, list):                  # a memory_snapshot() list of segments
        snapshot = {"segments": snapshot, "device_traces": []}
    check_snapshot(snapshot)
    return snapshot


def _require(condition: bool, where: str, what: str) -> None:
    if not condition:
        raise SnapshotError(f"not a memory snapshot: {where} {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral)


def check_snapshot(snapshot: Any) -> None:
    """Raise :class:`SnapshotError` unless ``snapshot`` has the shape the
    plot reads: ``segments`` (each with an integer ``address`` and
    ``total_size``, a ``segment_type`` and ``blocks`` of ``size`` and
    ``state``) and, optionally, ``device_traces`` (one list of events per
    device, each with an ``action`` and the integer ``addr``/``size`` it needs)."""
    _require(isinstance(snapshot, dict), "the file holds", f"a {type(snapshot).__name__}, not a dict")
    _require("segments" in snapshot, "the dict", "has no 'segments'")
    segments = snapshot["segments"]
    _require(isinstance(segments, list), "'segments'", "is not a list")
    for i, segment in enumerate(segments):
        where = f"segment {i}"
        _require(isinstance(segment, dict), where, "is not a dict")
        for key in ("address", "total_size"):
            _require(_is_int(segment.get(key)), where, f"has no integer {key!r}")
        _require(_is_int(segment.get("device", 0)), where, "has a device that is not an integer")
        _require(isinstance(segment.get("segment_type"), str), where, "has no 'segment_type'")
        blocks = segment.get("blocks")
        _require(isinstance(blocks, list), where, "has no list of 'blocks'")
        for j, block in enumerate(blocks):
            _require(isinstance(block, dict) and _is_int(block.get("size"))
                     and isinstance(block.get("state"), str),
                     f"{where} block {j}", "has no integer 'size' and 'state'")
    traces = snapshot.get("device_traces", [])
    _require(isinstance(traces, list), "'device_traces'", "is not a list")
    settings = snapshot.get("allocator_settings", {})
    _require(isinstance(settings, dict), "'allocator_settings'", "is not a dict")
    for device, trace in enumerate(traces):
        _require(isinstance(trace, list), f"the trace of device {device}", "is not a list")
        for k, event in enumerate(trace):
            where = f"event {k} of device {device}"
            _require(isinstance(event, dict) and isinstance(event.get("action"), str), where,
                     "has no 'action'")
            action = event["action"]
            if action in ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
                          "segment_unmap", "oom"):
                _require(_is_int(event.get("size")), where, "has no integer 'size'")
            if action in ("alloc", "free_completed"):
                _require(_is_int(event.get("addr")), where, "has no integer 'addr'")
            _require(isinstance(event.get("time_us", 0), numbers.Real), where, "has a 'time_us' that is not a number")
            frames = event.get("frames", [])
            _require(isinstance(frames, list) and all(
                isinstance(f, dict) and isinstance(f.get("filename"), str) and _is_int(f.get("line"))
                and isinstance(f.get("name"), str) for f in frames[:1]),
                where, "has frames without filename, line and name")
