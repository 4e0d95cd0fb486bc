"""Reading memory snapshot files safely: files that may come from anyone.

Snapshots are pickles, and an ordinary ``pickle.load`` runs whatever code a
crafted file names. :func:`load_snapshot` reads them with an unpickler that
builds only builtin containers and scalars (all that PyTorch's and unimem's
snapshot format holds) and refuses any class or function the file names;
then it checks the whole structure once (:func:`check_snapshot`), so that
what reads a snapshot afterwards (the plot) meets only the keys, types and
ranges of the format, never a ``KeyError`` or an ``OverflowError``.

The source lines of the frames a snapshot names are read only on request
(:func:`read_source_line`): only regular files, never more than
:data:`MAX_SOURCE_BYTES` of one, and never blocking on a FIFO.
"""
from __future__ import annotations

import functools
import gc
import io
import itertools
import math
import operator
import os
import pickle
import stat
import tokenize
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import fastjsonschema

# How deep containers may nest: PyTorch's format nests 6 deep (the snapshot,
# segments, a segment, its blocks, a block, its frames, a frame); deeper
# nesting only makes what walks the snapshot recursively (repr, ==, json) fail.
MAX_DEPTH = 32
# Items (a list's elements, a dict's values) the structure may hold per byte
# of file, counting a list or dict each time it is referred to. A pickle
# refers to an object again with a 2-byte memo lookup, so a few KiB of a
# list of the same list of the same list... expand to billions of items for
# whatever walks them (a "billion laughs"). Measured: 0.13 per byte for
# 100,000 trace entries of 10 frames each, shared with nothing (PyTorch's
# way); 0.36 for unimem's, which share each entry's frames with the free and
# the block (60,000 entries of 62 frames, context="all").
MAX_ITEMS_PER_BYTE = 4
MIN_ITEMS = 1 << 20
# The most of a source file that read_source_line reads.
MAX_SOURCE_BYTES = 1 << 20

_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
_SIZE = {"type": "integer", "minimum": 0, "maximum": _U64_MAX}           # sizes, addresses
_SIGNED = {"type": "integer", "minimum": _I64_MIN, "maximum": _U64_MAX}  # a stream handle
_STRING = {"type": "string"}
_CLIENT = {"type": ["string", "null"]}        # unimem's: who a block is for (None: a free block's)
FRAME_SCHEMA: Dict[str, Any] = {
    "type": "object", "required": ["filename", "line", "name"],
    "properties": {"filename": _STRING, "name": _STRING,
                   # None: Python has no line number for some frames.
                   "line": {"type": ["integer", "null"], "minimum": _I64_MIN, "maximum": _U64_MAX}}}
# Trace actions whose entries the plot reads the size of, and the address of.
_SIZED_ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                  "segment_unmap", "oom"]
_ADDRESSED_ACTIONS = ["alloc", "free_completed"]


def _snapshot_schema(frames: Dict[str, Any]) -> Dict[str, Any]:
    """PyTorch's snapshot format (torch.cuda.memory._snapshot), the keys that
    readers use (other keys are allowed and left unchecked), with ``frames``
    the schema of every list of frames."""
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "required": ["segments"],
        "properties": {
            "segments": {"type": "array", "items": {
                "type": "object",
                "required": ["address", "total_size", "segment_type", "blocks"],
                "properties": {
                    "device": _SIZE, "address": _SIZE, "total_size": _SIZE, "allocated_size": _SIZE,
                    "active_size": _SIZE, "requested_size": _SIZE, "stream": _SIGNED,
                    "segment_type": _STRING, "frames": frames,
                    # a MemPool's id, (0, n) (PyTorch's CUDA graph pools: (n, 0))
                    "segment_pool_id": {"type": "array", "minItems": 2, "maxItems": 2, "items": _SIZE},
                    "blocks": {"type": "array", "items": {
                        "type": "object",
                        "required": ["size", "state"],
                        "properties": {"address": _SIZE, "size": _SIZE, "requested_size": _SIZE,
                                       "state": _STRING, "frames": frames, "client": _CLIENT}}}}}},
            "device_traces": {"type": "array", "items": {"type": "array", "items": {
                "type": "object",
                "required": ["action"],
                "properties": {"action": _STRING, "addr": _SIZE, "size": _SIZE, "stream": _SIGNED,
                               "time_us": {"type": "number", "minimum": _I64_MIN, "maximum": _U64_MAX},
                               "frames": frames, "client": _CLIENT},
                "allOf": [
                    {"if": {"properties": {"action": {"enum": _SIZED_ACTIONS}}}, "then": {"required": ["size"]}},
                    {"if": {"properties": {"action": {"enum": _ADDRESSED_ACTIONS}}}, "then": {"required": ["addr"]}},
                ]}}},
            "allocator_settings": {"type": "object", "properties": {"pool": _STRING}},
        },
    }


SNAPSHOT_SCHEMA = _snapshot_schema({"type": "array", "items": FRAME_SCHEMA})


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

    Returns the snapshot as a dict with ``segments`` and ``device_traces``,
    checked by :func:`check_snapshot`. Raises ``OSError`` when the file
    cannot be read and :class:`SnapshotError` (a ``ValueError``, its message
    one line) when it is not a snapshot: truncated, empty, not a pickle,
    naming a class or function, or not of the snapshot format.
    """
    with open(path, "rb", buffering=0) as raw:
        counted = _CountingReader(raw)              # a pipe (<(zcat ...)) has no size to ask
        try:
            snapshot = _BuiltinsOnlyUnpickler(io.BufferedReader(counted, 1 << 16)).load()
        except SnapshotError:
            raise
        except EOFError:
            raise SnapshotError("the file is empty or truncated") from None
        except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                OverflowError, MemoryError, RecursionError) as exc:
            # What a damaged or foreign file makes the unpickler raise.
            message = " ".join(str(exc).split())[:200]
            raise SnapshotError(f"not a pickled snapshot ({type(exc).__name__}: {message})") from None
    if isinstance(snapshot, list):                  # a memory_snapshot() list of segments
        snapshot = {"segments": snapshot, "device_traces": []}
    check_snapshot(snapshot, max_items=max(MIN_ITEMS, MAX_ITEMS_PER_BYTE * counted.bytes_read))
    return snapshot


class _CountingReader(io.RawIOBase):
    """A file that counts the bytes read from it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> Optional[int]:
        count = self.raw.readinto(buffer)
        self.bytes_read += count or 0
        return count


def check_snapshot(snapshot: Any, max_items: Optional[int] = None) -> None:
    """Raise :class:`SnapshotError` unless ``snapshot`` is of PyTorch's
    snapshot format (:data:`SNAPSHOT_SCHEMA`): ``segments`` of
    ``address``, ``total_size``, ``segment_type`` and ``blocks`` (each a
    ``size`` and a ``state``), optional ``device_traces`` (one list of
    entries per device, each an ``action`` with the ``addr`` and ``size`` it
    needs) and ``frames`` of ``filename``, ``line`` and ``name`` everywhere;
    sizes and addresses integers from 0 to 2**64 - 1. Optional keys of the
    format are checked when present; other keys are allowed.

    Before the schema: containers nest at most :data:`MAX_DEPTH` deep, no
    number is NaN or infinite and, given ``max_items`` (``load_snapshot``
    gives :data:`MAX_ITEMS_PER_BYTE` per byte of the file), the containers
    hold at most that many items, counted each time one is referred to."""
    _check_extent(snapshot, max_items)
    try:
        _validators()[0](snapshot)
    except fastjsonschema.JsonSchemaValueException as exc:
        raise SnapshotError(f"not a memory snapshot: {_describe(exc)}") from None
    _check_frames(snapshot)


@functools.lru_cache(maxsize=1)
def _validators() -> Tuple[Any, Any]:
    """The snapshot's schema with its frames only typed as lists, and the
    schema of one list of frames, compiled.

    fastjsonschema compiles a schema to plain Python once: it checks a
    snapshot in about the time unpickling it takes. jsonschema (the
    reference validator) took 20 times as long (82 s for a 42 MB snapshot
    of 100,000 trace entries that unpickles in 4 s)."""
    return (fastjsonschema.compile(_snapshot_schema({"type": "array"})),
            fastjsonschema.compile({"type": "array", "items": FRAME_SCHEMA}))


def _check_frames(snapshot: Dict[str, Any]) -> None:
    """Every list of frames against :data:`FRAME_SCHEMA`: all at once, at
    the speed of C, when they fit it (frames are the bulk of a snapshot:
    millions of them); each list by the schema, for the message, when not."""
    segments, traces = snapshot["segments"], snapshot.get("device_traces", [])
    every_list = ([segment.get("frames", ()) for segment in segments]
                  + [block.get("frames", ()) for segment in segments for block in segment["blocks"]]
                  + [event.get("frames", ()) for trace in traces for event in trace])
    shared_once = {id(frames): frames for frames in every_list}.values()
    if _frames_fit(list(itertools.chain.from_iterable(shared_once))):
        return
    located = [(segment.get("frames", ()), ("segments", i, "frames")) for i, segment in enumerate(segments)]
    located += [(block.get("frames", ()), ("segments", i, "blocks", j, "frames"))
                for i, segment in enumerate(segments) for j, block in enumerate(segment["blocks"])]
    located += [(event.get("frames", ()), ("device_traces", device, k, "frames"))
                for device, trace in enumerate(traces) for k, event in enumerate(trace)]
    for frames, where in located:
        try:
            _validators()[1](frames)
        except fastjsonschema.JsonSchemaValueException as exc:
            raise SnapshotError(f"not a memory snapshot: {_describe(exc, where)}") from None


def _frames_fit(frames: List[Any]) -> bool:
    """Whether every one of ``frames`` fits :data:`FRAME_SCHEMA`, checked
    with C loops (``map``); stricter than the schema (an integral float is
    no line here), never more lenient, so a False is only a reason to ask
    the schema."""
    if not frames:
        return True
    if set(map(type, frames)) != {dict}:
        return False
    try:
        filenames, lines, names = (list(map(operator.itemgetter(key), frames))
                                   for key in ("filename", "line", "name"))
    except KeyError:
        return False
    if set(map(type, filenames)) != {str} or set(map(type, names)) != {str}:
        return False
    line_types = set(map(type, lines))
    if not line_types <= {int, type(None)}:
        return False
    numbered = [line for line in lines if line is not None] if type(None) in line_types else lines
    return not numbered or (min(numbered) >= _I64_MIN and max(numbered) <= _U64_MAX)


_CONTAINERS = frozenset((dict, list, tuple, set, frozenset))
_WALK_CHUNK = 1 << 16


def _check_extent(snapshot: Any, max_items: Optional[int]) -> None:
    """Walk ``snapshot`` level by level (no recursion), each container once
    per reference, and refuse deep nesting, shared references that expand
    beyond ``max_items`` items, and numbers that are not finite.

    ``gc.get_referents`` lists what containers hold (a dict's values, a
    list's items) and ``map``/``compress`` sort them, all in C: the walk
    takes about half the time unpickling took."""
    level = [snapshot] if type(snapshot) in _CONTAINERS else []
    items = 0
    for depth in range(MAX_DEPTH + 1):
        if not level:
            return
        if depth == MAX_DEPTH:
            raise SnapshotError(f"not a memory snapshot: it nests containers more than {MAX_DEPTH} deep")
        below: List[Any] = []
        for start in range(0, len(level), _WALK_CHUNK):
            children = gc.get_referents(*level[start:start + _WALK_CHUNK])
            items += len(children)
            if max_items is not None and items > max_items:
                raise SnapshotError(f"not a memory snapshot: its shared references expand it to more than "
                                    f"{max_items:,} items")
            kinds = list(map(type, children))
            below += itertools.compress(children, map(_CONTAINERS.__contains__, kinds))
            if float in kinds and not all(map(math.isfinite, itertools.compress(
                    children, map(operator.is_, kinds, itertools.repeat(float))))):
                raise SnapshotError("not a memory snapshot: it holds a number that is not finite")
        level = below


_TYPE_NAMES = {"object": "a dict", "array": "a list", "integer": "an integer", "number": "a number",
               "string": "a string", "null": "None"}
# How a list's item is named: "segment 3", "block 0", "frame 2".
_ITEM_NAMES = {"segments": "segment", "blocks": "block", "frames": "frame"}


def _where(path: Sequence[Any]) -> str:
    """``['data', 'device_traces', 0, 5, 'frames', 1, 'line']`` as
    ``device 0 event 5 frame 1 'line'``."""
    words: List[str] = []
    # path[0] is the validator's name for the root; list indices come as digit strings.
    keys = [int(key) if isinstance(key, str) and key.isdigit() else key for key in path[1:]]
    while keys:
        key = keys.pop(0)
        if key == "device_traces" and keys and isinstance(keys[0], int):
            words.append(f"device {keys.pop(0)}")
            if keys and isinstance(keys[0], int):
                words.append(f"event {keys.pop(0)}")
        elif key in _ITEM_NAMES and keys and isinstance(keys[0], int):
            words.append(f"{_ITEM_NAMES[key]} {keys.pop(0)}")
        else:
            words.append(f"item {key}" if isinstance(key, int) else repr(key))
    return " ".join(words) or "the file"


def _a(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _bound(value: int) -> str:
    return {_U64_MAX: "2**64 - 1", _I64_MIN: "-2**63"}.get(value, str(value))


def _describe(exc: fastjsonschema.JsonSchemaValueException, within: Tuple[Any, ...] = ()) -> str:
    """One line for what the schema refused, naming where (never the value
    itself, which may be a 400-digit number or a long string); ``within``:
    the path of the part that was checked on its own."""
    where, rule, definition = _where(exc.path[:1] + list(within) + exc.path[1:]), exc.rule, exc.rule_definition
    if rule == "type":
        expected = [definition] if isinstance(definition, str) else definition
        return f"{where} is {_a(exc.value)}, not {' or '.join(_TYPE_NAMES.get(t, t) for t in expected)}"
    if rule == "required":
        missing = [key for key in definition if key not in exc.value]
        return f"{where} has no {missing[0]!r}" if missing else f"{where} lacks a key"
    if rule == "minimum":
        return f"{where} is below {_bound(definition)}"
    if rule == "maximum":
        return f"{where} is above {_bound(definition)}"
    return f"{where} breaks the rule {rule!r} of the snapshot format"


def read_source_line(filename: str, line: Any) -> str:
    """The text of line ``line`` (counted from 1) of the file ``filename``,
    stripped, or ``""`` when there is none to show.

    The file may be named by a snapshot from anyone, so it is read only if it
    is a regular file (not a device such as ``/dev/zero``, a FIFO, a socket
    or a folder), opened without blocking (a FIFO swapped in after the check
    cannot block either) and read no further than its first
    :data:`MAX_SOURCE_BYTES` (lines past them are not shown)."""
    if not isinstance(filename, str) or type(line) is not int or line < 1:
        return ""
    lines = _source_lines(filename)
    return lines[line - 1].strip() if line <= len(lines) else ""


@functools.lru_cache(maxsize=16)
def _source_lines(filename: str) -> Tuple[str, ...]:
    try:
        if not stat.S_ISREG(os.stat(filename).st_mode):
            return ()
        fd = os.open(filename, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except (OSError, ValueError):                 # missing, unreadable, or a NUL in the name
        return ()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ()
        content = _read_at_most(fd, MAX_SOURCE_BYTES + 1)
    except OSError:
        return ()
    finally:
        os.close(fd)
    if len(content) > MAX_SOURCE_BYTES:             # cut: keep only the whole lines in the cap
        content = content[:content.rfind(b"\n", 0, MAX_SOURCE_BYTES) + 1]
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(content).readline)
    except SyntaxError:                           # a bad coding cookie
        encoding = "utf-8"
    try:
        text = content.decode(encoding, errors="replace")
    except LookupError:                           # a cookie naming no codec Python has
        text = content.decode("utf-8", errors="replace")
    # Python's own line ends (not str.splitlines's form feeds and others).
    return tuple(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: List[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
