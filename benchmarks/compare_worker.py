"""One side of ``python -m benchmarks compare``: runs in an interpreter whose
``unimem`` is one tree's (PYTHONPATH), measures the cases it is asked for and
answers on stdout, one JSON line per request.

It uses only what every tree since the first measured one offers (the facade's
functions, ``unimem.xpu.empty``, the core's typed loop wherever that tree keeps
it), so that the same cases run on a base revision and on the working tree.
A case the tree lacks answers ``{"skipped": reason}``.

Protocol: the worker prints ``{"ready": ...}`` once set up; then for each line
``{"case": NAME, "quick": BOOL}`` read from stdin it measures one sample and
prints ``{"seconds": S}`` (time per operation) or ``{"skipped": REASON}``;
EOF ends it. Samples are short so that the two sides can take turns often.

``compare_worker.py --loop CASE N`` runs one loop of N operations of a hot-path
case and exits: what ``compare --instructions`` runs under callgrind.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from typing import Any, Callable, Dict, NamedTuple, Optional

#: Bytes this interpreter allocates before anything else (set by compare.py,
#: per round, the same for both sides): where the allocator's structures land
#: in a cache line moves with it (compare.HEAP_SHIFTS says why).
HEAP_SHIFT_ENV = "UNIMEM_COMPARE_HEAP_SHIFT"
_heap_shift = bytearray(1024 + int(os.environ.get(HEAP_SHIFT_ENV) or 0))    # > 512 bytes: from malloc

SIZE = 4096               # the pair the issue measured: caching_allocator_alloc(4096) + delete
ARRAY_ITEMS = 1024        # unimem.xpu.empty(1024, dtype="f4"), as the in-flight case's allocation
MATMUL_N = 1536           # a float32 matmul of this order keeps a CPU device busy for tens of ms
IN_FLIGHT_TRIES = 3       # allocations behind queued matmuls and reductions per sample
PAIRS = 50_000            # pairs per sample of a hot-path loop (--quick: PAIRS_QUICK)
PAIRS_QUICK = 10_000
#: Operations per loop when set (``--loop``): the instruction counter's runs.
_loop_override: Optional[int] = None


def _operations(quick: bool, factor: int = 1) -> int:
    if _loop_override is not None:
        return _loop_override
    return factor * (PAIRS_QUICK if quick else PAIRS)


class Skip(Exception):
    """The tree (or this machine) has nothing to measure for the case."""


def _pair_time(alloc: Callable[[int], int], free: Callable[[int], None], pairs: int) -> float:
    """One loop of ``pairs`` alloc+free pairs: seconds per pair."""
    free(alloc(SIZE))
    start = time.perf_counter()
    for _ in range(pairs):
        free(alloc(SIZE))
    return (time.perf_counter() - start) / pairs


def _call_time(call: Callable[[], Any], calls: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


class Worker:
    def __init__(self) -> None:
        import unimem
        self.unimem = unimem
        from unimem import accelerator
        self.accelerator = accelerator
        self.device_type = self._current_type_name()
        self.namespace = importlib.import_module(f"unimem.{self.device_type}")
        self._dpnp: Optional[Any] = None
        self._matrix: Optional[Any] = None

    def _current_type_name(self) -> str:
        for module in ("unimem._runtime.devices", "unimem._devices"):
            try:
                devices = importlib.import_module(module)
            except ImportError:
                continue
            return str(devices.current_type().name)
        raise RuntimeError("cannot tell this tree's current device type")

    # -- the hot path ---------------------------------------------------------
    def accelerator_pair(self, quick: bool) -> float:
        return _pair_time(self.accelerator.caching_allocator_alloc, self.accelerator.caching_allocator_delete,
                          _operations(quick))

    def namespace_pair(self, quick: bool) -> float:
        return _pair_time(self.namespace.caching_allocator_alloc, self.namespace.caching_allocator_delete,
                          _operations(quick))

    def core_pair(self, quick: bool) -> float:
        devices = importlib.import_module(
            "unimem._runtime.devices" if _has_module("unimem._runtime.devices") else "unimem._devices")
        dtype = devices.current_type()
        allocator = dtype.allocator(dtype.current_index())
        pairs = _operations(quick, factor=4)
        try:
            from benchmarks._timing import time_hot_path  # this tree's loop, built in place
            return float(time_hot_path(allocator, SIZE, pairs)) * 1e-9
        except ImportError:
            if not hasattr(allocator, "_time_hot_path"):
                raise Skip("this tree has no typed timing loop") from None
            return float(allocator._time_hot_path(SIZE, pairs)) * 1e-9

    def _pair_behind_events(self, quick: bool, pending: int) -> float:
        """The core's Python pair on a simulated device while ``pending``
        blocks freed after use on another stream wait for its events (work
        that never completes here): what every allocation pays while a
        stream runs behind."""
        from unimem import _core
        from unimem.backends.simulated import SimulatedBackend
        allocator = _core.CachingAllocator(SimulatedBackend(), 0)
        for p in [allocator.malloc(SIZE) for _ in range(pending)]:
            allocator.record_stream(p, 7)
            allocator.free(p)
        return _pair_time(allocator.malloc, allocator.free, _operations(quick))

    def pair_behind_1_event(self, quick: bool) -> float:
        return self._pair_behind_events(quick, 1)

    def pair_behind_100_events(self, quick: bool) -> float:
        return self._pair_behind_events(quick, 100)

    def memory_allocated(self, quick: bool) -> float:
        memory_allocated = self.accelerator.memory_allocated
        return _call_time(lambda: memory_allocated(0), _operations(quick))

    def dict_get_pair(self, quick: bool) -> float:
        """Two ``dict.get`` calls in the pair's loop: the Python floor the API pair is judged against."""
        table: Dict[int, int] = {SIZE: 1}
        get = table.get
        return _pair_time(get, get, _operations(quick))

    # -- arrays, and an allocation while a kernel runs -------------------------
    def _xpu(self) -> Any:
        if self.device_type != "xpu":
            raise Skip(f"the default device is {self.device_type}, not a SYCL device")
        if self._dpnp is None:
            import dpnp
            self._dpnp = dpnp
            self._matrix = dpnp.ones((MATMUL_N, MATMUL_N), dtype="f4")
        return self._dpnp

    def xpu_empty(self, quick: bool) -> float:
        self._xpu()
        empty = self.unimem.xpu.empty
        return _call_time(lambda: empty(ARRAY_ITEMS, dtype="f4"), PAIRS_QUICK // 20 if quick else PAIRS // 20)

    def _in_flight(self, allocate: Callable[[], Any], quick: bool) -> float:
        """The mean time of an ``allocate()`` made while a matmul runs, each
        followed by an asynchronous reduction (dpctl keeps its temporaries
        alive with host tasks), IN_FLIGHT_TRIES times without waiting, as a
        program queues work ahead of the device; then the queue is drained."""
        self._xpu()
        x = self._matrix
        kept = []
        elapsed = 0.0
        for _ in range(IN_FLIGHT_TRIES):
            y = x @ x                      # a kernel in flight
            start = time.perf_counter()
            a = allocate()
            elapsed += time.perf_counter() - start
            kept.append(y.sum())
            del a, y
        kept[-1].sycl_queue.wait()
        return elapsed / IN_FLIGHT_TRIES

    def in_flight_xpu_empty(self, quick: bool) -> float:
        empty = self.unimem.xpu.empty
        return self._in_flight(lambda: empty(ARRAY_ITEMS, dtype="f4"), quick)

    def in_flight_dpnp_empty(self, quick: bool) -> float:
        dpnp = self._xpu()
        return self._in_flight(lambda: dpnp.empty(ARRAY_ITEMS, dtype="f4"), quick)

    def in_flight_dpnp_empty_pooled(self, quick: bool) -> float:
        dpnp = self._xpu()
        xpu = self.unimem.xpu
        if not hasattr(xpu, "using_allocator"):
            raise Skip("this tree has no unimem.xpu.using_allocator")
        with xpu.using_allocator():
            return self._in_flight(lambda: dpnp.empty(ARRAY_ITEMS, dtype="f4"), quick)


def _has_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


class Case(NamedTuple):
    method: str        # the Worker method measuring one sample
    statistic: str     # how a round's samples are summed up: "min" (noise only adds time) or "median"
    samples: int       # samples per side and round (quick: half as many, at least 3)
    counted: bool = False  # a loop of host code only: ``compare --instructions`` counts it


#: The cases, in the order benchmarks/compare.py lists them.
CASES = {
    "accelerator pair": Case("accelerator_pair", "min", 7, counted=True),
    "namespace pair": Case("namespace_pair", "min", 7, counted=True),
    "typed core pair": Case("core_pair", "min", 7, counted=True),
    "memory_allocated(0)": Case("memory_allocated", "min", 7, counted=True),
    "dict.get pair (floor)": Case("dict_get_pair", "min", 7, counted=True),
    "core pair, 1 event pending": Case("pair_behind_1_event", "min", 5, counted=True),
    "core pair, 100 events pending": Case("pair_behind_100_events", "min", 5, counted=True),
    "unimem.xpu.empty": Case("xpu_empty", "min", 5),
    "in flight: unimem.xpu.empty": Case("in_flight_xpu_empty", "median", 5),
    "in flight: dpnp.empty pooled": Case("in_flight_dpnp_empty_pooled", "median", 5),
    "in flight: dpnp.empty (peer)": Case("in_flight_dpnp_empty", "median", 5),
}


def _forget_editable_install() -> None:
    """Drop the import finder of an editable install (``pip install -e``) of
    another checkout: it would answer for submodules this tree lacks (an old
    tree without ``unimem._runtime`` would import the checkout's)."""
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]


#: The CPU (set by compare.py) on which host-code samples run, the same for both sides.
CPU_ENV = "UNIMEM_COMPARE_CPU"


def _pin(case: Case, shared: Optional[int], every_cpu: Any) -> None:
    """Host-code samples on the shared CPU; the others (kernels in flight on
    the SYCL CPU device) on every CPU this process may use."""
    if shared is not None:
        os.sched_setaffinity(0, {shared} if case.counted else every_cpu)


def main() -> int:
    global _loop_override
    _forget_editable_install()
    worker = Worker()
    shared = int(os.environ[CPU_ENV]) if os.environ.get(CPU_ENV) and hasattr(os, "sched_setaffinity") else None
    every_cpu = os.sched_getaffinity(0) if shared is not None else None
    if sys.argv[1:2] == ["--loop"]:                  # one loop, no protocol: compare --instructions
        case, operations = sys.argv[2], int(sys.argv[3])
        _loop_override = operations
        try:
            getattr(worker, CASES[case].method)(False)
        except Skip as exc:
            print(json.dumps({"skipped": str(exc)}), flush=True)
            return 3
        return 0
    print(json.dumps({"ready": True, "unimem": worker.unimem.__file__, "device": worker.device_type}),
          flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        case = CASES[request["case"]]
        method = getattr(worker, case.method)
        _pin(case, shared, every_cpu)
        gc.collect()
        try:
            answer: Dict[str, Any] = {"seconds": method(bool(request.get("quick")))}
        except Skip as exc:
            answer = {"skipped": str(exc)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
