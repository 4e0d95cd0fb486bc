"""Allocator options: ``UNIMEM_ALLOC_CONF``, in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax.

Example::

    UNIMEM_ALLOC_CONF="max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6"

Options (PyTorch's names and rules):

- ``max_split_size_mb`` (>= 20): blocks of this size or more are never split.
- ``max_non_split_rounding_mb`` (>= 20): how much larger a cached block an
  oversize request may take (default 20).
- ``roundup_power2_divisions``: either one power of two for every size, or a
  list ``[boundary_mb:divisions, ..., >:divisions]`` per power-of-two
  interval from 1 MiB to 64 GiB.
- ``garbage_collection_threshold`` in (0, 1): with a memory fraction set,
  reclaim old cached blocks once reserved memory passes this share of it.
- ``per_process_memory_fraction`` in [0, 1] (PyTorch's CUDA option too): the share of
  each device's memory this process may reserve, as
  ``set_per_process_memory_fraction`` sets it.
- ``max_reserved_ratio`` >= 1, or 0 for off (unimem's addition, off by default): on a cache
  miss, give back wholly free cached segments while reserved memory would
  exceed this ratio times the memory in use. PyTorch's policy keeps every
  segment until memory runs short; this bounds the cache's overhead (peak
  reserved at most about ratio × peak in use), paying with device calls when
  the working set changes.
- ``expandable_segments`` (``True`` or ``False``, default False): PyTorch's
  expandable segments. One virtual address range per stream and pool is
  reserved once and grown by mapping pages at its end; ``empty_cache`` unmaps
  free pages, ``empty_virt_addr_cache`` releases ranges with none mapped.
  The device's backend must offer virtual memory (CUDA through
  ``cuda-bindings``, the ``cpu`` pool, the simulated backend); an allocator
  made on one that does not raises NotImplementedError naming it. Before
  mapping more pages, free whole pages in holes of the range are unmapped
  while the mapped total would pass ``max_reserved_ratio`` (default 1.09
  with expandable segments; ``max_reserved_ratio:0`` turns it off, for
  PyTorch's expandable segments) times the memory in use.
- ``backend:native`` is accepted (it is what unimem does);
  ``backend:cudaMallocAsync`` is refused (not supported yet).
  ``large_segment_size_mb`` is accepted at its only value here, 20.
- Every other option of PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` is accepted and
  checked as PyTorch checks it, but changes nothing here: see
  :data:`INERT_OPTIONS` for each one and why.

Numbers are ASCII only (``int()`` and ``float()`` also take digits such as
``"٣"``), and sizes must fit the allocator. A malformed value raises
:class:`ValueError` naming the option, when the string is parsed.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .._core import MAX_REQUEST_SIZE

ENV_VAR = "UNIMEM_ALLOC_CONF"
MiB = 1 << 20
ROUNDUP_INTERVALS = 16           # 1 MiB, 2 MiB, ... 32 GiB and above
#: max_reserved_ratio with expandable_segments:True when none is given: free
#: whole pages in the holes of a range are unmapped before more are mapped
#: (issue 27; chosen from python -m benchmarks memory, see docs/guide/expandable-segments.md).
EXPANDABLE_RESERVED_RATIO = 1.09
MIN_SPLIT_SIZE_MB = 20           # kLargeBuffer / 1 MiB

SIZE_T_MAX = (1 << 64) - 1       # what PyTorch parses integers into (std::stoull)
# The largest request the core accepts: a split or rounding size above it
# would mean nothing, and could overflow the core's size arithmetic.
MAX_SIZE_BYTES = MAX_REQUEST_SIZE
MAX_SIZE_MB = MAX_SIZE_BYTES // MiB
LARGE_SEGMENT_SIZE_MB = 20       # kLargeBuffer: unimem's segment for requests under 10 MiB
PINNED_MAX_REGISTER_THREADS = 128   # PyTorch's pinned_max_register_threads()

# PyTorch options that unimem accepts, checks as PyTorch does, and ignores:
# (option, why it changes nothing here).
INERT_OPTIONS: Tuple[Tuple[str, str], ...] = (
    ("release_lock_on_cudamalloc", "unimem's core decides itself when its lock is held around a "
                                   "backend call; there is no cudaMalloc-specific lock to release"),
    ("release_lock_on_hipmalloc", "the ROCm spelling of release_lock_on_cudamalloc"),
    ("pinned_use_cuda_host_register", "unimem's pinned pool allocates page-locked memory directly "
                                      "(cudaHostAlloc or SYCL host USM), never malloc + cudaHostRegister"),
    ("pinned_use_hip_host_register", "the ROCm spelling of pinned_use_cuda_host_register"),
    ("pinned_num_register_threads", "threads for cudaHostRegister, which unimem does not use"),
    ("pinned_reserve_segment_size_mb", "unimem's pinned pool keeps no pre-reserved segment"),
    ("pinned_use_background_threads", "unimem's pinned pool processes its events on the calling "
                                      "thread; it starts no background thread"),
    ("pinned_max_round_threshold_mb", "unimem's pinned pool rounds no request up to a power of two "
                                      "(it splits blocks by best fit), so there is no threshold to stop at"),
    ("pinned_max_cached_size_mb", "unimem's pinned pool caches freed blocks of every size, as its "
                                  "device pools do, until empty_host_cache"),
    ("pinned_free_catch_all", "a switch of the free path of PyTorch's CUDA pinned allocator; unimem's "
                              "pinned pool has one free path, for blocks it handed out"),
    ("throw_on_cudamalloc_oom", "unimem already refuses a request larger than the device (or its "
                                "memory fraction) at once, without asking the backend"),
    ("graph_capture_record_stream_reuse", "unimem has no CUDA graph capture"),
)
INERT_KEYS = tuple(name for name, _ in INERT_OPTIONS)

SUPPORTED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                  "garbage_collection_threshold", "per_process_memory_fraction", "max_reserved_ratio",
                  "expandable_segments", "backend", "large_segment_size_mb") + INERT_KEYS

# Strict ASCII numbers: int() and float() take any Unicode decimal digit.
_ASCII_INTEGER = re.compile(r"[0-9]+")
_ASCII_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE = frozenset(" \t\n\r\f\v")


@dataclass(frozen=True)
class AllocatorSettings:
    """The parsed options, as the core's constructor takes them."""

    max_split_size: Optional[int] = None
    max_non_split_rounding: int = 20 * MiB
    roundup_power2_divisions: List[int] = field(default_factory=lambda: [0] * ROUNDUP_INTERVALS)
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: Optional[float] = None
    max_reserved_ratio: Optional[float] = None     # None: not given; 0.0: off
    expandable_segments: bool = False
    source: str = ""
    # the INERT_OPTIONS given, with their parsed values (they change nothing)
    inert_options: Dict[str, object] = field(default_factory=dict)

    def core_kwargs(self) -> Dict[str, object]:
        return {
            "max_split_size": self.max_split_size,
            "max_non_split_rounding": self.max_non_split_rounding,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "max_reserved_ratio": (EXPANDABLE_RESERVED_RATIO if self.expandable_segments else 0.0)
                                  if self.max_reserved_ratio is None else self.max_reserved_ratio,
            "expandable_segments": self.expandable_segments,
        }


def _tokenize(text: str) -> List[str]:
    """Split like PyTorch's lexArgs: ``, : [ ]`` are tokens, spaces vanish."""
    tokens: List[str] = []
    word: List[str] = []
    for ch in text:
        if ch in ",:[]":
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(ch)
        elif ch not in _ASCII_SPACE:      # as std::isspace in the C locale
            word.append(ch)
    if word:
        tokens.append("".join(word))
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{ENV_VAR}={self.text!r}: {message}")

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise self.fail("unexpected end of options")
        self.i += 1
        return token

    def expect(self, token: str) -> None:
        got = self.take()
        if got != token:
            raise self.fail(f"expected '{token}', found '{got}'")

    def integer(self, what: str, maximum: int = SIZE_T_MAX) -> int:
        """A non-negative integer in ASCII digits, at most ``maximum``."""
        return self.integer_token(self.take(), what, maximum)

    def integer_token(self, token: str, what: str, maximum: int = SIZE_T_MAX) -> int:
        if not _ASCII_INTEGER.fullmatch(token):
            raise self.fail(f"{what} must be a non-negative integer in ASCII digits, got '{token}'")
        value = int(token)
        if value > maximum:
            raise self.fail(f"{what} is too large: {token} (at most {maximum})")
        return value

    def number(self, what: str) -> float:
        """A finite decimal number in ASCII (``0.5``, ``.5``, ``5e-1``)."""
        token = self.take()
        if token.lower() in ("nan", "+nan", "-nan"):
            raise self.fail(f"{what} must be a number, got NaN")
        if not _ASCII_DECIMAL.fullmatch(token):
            raise self.fail(f"{what} must be a decimal number, got '{token}'")
        value = float(token)
        if not math.isfinite(value):
            raise self.fail(f"{what} is out of range: {token}")
        return value

    def boolean(self, what: str) -> bool:
        """PyTorch's booleans: exactly ``True`` or ``False``."""
        token = self.take()
        if token == "True":
            return True
        if token == "False":
            return False
        raise self.fail(f"{what} must be True or False, got '{token}'")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


MAX_DIVISIONS = 1 << 63          # the largest power of two a size_t holds


def _parse_divisions(p: _Parser) -> List[int]:
    divisions = [0] * ROUNDUP_INTERVALS
    if p.peek() != "[":
        value = p.integer("roundup_power2_divisions", MAX_DIVISIONS)
        if not _is_power_of_two(value):
            raise p.fail("roundup_power2_divisions must be a power of 2")
        return [value] * ROUNDUP_INTERVALS
    p.take()
    first = True
    last_index = 0
    while p.peek() != "]":
        if p.peek() is None:
            raise p.fail("missing ']' at the end of roundup_power2_divisions")
        boundary = p.take()
        p.expect(":")
        value = p.integer("roundup_power2_divisions", MAX_DIVISIONS)
        if value != 0 and not _is_power_of_two(value):
            raise p.fail("for roundups, the divisions have to be a power of 2 or 0 (no roundup)")
        if boundary == ">":
            for j in range(last_index + 1, ROUNDUP_INTERVALS):
                divisions[j] = value
        else:
            boundary_mb = p.integer_token(boundary, "a roundup_power2_divisions interval")
            if not _is_power_of_two(boundary_mb):
                raise p.fail(f"for roundups, the intervals have to be powers of 2 (MiB), got '{boundary}'")
            index = min(boundary_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                for j in range(index):
                    divisions[j] = value
                first = False
            divisions[index] = value
            last_index = index
        if p.peek() == ",":
            p.take()
        elif p.peek() is None:
            raise p.fail("missing ']' at the end of roundup_power2_divisions")
        elif p.peek() != "]":
            raise p.fail("expected ',' or ']' in roundup_power2_divisions")
    p.expect("]")
    return divisions


def _key_value_hint(p: _Parser, key: str) -> str:
    """``max_split_size_mb=256`` is one word to the tokenizer (``=`` is no
    separator): where the part before ``=`` is an option, the hint of its
    ``key:value`` spelling, else nothing."""
    name, equals, value = key.partition("=")
    if not equals or name not in SUPPORTED_KEYS:
        return ""
    if not value and p.peek() == "[":          # roundup_power2_divisions=[...]: the list's tokens
        end = p.tokens.index("]", p.i) + 1 if "]" in p.tokens[p.i:] else len(p.tokens)
        value = "".join(p.tokens[p.i:end])
    return f": options are written key:value, did you mean '{name}:{value}'?"


def parse_alloc_conf(text: Optional[str]) -> AllocatorSettings:
    """Parse an option string; ``None`` or empty gives the defaults."""
    if not text:
        return AllocatorSettings(source=text or "")
    p = _Parser(text)
    values: Dict[str, object] = {}
    inert: Dict[str, object] = {}
    seen = set()
    while p.peek() is not None:
        key = p.take()
        if key in seen:
            raise p.fail(f"option '{key}' is given twice")
        if key not in SUPPORTED_KEYS:
            raise p.fail(f"unrecognized option '{key}'{_key_value_hint(p, key)} "
                         f"(supported: {', '.join(SUPPORTED_KEYS)})")
        seen.add(key)
        p.expect(":")
        if key == "max_split_size_mb":
            mb = p.integer(key, MAX_SIZE_MB)
            if mb < MIN_SPLIT_SIZE_MB:
                raise p.fail(f"max_split_size_mb too small, must be >= {MIN_SPLIT_SIZE_MB}")
            values[key] = mb * MiB
        elif key == "max_non_split_rounding_mb":
            mb = p.integer(key, MAX_SIZE_MB)
            if mb < MIN_SPLIT_SIZE_MB:
                raise p.fail(f"max_non_split_rounding_mb too small, must be >= {MIN_SPLIT_SIZE_MB}")
            values[key] = mb * MiB
        elif key == "roundup_power2_divisions":
            values[key] = _parse_divisions(p)
        elif key == "garbage_collection_threshold":
            value = p.number(key)
            if not 0.0 < value < 1.0:
                raise p.fail("garbage_collection_threshold is invalid, set it in (0.0, 1.0)")
            values[key] = value
        elif key == "per_process_memory_fraction":
            value = p.number(key)
            if not 0.0 <= value <= 1.0:
                raise p.fail("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            values[key] = value
        elif key == "max_reserved_ratio":
            value = p.number(key)
            if not (value >= 1.0 or value == 0.0):
                raise p.fail("max_reserved_ratio must be at least 1.0, or 0 to turn it off")
            values[key] = value
        elif key == "expandable_segments":
            values[key] = p.boolean(key)
        elif key == "backend":
            backend = p.take()
            if backend in ("cudaMallocAsync", "hipMallocAsync"):
                raise p.fail(f"backend '{backend}' is not supported yet by unimem (only 'native')")
            if backend != "native":
                raise p.fail(f"unknown allocator backend '{backend}', options are native and cudaMallocAsync")
        elif key == "large_segment_size_mb":
            mb = p.integer(key)
            if mb <= 10:        # PyTorch: larger than kMinLargeAlloc (10 MiB)
                raise p.fail("large_segment_size_mb must be > 10")
            if mb != LARGE_SEGMENT_SIZE_MB:
                raise p.fail(f"large_segment_size_mb other than {LARGE_SEGMENT_SIZE_MB} is not supported "
                             f"yet by unimem")
        elif key in ("pinned_num_register_threads",):
            threads = p.integer(key)
            if not _is_power_of_two(threads):
                raise p.fail(f"pinned_num_register_threads has to be a power of 2, got {threads}")
            if threads > PINNED_MAX_REGISTER_THREADS:
                raise p.fail(f"pinned_num_register_threads should be at most {PINNED_MAX_REGISTER_THREADS}, "
                             f"got {threads}")
            inert[key] = threads
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            inert[key] = p.integer(key)
        elif key == "pinned_reserve_segment_size_mb":
            mb = p.integer(key)
            if mb == 0:
                raise p.fail("pinned_reserve_segment_size_mb has to be greater than 0")
            inert[key] = mb
        elif key in INERT_KEYS:        # the rest are booleans
            inert[key] = p.boolean(key)
        if p.peek() is not None:
            p.expect(",")
            if p.peek() is None:
                raise p.fail("trailing ','")
    return AllocatorSettings(
        max_split_size=values.get("max_split_size_mb"),  # type: ignore[arg-type]
        max_non_split_rounding=values.get("max_non_split_rounding_mb", 20 * MiB),  # type: ignore[arg-type]
        roundup_power2_divisions=values.get("roundup_power2_divisions", [0] * ROUNDUP_INTERVALS),  # type: ignore[arg-type]
        garbage_collection_threshold=values.get("garbage_collection_threshold", 0.0),  # type: ignore[arg-type]
        per_process_memory_fraction=values.get("per_process_memory_fraction"),  # type: ignore[arg-type]
        max_reserved_ratio=values.get("max_reserved_ratio"),  # type: ignore[arg-type]
        expandable_segments=values.get("expandable_segments", False),  # type: ignore[arg-type]
        source=text,
        inert_options=inert,
    )


def settings_from_env() -> AllocatorSettings:
    """The settings ``UNIMEM_ALLOC_CONF`` asks for (read each time it is called)."""
    return parse_alloc_conf(os.environ.get(ENV_VAR))
