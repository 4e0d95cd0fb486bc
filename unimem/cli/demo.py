"""``python -m unimem demo``: the main job.

Trains a small multilayer perceptron for a few hundred steps on the default
device of this machine (dpnp on a SYCL device, CuPy on a GPU, NumPy on host
memory otherwise), every array through unimem's pool, with the memory history
recorded. Then it shows what the pool did:

* the statistics table (``memory_summary``);
* the cache hit rate: requests served without asking the device for memory;
* the time saved, measured in the same run: the same training with the array
  library's own allocation, and the same sequence of allocations replayed
  through the raw backend and through the pool;
* where the training times differ beyond that: the time the loop spent making
  and dropping arrays, and the page faults and operating-system time of each
  run (memory the device maps afresh is faulted in on first touch; the pool's
  is already mapped);
* the snapshot (``snapshot.pickle``, readable by pytorch.org/memory_viz) and
  the timeline picture (``timeline.png``) in the output folder.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

import numpy

from .. import _core
from .._runtime.devices import current_type

Empty = Callable[..., Any]


# ---------------------------------------------------------------------------
# the array library of the default device
# ---------------------------------------------------------------------------
@dataclass
class Workload:
    """An array library on one device, with pooled and native allocation."""

    description: str
    xp: Any                                   # the array module
    pool_empty: Empty                         # arrays from unimem's pool
    native_empty: Empty                       # arrays from the library's own allocation
    upload: Callable[[numpy.ndarray, Empty], Any]
    synchronize: Callable[[], None]
    allocator: _core.CachingAllocator
    memory_api: Any                           # unimem.xpu / unimem.cuda / unimem.cpu


def default_workload() -> Workload:
    dtype = current_type()
    index = dtype.current_index()
    allocator = dtype.allocator(index)
    if dtype.name == "xpu":
        import dpnp

        import unimem.xpu as api
        queue = api.default_queue(index)

        def upload(host: numpy.ndarray, empty: Empty) -> Any:
            out = empty(host.shape, host.dtype)
            out.get_array()[...] = host
            return out

        return Workload(f"dpnp on XPU {index} ({queue.sycl_device.name}, SYCL {queue.sycl_device.backend.name})",
                        dpnp, functools.partial(api.empty, sycl_queue=queue),
                        functools.partial(_dpnp_empty, dpnp.empty, sycl_queue=queue),
                        upload, queue.wait, allocator, api)
    if dtype.name == "cuda":
        import cupy

        import unimem.cuda as api

        def upload_cuda(host: numpy.ndarray, empty: Empty) -> Any:
            out = empty(host.shape, host.dtype)
            out.set(host)
            return out

        name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return Workload(f"CuPy on GPU {index} ({name})", cupy,
                        functools.partial(_cupy_empty, cupy, api.allocator),
                        functools.partial(_cupy_empty, cupy, None),        # plain cudaMalloc / cudaFree
                        upload_cuda, cupy.cuda.get_current_stream().synchronize, allocator, api)
    import unimem.cpu as api

    def upload_host(host: numpy.ndarray, empty: Empty) -> Any:
        out = empty(host.shape, host.dtype)
        out[...] = host
        return out

    return Workload("NumPy on host memory (the cpu pool)", numpy, api.empty, numpy.empty,
                    upload_host, lambda: None, allocator, api)


# Allocation helpers passed through functools.partial, so that the recorded
# stacks start at the training loop's own lines.
def _dpnp_empty(empty: Empty, shape: Any, dtype: Any, **kwargs: Any) -> Any:
    return empty(shape, dtype=dtype, **kwargs)


def _cupy_empty(cupy: Any, allocator: Any, shape: Any, dtype: Any) -> Any:
    with cupy.cuda.using_allocator(allocator):
        return cupy.empty(shape, dtype)


# ---------------------------------------------------------------------------
# the training loop
# ---------------------------------------------------------------------------
LAYERS = (512, 1024, 256, 10)
BATCHES = (256, 256, 224, 192, 160, 128)      # batch sizes vary, as the last batch of an epoch does


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


def train(work: Workload, empty: Empty, steps: int, progress: Optional[Progress] = None,
          seed: int = 0, timing: Optional[Dict[str, float]] = None) -> Tuple[float, float]:
    """Train the MLP (mean squared error, plain SGD) for ``steps`` steps with
    every array from ``empty``; returns (seconds, last loss).

    With ``timing``, adds to ``timing["create"]`` the seconds spent making
    arrays and to ``timing["free"]`` those spent dropping them (where the
    array library gives their memory back), measured inside the loop."""
    xp = work.xp
    if timing is not None:
        timing.setdefault("create", 0.0)
        timing.setdefault("free", 0.0)
        make = empty

        def empty(*args: Any, **kwargs: Any) -> Any:       # noqa: F811 - the same, timed
            started = time.perf_counter()
            made = make(*args, **kwargs)
            timing["create"] += time.perf_counter() - started
            return made
    rng = numpy.random.default_rng(seed)
    d_in, d_h1, d_h2, d_out = LAYERS
    inputs = rng.standard_normal((2048, d_in)).astype("f4")
    teacher = rng.standard_normal((d_in, d_out)).astype("f4") / numpy.sqrt(d_in)
    targets = numpy.tanh(inputs @ teacher).astype("f4")
    weights = [work.upload((rng.standard_normal((a, b)) * numpy.sqrt(2.0 / a)).astype("f4"), empty)
               for a, b in zip(LAYERS, LAYERS[1:])]
    w1, w2, w3 = weights
    lr = 0.05
    loss = float("nan")
    work.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        batch = BATCHES[step % len(BATCHES)]
        rows = rng.integers(0, len(inputs), batch)
        x = work.upload(inputs[rows], empty)
        t = work.upload(targets[rows], empty)
        # forward (ReLU as a mask, which the backward pass reuses)
        h1 = empty((batch, d_h1), "f4")
        xp.matmul(x, w1, out=h1)
        mask1 = empty((batch, d_h1), "?")
        xp.greater(h1, 0, out=mask1)
        xp.multiply(h1, mask1, out=h1)
        h2 = empty((batch, d_h2), "f4")
        xp.matmul(h1, w2, out=h2)
        mask2 = empty((batch, d_h2), "?")
        xp.greater(h2, 0, out=mask2)
        xp.multiply(h2, mask2, out=h2)
        y = empty((batch, d_out), "f4")
        xp.matmul(h2, w3, out=y)
        grad_y = empty((batch, d_out), "f4")
        xp.subtract(y, t, out=grad_y)
        if step % 20 == 0 or step == steps - 1:
            squared = empty((batch, d_out), "f4")
            xp.multiply(grad_y, grad_y, out=squared)
            loss = float(squared.mean())
        # backward
        grad_w3 = empty((d_h2, d_out), "f4")
        xp.matmul(h2.T, grad_y, out=grad_w3)
        grad_h2 = empty((batch, d_h2), "f4")
        xp.matmul(grad_y, w3.T, out=grad_h2)
        xp.multiply(grad_h2, mask2, out=grad_h2)
        grad_w2 = empty((d_h1, d_h2), "f4")
        xp.matmul(h1.T, grad_h2, out=grad_w2)
        grad_h1 = empty((batch, d_h1), "f4")
        xp.matmul(grad_h2, w2.T, out=grad_h1)
        xp.multiply(grad_h1, mask1, out=grad_h1)
        grad_w1 = empty((d_in, d_h1), "f4")
        xp.matmul(x.T, grad_h1, out=grad_w1)
        # update
        for w, g in ((w1, grad_w1), (w2, grad_w2), (w3, grad_w3)):
            xp.multiply(g, lr / batch, out=g)
            xp.subtract(w, g, out=w)
        freeing = time.perf_counter()
        del x, t, h1, h2, y, grad_y, grad_w1, grad_w2, grad_w3, grad_h1, grad_h2, mask1, mask2
        if timing is not None:
            timing["free"] += time.perf_counter() - freeing
        if progress is not None:
            progress.update(step + 1, loss if step % 20 == 0 or step == steps - 1 else None)
    work.synchronize()
    return time.perf_counter() - start, loss


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

    out = out or sys.stdout
    work = default_workload()
    dtype = current_type()
    allocator = work.allocator
    index = allocator.device
    print(f"unimem demo: a {'-'.join(map(str, LAYERS))} MLP, {steps} training steps, "
          f"{work.description}", file=out, flush=True)

    # Warm up (kernel compilation and library start-up costs nobody's allocator).
    train(work, work.native_empty, 3)
    train(work, work.pool_empty, 3)

    # 1. The array library's own allocation.
    native_timing: Dict[str, float] = {}
    before = _process_costs()
    native_seconds, native_loss = train(work, work.native_empty, steps,
                                        Progress(steps, "native", out), timing=native_timing)
    native_costs = _process_costs(since=before)
    # 2. The same training through the pool, history recorded.
    allocator.empty_cache()
    allocator.reset_accumulated_stats()
    allocator.reset_peak_stats()
    work.memory_api._record_memory_history(max_entries=200_000, clear_history=True)
    pool_timing: Dict[str, float] = {}
    before = _process_costs()
    pool_seconds, pool_loss = train(work, work.pool_empty, steps, Progress(steps, "unimem pool", out),
                                    timing=pool_timing)
    pool_costs = _process_costs(since=before)
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
    print(f"cache hit rate: {hit_rate:.2%} ({handed_out - misses} of {handed_out} requests served "
          f"from the cache; {misses} device allocations)", file=out)
    print(f"training: {pool_seconds:.2f} s through the pool (recording its memory history) vs "
          f"{native_seconds:.2f} s with {work.xp.__name__}'s own allocation: "
          f"{_difference(native_seconds, pool_seconds)} (losses {pool_loss:.4f} / {native_loss:.4f})",
          file=out)
    print(f"allocation alone ({requests} requests of this run, replayed): "
          f"{pool_alloc_seconds * 1e3:.1f} ms through the pool vs {raw_alloc_seconds * 1e3:.1f} ms "
          f"of raw {dtype.pool.display_name} malloc/free: "
          f"{_difference(raw_alloc_seconds, pool_alloc_seconds)}", file=out)
    # Where the training times differ beyond the allocator's own work: the
    # arrays' creation and release as the loop saw them, and what the
    # operating system did for the process (a page fault is a first touch of
    # newly mapped memory), all measured in the two runs above.
    print(f"where the training times differ (pool vs {work.xp.__name__}, measured in the runs above): "
          f"making arrays {pool_timing['create']:.2f} s vs {native_timing['create']:.2f} s, "
          f"dropping them {pool_timing['free']:.2f} s vs {native_timing['free']:.2f} s"
          + ("" if pool_costs is None or native_costs is None else
             f", {pool_costs[0]:,} vs {native_costs[0]:,} page faults (first touches of newly mapped "
             f"memory) and {pool_costs[1]:.2f} s vs {native_costs[1]:.2f} s of operating-system time"),
          file=out)
    print(f"peak reserved {_core.format_size(stats['reserved_bytes.all.peak'])} for a peak of "
          f"{_core.format_size(stats['requested_bytes.all.peak'])} requested", file=out)

    os.makedirs(out_dir, exist_ok=True)
    snapshot_path = os.path.join(out_dir, "snapshot.pickle")
    picture_path = os.path.join(out_dir, "timeline.png")
    import pickle
    with open(snapshot_path, "wb") as f:
        pickle.dump(snapshot, f)
    plot_snapshot(snapshot, picture_path, device=index,
                  title=f"unimem demo: {work.description}")
    print(f"wrote {snapshot_path} (open it at https://pytorch.org/memory_viz) and {picture_path}",
          file=out, flush=True)
    return {"device": f"{dtype.name}:{index}", "steps": steps, "hit_rate": hit_rate,
            "pool_seconds": pool_seconds, "native_seconds": native_seconds,
            "pool_alloc_seconds": pool_alloc_seconds, "raw_alloc_seconds": raw_alloc_seconds,
            "snapshot": snapshot_path, "picture": picture_path, "loss": pool_loss,
            "pool_timing": pool_timing, "native_timing": native_timing,
            "pool_faults_and_system_seconds": pool_costs, "native_faults_and_system_seconds": native_costs}


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
