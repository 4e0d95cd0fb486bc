"""``python -m unimem demo``: the main job.

Trains a small multilayer perceptron on the default device of this machine
(dpnp on a SYCL device, CuPy on a GPU, NumPy on host memory otherwise) with
ordinary array code - ``h = xp.maximum(x @ w, 0)``, no ``out=`` - twice: with
the array library's own allocation, then with unimem installed as its
allocator (``unimem.xpu.using_allocator()``, ``cupy.cuda.using_allocator(
unimem.cuda.allocator)``), the memory history recorded. Then it shows what
the pool did:

* the statistics table (``memory_summary``);
* the share of the array allocations and bytes of the pooled run that the
  pool served, results of operations included (dpnp: the hook's counters);
* the cache hit rate: requests served without asking the device for memory;
* the time saved, measured in the same run: the two trainings, and the same
  sequence of allocations replayed through the raw backend and the pool;
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


class Progress:
    """A one-line progress bar (every tenth when not on a terminal)."""

    def __init__(self, total: int, label: str, out: TextIO) -> None:
        self.total, self.label, self.out = total, label, out
        self.tty = out.isatty()
        self.start = time.perf_counter()
        self.last_tenth = -1

    def update(self, done: int, loss: Optional[float]) -> None:
        tenth = done * 10 // self.total
        if not self.tty and tenth == self.last_tenth and done != self.total:
            return
        self.last_tenth = tenth
        width = 30
        filled = done * width // self.total
        bar = "#" * filled + "." * (width - filled)
        text = (f"{self.label:>12} [{bar}] {done:4d}/{self.total} steps"
                f"{'' if loss is None else f'  loss {loss:.4f}'}  {time.perf_counter() - self.start:5.1f} s")
        if self.tty:
            self.out.write("\r" + text + ("\n" if done == self.total else ""))
        else:
            self.out.write(text + "\n")
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


def train(work: Workload, allocation: Allocation, steps: int, progress: Optional[Progress] = None,
          seed: int = 0) -> Tuple[float, float]:
    """Train the MLP for ``steps`` steps with the arrays allocated as
    ``allocation`` (``work.pooled`` or ``work.own``) has it; returns
    (seconds, last loss). The same seed gives the same loss either way."""
    rng = numpy.random.default_rng(seed)
    d_in, d_out = LAYERS[0], LAYERS[-1]
    inputs = rng.standard_normal((2048, d_in)).astype("f4")
    teacher = rng.standard_normal((d_in, d_out)).astype("f4") / numpy.sqrt(d_in)
    targets = numpy.tanh(inputs @ teacher).astype("f4")
    initial = [(rng.standard_normal((a, b)) * numpy.sqrt(2.0 / a)).astype("f4") for a, b in zip(LAYERS, LAYERS[1:])]
    xp = work.xp
    loss = float("nan")
    error: Any = None
    with allocation():
        weights = [work.asarray(w) for w in initial]
        work.synchronize()
        start = time.perf_counter()
        for step in range(steps):
            rows = rng.integers(0, len(inputs), BATCHES[step % len(BATCHES)])
            error = training_step(xp, weights, work.asarray(inputs[rows]), work.asarray(targets[rows]), 0.05)
            reported = step % LOSS_EVERY == 0 or step == steps - 1
            if reported:
                loss = float((error * error).mean())
            if progress is not None:
                progress.update(step + 1, loss if reported else None)
        # Dropped and waited for inside the block, so that their memory is
        # back where it came from before the caller reads the pool's figures.
        del weights, error
        work.synchronize()
        seconds = time.perf_counter() - start
    return seconds, loss


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
    print(f"the same training code twice: with {work.own_how}, then with {work.pooled_how}",
          file=out, flush=True)

    # Warm up (kernel compilation and library start-up costs nobody's allocator).
    train(work, work.own, 3)
    train(work, work.pooled, 3)

    # 1. The array library's own allocation.
    before = _process_costs()
    own_seconds, own_loss = train(work, work.own, steps, Progress(steps, f"{library}'s own", out))
    own_costs = _process_costs(since=before)
    # 2. The same training with unimem as the allocator, history recorded.
    allocator.empty_cache()
    allocator.reset_accumulated_stats()
    allocator.reset_peak_stats()
    work.memory_api._record_memory_history(max_entries=200_000, clear_history=True)
    counters = work.counters
    counted_before = counters() if counters else None
    before = _process_costs()
    pool_seconds, pool_loss = train(work, work.pooled, steps, Progress(steps, "unimem", out))
    pool_costs = _process_costs(since=before)
    counted = _since(counters(), counted_before) if counters and counted_before is not None else None
    stats = allocator.memory_stats()
    if show_oom:
        _provoke_out_of_memory(allocator, out)
    snapshot = work.memory_api._snapshot()
    work.memory_api._record_memory_history(None)

    print("", file=out)
    print(work.memory_api.memory_summary(index), file=out)

    # 3. The allocations alone, replayed through the raw backend and the pool.
    trace = snapshot["device_traces"][index]
    backend = dtype.backend
    raw_alloc_seconds = replay(trace, lambda n: backend.malloc(n, index, 0),
                               lambda p, n: backend.free(p, n, index, 0))
    pool_alloc_seconds = replay(trace, allocator.malloc, lambda p, n: allocator.free(p))
    handed_out = stats["allocation.all.allocated"]
    misses = stats["num_device_alloc"]
    hit_rate = 1.0 - misses / handed_out if handed_out else 0.0
    requests = sum(1 for e in trace if e["action"] == "alloc")
    print(_served_from_the_pool(work, counted, stats), file=out)
    print(f"cache hit rate: {hit_rate:.2%} ({handed_out - misses} of {handed_out} requests served "
          f"from the cache; {misses} device allocations)", file=out)
    print(f"training: {pool_seconds:.2f} s with unimem (recording its memory history) vs "
          f"{own_seconds:.2f} s with {library}'s own allocation: "
          f"{_difference(own_seconds, pool_seconds)} (losses {pool_loss:.4f} / {own_loss:.4f})",
          file=out)
    print(f"allocation alone ({requests} requests of this run, replayed): "
          f"{pool_alloc_seconds * 1e3:.1f} ms through the pool vs {raw_alloc_seconds * 1e3:.1f} ms "
          f"of raw {dtype.pool.display_name} malloc/free: "
          f"{_difference(raw_alloc_seconds, pool_alloc_seconds)}", file=out)
    # Where the training times differ beyond the allocator's own work: what
    # the operating system did for the process (a page fault is a first touch
    # of newly mapped memory), measured in the two trainings above.
    if pool_costs is not None and own_costs is not None:
        print(f"where the training times differ (unimem vs {library}'s own, measured in the runs above): "
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
            "pool_seconds": pool_seconds, "own_seconds": own_seconds,
            "pool_alloc_seconds": pool_alloc_seconds, "raw_alloc_seconds": raw_alloc_seconds,
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


def _difference(baseline: float, pooled: float) -> str:
    """'3.2x faster, 12.0 ms saved' or '1.10x slower, 0.4 ms lost'."""
    if pooled <= baseline:
        return (f"{baseline / max(pooled, 1e-9):.1f}x faster, "
                f"{(baseline - pooled) * 1e3:.1f} ms saved")
    return f"{pooled / max(baseline, 1e-9):.2f}x slower, {(pooled - baseline) * 1e3:.1f} ms lost"


def _provoke_out_of_memory(allocator: _core.CachingAllocator, out: TextIO) -> None:
    """Ask for more than the device holds, to show the report unimem gives."""
    too_much = max(allocator.capacity, 1 << 30) * 2
    try:
        allocator.malloc(too_much)
    except _core.OutOfMemoryError as error:
        print(f"\nasked for more than the device holds, to show the report:\n  {error}", file=out)
