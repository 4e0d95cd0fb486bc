"""``python -m unimem demo``: the main job.

Trains a small multilayer perceptron on the default device of this machine
(dpnp on a SYCL device, CuPy on a GPU, NumPy on host memory otherwise) with
ordinary array code - ``h = xp.maximum(x @ w, 0)``, no ``out=`` - twice: with
the array library's own allocation and with unimem installed as its allocator
(``unimem.xpu.using_allocator()``, ``cupy.cuda.using_allocator(
unimem.cuda.allocator)``), the memory history recorded. The two trainings run
in paired rounds, interleaved: each round takes both the same steps further,
the order alternating (:mod:`unimem.cli.paired`). Then it shows what the pool did:

* the statistics table (``memory_summary``);
* the share of the array allocations and bytes of the pooled run that the
  pool served, results of operations included (dpnp: the hook's counters);
* the cache hit rate: requests served without asking the device for memory;
* the time saved, measured in the same run: the two trainings, and the same
  sequence of allocations replayed through the raw backend and the pool, each
  as the median speed-up of the rounds and its range ("no clear difference"
  where the range straddles 1);
* the page faults and operating-system time of each training (memory the
  device maps afresh is faulted in on first touch; the pool's is already mapped);
* the snapshot (``snapshot.pickle``, readable by pytorch.org/memory_viz), the
  timeline picture (``timeline.png``) and the interactive report
  (``memory.html``, self-contained: it opens offline) in the output folder.

NumPy has no allocator hook: on that fallback only the arrays the demo copies
its data into (parameters and batches) come from the cpu pool, and the output
says so; the results of NumPy's operations are NumPy's own memory.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, TextIO, Tuple

import numpy

from .. import _core
from .._runtime.devices import current_type
from .paired import Comparison, count_rounds, interleaved

Allocation = Callable[[], ContextManager[Any]]


# ---------------------------------------------------------------------------
# the array library of the default device
# ---------------------------------------------------------------------------
@dataclass
class Workload:
    """An array library on one device, and how to run code with its own
    allocation or with unimem's."""

    description: str
    xp: Any                                   # the array module
    asarray: Callable[[numpy.ndarray], Any]   # host data onto the device, as its users write it
    pooled: Allocation                        # inside: unimem allocates the library's arrays
    own: Allocation                           # inside: the library's own allocation
    pooled_how: str                           # what ``pooled`` installs, for the output
    own_how: str
    synchronize: Callable[[], None]           # wait for the device (and for freed memory to be back)
    allocator: _core.CachingAllocator
    memory_api: Any                           # unimem.xpu / unimem.cuda / unimem.cpu
    counters: Optional[Callable[[], Dict[str, int]]] = None   # the allocator hook's, where it has them


def default_workload() -> Workload:
    dtype = current_type()
    index = dtype.current_index()
    allocator = dtype.allocator(index)
    if dtype.name == "xpu":
        import dpnp

        import unimem.xpu as api
        queue = api.default_queue(index)
        return Workload(f"dpnp on XPU {index} ({queue.sycl_device.name}, SYCL {queue.sycl_device.backend.name})",
                        dpnp, functools.partial(dpnp.asarray, sycl_queue=queue),
                        api.using_allocator, functools.partial(_dpnp_own_allocation, api),
                        "unimem.xpu.using_allocator()", "dpnp's own allocation (dpctl's sycl::malloc/free)",
                        functools.partial(api.synchronize, index), allocator, api, api.allocator_counters)
    if dtype.name == "cuda":
        import cupy

        import unimem.cuda as api
        name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        # The baseline is CuPy without a pool (using_allocator(None): plain
        # cudaMalloc/cudaFree), as the raw backend of the replay below.
        return Workload(f"CuPy on GPU {index} ({name})", cupy, cupy.asarray,
                        functools.partial(cupy.cuda.using_allocator, api.allocator),
                        functools.partial(cupy.cuda.using_allocator, None),
                        "cupy.cuda.using_allocator(unimem.cuda.allocator)",
                        "CuPy's raw cudaMalloc/cudaFree (its memory pool off)",
                        cupy.cuda.get_current_stream().synchronize, allocator, api)
    import unimem.cpu as api
    host = _NumpyArrays(api.empty)
    return Workload("NumPy on host memory (the cpu pool)", numpy, host.asarray, host.pooled,
                    contextlib.nullcontext,
                    "unimem.cpu.empty for the arrays the demo copies its data into", "NumPy's own allocation",
                    lambda: None, allocator, api)


@contextlib.contextmanager
def _dpnp_own_allocation(api: Any) -> Iterator[None]:
    """dpnp's own allocation inside, even where unimem was installed before
    (a start-up hook): then it is installed again after."""
    was_installed = api.allocator_installed()
    api.reset_allocator()
    try:
        yield
    finally:
        if was_installed:
            api.set_allocator()


class _NumpyArrays:
    """NumPy has no allocator hook: inside :meth:`pooled`, the arrays the demo
    makes from host data are copied into the cpu pool (``unimem.cpu.empty``);
    the results of NumPy's operations are NumPy's own memory either way."""

    def __init__(self, pool_empty: Callable[..., numpy.ndarray]) -> None:
        self.pool_empty = pool_empty
        self.pooling = False

    def asarray(self, host: numpy.ndarray) -> numpy.ndarray:
        if not self.pooling:
            return numpy.array(host)        # a copy, as the pooled branch makes
        out = self.pool_empty(host.shape, host.dtype)
        out[...] = host
        return out

    @contextlib.contextmanager
    def pooled(self) -> Iterator[None]:
        self.pooling = True
        try:
            yield
        finally:
            self.pooling = False


# ---------------------------------------------------------------------------
# the training loop
# ---------------------------------------------------------------------------
LAYERS = (512, 1024, 256, 10)
BATCHES = (256, 256, 224, 192, 160, 128)      # batch sizes vary, as the last batch of an epoch does
LOSS_EVERY = 20
#: The timed trainings run in this many paired rounds (fewer with fewer steps).
ROUNDS = 6


class Progress:
    """A one-line progress bar on a terminal, wiped when done (elsewhere,
    nothing: the lines of the rounds tell how far the demo is)."""

    def __init__(self, total: int, label: str, out: TextIO) -> None:
        self.total, self.label, self.out = total, label, out
        self.tty = out.isatty()
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.tty:
            return
        width = 30
        filled = done * width // self.total
        bar = "#" * filled + "." * (width - filled)
        self.out.write(f"\r{self.label} [{bar}] {done:4d}/{self.total} steps  "
                       f"{time.perf_counter() - self.start:5.1f} s")
        self.out.flush()

    def clear(self) -> None:
        if self.tty:
            self.out.write("\r\x1b[K")
            self.out.flush()


def training_step(xp: Any, weights: List[Any], x: Any, t: Any, lr: float) -> Any:
    """One step of plain SGD on the mean squared error, written as any user of
    the array library writes it; updates ``weights`` in place and returns the
    output's error ``y - t``."""
    w1, w2, w3 = weights
    # forward (ReLU)
    h1 = xp.maximum(x @ w1, 0)
    h2 = xp.maximum(h1 @ w2, 0)
    error = h2 @ w3 - t
    # backward
    grad_h2 = (error @ w3.T) * (h2 > 0)
    grad_h1 = (grad_h2 @ w2.T) * (h1 > 0)
    scale = lr / x.shape[0]
    w3 -= scale * (h2.T @ error)
    w2 -= scale * (h1.T @ grad_h2)
    w1 -= scale * (x.T @ grad_h1)
    return error


class Training:
    """The MLP trained for ``steps`` steps with its arrays allocated as
    ``allocation`` (``work.pooled`` or ``work.own``) has it, taken further a
    few steps at a time (:meth:`advance`), so that two trainings can take
    turns. The same seed gives the same batches and losses either way."""

    def __init__(self, work: Workload, allocation: Allocation, steps: int, seed: int = 0) -> None:
        self.work, self.allocation, self.steps = work, allocation, steps
        self.rng = numpy.random.default_rng(seed)
        d_in, d_out = LAYERS[0], LAYERS[-1]
        self.inputs = self.rng.standard_normal((2048, d_in)).astype("f4")
        teacher = self.rng.standard_normal((d_in, d_out)).astype("f4") / numpy.sqrt(d_in)
        self.targets = numpy.tanh(self.inputs @ teacher).astype("f4")
        initial = [(self.rng.standard_normal((a, b)) * numpy.sqrt(2.0 / a)).astype("f4")
                   for a, b in zip(LAYERS, LAYERS[1:])]
        self.done = 0
        self.loss = float("nan")
        with allocation():
            self.weights = [work.asarray(w) for w in initial]
            work.synchronize()

    def advance(self, steps: int, progress: Optional[Progress] = None) -> float:
        """Train ``steps`` steps more; their seconds, the device waited for."""
        work, xp = self.work, self.work.xp
        error: Any = None
        with self.allocation():
            start = time.perf_counter()
            for done in range(1, steps + 1):
                step = self.done
                rows = self.rng.integers(0, len(self.inputs), BATCHES[step % len(BATCHES)])
                error = training_step(xp, self.weights, work.asarray(self.inputs[rows]),
                                      work.asarray(self.targets[rows]), 0.05)
                if step % LOSS_EVERY == 0 or step == self.steps - 1:
                    self.loss = float((error * error).mean())
                self.done += 1
                if progress is not None:
                    progress.update(done)
            del error
            work.synchronize()
            return time.perf_counter() - start

    def finish(self) -> None:
        """Drop the weights, inside the allocation and waited for, so that
        their memory is back where it came from before the pool's figures are read."""
        with self.allocation():
            self.weights = []
            self.work.synchronize()


def train(work: Workload, allocation: Allocation, steps: int, progress: Optional[Progress] = None,
          seed: int = 0) -> Tuple[float, float]:
    """Train the MLP for ``steps`` steps with the arrays allocated as
    ``allocation`` (``work.pooled`` or ``work.own``) has it; returns
    (seconds, last loss). The same seed gives the same loss either way."""
    training = Training(work, allocation, steps, seed)
    seconds = training.advance(steps, progress)
    training.finish()
    return seconds, training.loss


def round_steps(steps: int, rounds: int = ROUNDS) -> List[int]:
    """``steps`` cut into at most ``rounds`` nearly equal rounds (the longer first)."""
    count = min(rounds, steps)
    return [steps // count + (i < steps % count) for i in range(count)]


@dataclass
class _TimedTraining:
    """One side of the comparison: its training, its progress label, and
    what the operating system did for the process while it ran."""

    training: Training
    label: str
    out: TextIO
    faults: int = 0
    system_seconds: float = 0.0
    measured_costs: bool = True

    def advance(self, steps: int, label: str) -> float:
        progress = Progress(steps, f"{label} {self.label}", self.out)
        before = _process_costs()
        seconds = self.training.advance(steps, progress)
        costs = _process_costs(since=before)
        progress.clear()
        if costs is None:
            self.measured_costs = False
        else:
            self.faults += costs[0]
            self.system_seconds += costs[1]
        return seconds

    def costs(self) -> Optional[Tuple[int, float]]:
        return (self.faults, self.system_seconds) if self.measured_costs else None


def train_in_rounds(work: Workload, steps: int, own_label: str,
                    out: TextIO) -> Tuple[Comparison, _TimedTraining, _TimedTraining]:
    """The two trainings, own and pooled, in paired, interleaved rounds: each
    round takes both the same steps further, the order alternating; a line
    per round. Returns the comparison and the two sides."""
    sizes = round_steps(steps)
    firsts = [sum(sizes[:i]) + 1 for i in range(len(sizes))]
    own = _TimedTraining(Training(work, work.own, steps), own_label, out)
    pooled = _TimedTraining(Training(work, work.pooled, steps), "unimem", out)

    def label(i: int) -> str:
        return f"  round {i + 1}/{len(sizes)}"

    def report(i: int, own_seconds: float, pool_seconds: float) -> None:
        last = firsts[i] + sizes[i] - 1
        which = f"step {last}" if sizes[i] == 1 else f"steps {firsts[i]}-{last}"
        print(f"{label(i)}, {which}: {own_label} {own_seconds:.2f} s, "
              f"unimem {pool_seconds:.2f} s ({own_seconds / max(pool_seconds, 1e-12):.2f}x as fast)",
              file=out, flush=True)

    comparison = interleaved(lambda i: own.advance(sizes[i], label(i)),
                             lambda i: pooled.advance(sizes[i], label(i)), len(sizes), report)
    return comparison, own, pooled


def replay(trace: List[Dict[str, Any]], malloc: Callable[[int], int],
           free: Callable[[int, int], None]) -> float:
    """Replay a trace's allocations and frees (``free(ptr, size)``); seconds."""
    live: Dict[int, Tuple[int, int]] = {}
    start = time.perf_counter()
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = (malloc(entry["size"]), entry["size"])
        elif entry["action"] == "free_requested" and entry["addr"] in live:
            free(*live.pop(entry["addr"]))
    for ptr, size in live.values():
        free(ptr, size)
    return time.perf_counter() - start


def run(steps: int = 300, out_dir: str = "unimem-demo", out: Optional[TextIO] = None,
        show_oom: bool = True) -> Dict[str, Any]:
    """Run the demo; print to ``out`` (stdout by default) and return the figures."""
    from .._observe.plot import plot_snapshot
    from .._observe.report import write_report

    out = out or sys.stdout
    work = default_workload()
    dtype = current_type()
    allocator = work.allocator
    index = allocator.device
    library = work.xp.__name__
    print(f"unimem demo: a {'-'.join(map(str, LAYERS))} MLP, {steps} training steps, "
          f"{work.description}", file=out, flush=True)
    rounds = count_rounds(len(round_steps(steps)))
    print(f"the same training code twice, in {rounds}, interleaved (each takes both trainings the "
          f"same steps further, the order alternating): with {work.own_how} and with {work.pooled_how}",
          file=out, flush=True)

    # Warm up (kernel compilation and library start-up costs nobody's allocator).
    train(work, work.own, 3)
    train(work, work.pooled, 3)

    # 1. The array library's own allocation and unimem's, in paired rounds;
    # the pool's history recorded (the own rounds do not use the pool).
    allocator.empty_cache()
    allocator.reset_accumulated_stats()
    allocator.reset_peak_stats()
    work.memory_api._record_memory_history(max_entries=200_000, clear_history=True)
    counters = work.counters
    counted_before = counters() if counters else None
    training, own, pooled = train_in_rounds(work, steps, f"{library}'s own", out)
    own.training.finish()
    pooled.training.finish()
    own_seconds, pool_seconds = training.total_seconds()
    own_loss, pool_loss = own.training.loss, pooled.training.loss
    own_costs, pool_costs = own.costs(), pooled.costs()
    counted = _since(counters(), counted_before) if counters and counted_before is not None else None
    stats = allocator.memory_stats()
    if show_oom:
        _provoke_out_of_memory(allocator, out)
    snapshot = work.memory_api._snapshot()
    work.memory_api._record_memory_history(None)

    print("", file=out)
    print(work.memory_api.memory_summary(index), file=out)

    # 2. The allocations alone, replayed through the raw backend and the
    # pool, in paired rounds too.
    trace = snapshot["device_traces"][index]
    backend = dtype.backend
    replays = interleaved(lambda _: replay(trace, lambda n: backend.malloc(n, index, 0),
                                           lambda p, n: backend.free(p, n, index, 0)),
                          lambda _: replay(trace, allocator.malloc, lambda p, n: allocator.free(p)), ROUNDS)
    raw_alloc_seconds, pool_alloc_seconds = replays.median_seconds()
    handed_out = stats["allocation.all.allocated"]
    misses = stats["num_device_alloc"]
    hit_rate = 1.0 - misses / handed_out if handed_out else 0.0
    requests = sum(1 for e in trace if e["action"] == "alloc")
    print(_served_from_the_pool(work, counted, stats), file=out)
    print(f"cache hit rate: {hit_rate:.2%} ({handed_out - misses} of {handed_out} requests served "
          f"from the cache; {misses} device allocations)", file=out)
    own_allocation = f"{library}'s own allocation"
    print(f"training, {rounds}, interleaved: {training.verdict('unimem', own_allocation)}; "
          f"{pool_seconds:.2f} s with unimem (recording its memory history) vs {own_seconds:.2f} s in all "
          f"(losses {pool_loss:.4f} / {own_loss:.4f})", file=out)
    print(f"allocation alone ({requests} requests of this run, replayed in {count_rounds(ROUNDS)}, interleaved): "
          f"{replays.verdict('the pool', f'raw {dtype.pool.display_name} malloc/free')}; "
          f"a round {_duration(pool_alloc_seconds)} through the pool vs {_duration(raw_alloc_seconds)} "
          f"raw (medians)", file=out)
    # Where the training times differ beyond the allocator's own work: what
    # the operating system did for the process (a page fault is a first touch
    # of newly mapped memory), measured in the rounds above.
    if pool_costs is not None and own_costs is not None:
        print(f"where the training times differ (unimem vs {library}'s own, measured in the rounds above): "
              f"{pool_costs[0]:,} vs {own_costs[0]:,} page faults (first touches of newly mapped "
              f"memory) and {pool_costs[1]:.2f} s vs {own_costs[1]:.2f} s of operating-system time",
              file=out)
    print(f"peak reserved {_core.format_size(stats['reserved_bytes.all.peak'])} for a peak of "
          f"{_core.format_size(stats['requested_bytes.all.peak'])} requested", file=out)

    os.makedirs(out_dir, exist_ok=True)
    snapshot_path = os.path.join(out_dir, "snapshot.pickle")
    picture_path = os.path.join(out_dir, "timeline.png")
    report_path = os.path.join(out_dir, "memory.html")
    import pickle
    with open(snapshot_path, "wb") as f:
        pickle.dump(snapshot, f)
    plot_snapshot(snapshot, picture_path, device=index,
                  title=f"unimem demo: {work.description}")
    write_report(snapshot, report_path, device=index, stats=stats, title=f"unimem demo: {work.description}")
    print(f"wrote {snapshot_path} (open it at https://pytorch.org/memory_viz), {picture_path} and "
          f"{report_path} (an interactive report that opens offline)", file=out, flush=True)
    return {"device": f"{dtype.name}:{index}", "steps": steps, "hit_rate": hit_rate,
            "pool_seconds": pool_seconds, "own_seconds": own_seconds, "training_rounds": training.rounds,
            "pool_alloc_seconds": pool_alloc_seconds, "raw_alloc_seconds": raw_alloc_seconds,
            "replay_rounds": replays.rounds,
            "snapshot": snapshot_path, "picture": picture_path, "report": report_path, "loss": pool_loss, "own_loss": own_loss,
            "allocator_counters": counted,
            "pool_faults_and_system_seconds": pool_costs, "own_faults_and_system_seconds": own_costs}


def _since(now: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {key: value - before.get(key, 0) for key, value in now.items()}


def _served_from_the_pool(work: Workload, counted: Optional[Dict[str, int]], stats: Dict[str, Any]) -> str:
    """What share of the pooled training's arrays the pool served."""
    library = work.xp.__name__
    if counted is None:
        if work.xp is numpy:
            return (f"served from the pool: the {stats['allocation.all.allocated']} arrays the demo copied "
                    f"its data into (parameters and batches); NumPy has no allocator hook, so the results "
                    f"of its operations are NumPy's own memory, outside the pool and these figures")
        return (f"served from the pool: every {library} allocation inside {work.pooled_how}: "
                f"{stats['allocation.all.allocated']} allocations, "
                f"{_core.format_size(stats['requested_bytes.all.allocated'])}")
    pooled, bypassed = counted["pooled.allocations"], counted["bypassed.allocations"]
    pooled_bytes, bypassed_bytes = counted["pooled.bytes"], counted["bypassed.bytes"]
    line = (f"served from the pool: {_share(pooled, pooled + bypassed)} of {library}'s array allocations "
            f"({pooled} of {pooled + bypassed}, results of operations included) and "
            f"{_share(pooled_bytes, pooled_bytes + bypassed_bytes)} of their bytes "
            f"({_core.format_size(pooled_bytes)} of {_core.format_size(pooled_bytes + bypassed_bytes)})")
    reasons = [f"{key.split('.')[1]} {value}" for key, value in counted.items()
               if key.count(".") == 2 and key.endswith(".allocations") and value]
    if reasons:
        line += f"; passed to the library's own allocator: {', '.join(reasons)}"
    return line


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "n/a"


def _process_costs(since: Optional[Tuple[int, float]] = None) -> Optional[Tuple[int, float]]:
    """(page faults, system CPU seconds) of this process so far, or since an
    earlier reading; None where the platform does not report them."""
    try:
        import resource
    except ImportError:                              # not on Windows
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    now = (usage.ru_minflt + usage.ru_majflt, usage.ru_stime)
    if since is None:
        return now
    return now[0] - since[0], now[1] - since[1]


def _duration(seconds: float) -> str:
    """'12.8 ms', or '35 us' below a millisecond."""
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _provoke_out_of_memory(allocator: _core.CachingAllocator, out: TextIO) -> None:
    """Ask for more than the device holds, to show the report unimem gives."""
    too_much = max(allocator.capacity, 1 << 30) * 2
    try:
        allocator.malloc(too_much)
    except _core.OutOfMemoryError as error:
        print(f"\nasked for more than the device holds, to show the report:\n  {error}", file=out)
