"""Ordinary dpnp code, with and without ``unimem.xpu.set_allocator()``.

Three workloads written as a dpnp user writes them (no ``out=``, no unimem
call inside), each run plain and inside ``unimem.xpu.using_allocator()`` in
the same process, interleaved (the order alternates between repeats), from
the same seed, after a warm-up:

* ``mlp``: a training step of a three-layer MLP on a minibatch gathered with
  an index array (matmul, ReLU, softmax/cross-entropy, backward by hand, SGD
  update), MNIST-shaped (784 inputs, two hidden layers of 512, batch 256):
  64 temporaries per step, most of them 0.5-1 MiB - the allocation-heavy one;
* ``mlp_small``: the same step with 64 inputs, hidden layers of 128 and batch
  64 (temporaries of 2-32 KiB): each dpnp operation's own cost (about 150 us
  to submit on a CPU device) dwarfs what any allocator saves, so it shows the
  floor of the gain rather than the gain;
* ``kmeans``: Lloyd's k-means (distances by broadcasting, argmin, per-cluster
  means through boolean masks);
* ``linalg_fft_sort``: ``dpnp.linalg.solve`` and ``qr``, ``dpnp.fft.rfft``,
  ``sort``/``argsort`` and reductions on fewer, larger arrays.

Per workload: the median time per iteration plain and hooked, and in the
hooked steady state (after the warm-up) the share of Python-level array
allocations the pools served (``allocator_counters`` deltas) and the raw
device allocations per iteration (the device pool's ``num_device_alloc``
delta plus the requests passed to dpctl). dpnp's compiled code also
allocates small scratch buffers with ``sycl::malloc`` directly; no Python
hook sees them, so they are in neither figure. Results must be identical
with and without the allocator.

Then the cost of one ``dpnp.empty(n)`` (allocate and drop) with the
allocator installed and without, 512 B to 256 MiB.

Targets: no workload slower than plain dpnp; the allocation-heavy one at
least 1.3x faster; 100% of Python-level allocations pooled and 0 raw
allocations per iteration in the steady state; ``dpnp.empty`` faster with
the allocator at every size.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy

from ._common import command_line, format_time, print_table, report, seconds_per_call, size_name

SIZES = [512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
HEAVY = "mlp"     # the allocation-heavy workload


# ---------------------------------------------------------------------------
# the workloads: make(dpnp, seed) -> (step, result); step() runs one
# iteration, result() gives the state as NumPy arrays
# ---------------------------------------------------------------------------
def make_mlp(dp: Any, seed: int, samples: int = 4096, features: int = 64, hidden: int = 128, classes: int = 10,
             batch: int = 64, lr: float = 0.05) -> Tuple[Callable[[], Any], Callable[[], List[numpy.ndarray]]]:
    rng = numpy.random.default_rng(seed)
    x_all = dp.asarray(rng.standard_normal((samples, features), dtype=numpy.float32))
    y_all = dp.asarray(rng.integers(0, classes, samples).astype(numpy.int64))
    shapes = [(features, hidden), (hidden, hidden), (hidden, classes)]
    params = {}
    for i, (fan_in, fan_out) in enumerate(shapes):
        params[f"w{i}"] = dp.asarray((rng.standard_normal((fan_in, fan_out)) / numpy.sqrt(fan_in))
                                     .astype(numpy.float32))
        params[f"b{i}"] = dp.zeros(fan_out, dtype=dp.float32)
    batches = [rng.integers(0, samples, batch) for _ in range(64)]
    counter = [0]

    def step() -> Any:
        idx = dp.asarray(batches[counter[0] % len(batches)])
        counter[0] += 1
        xb, yb = x_all[idx], y_all[idx]                      # fancy indexing: the minibatch
        w0, b0, w1, b1, w2, b2 = (params[k] for k in ("w0", "b0", "w1", "b1", "w2", "b2"))
        h0 = xb @ w0 + b0
        a0 = dp.maximum(h0, 0)
        h1 = a0 @ w1 + b1
        a1 = dp.maximum(h1, 0)
        logits = a1 @ w2 + b2
        shifted = logits - logits.max(axis=1, keepdims=True)
        e = dp.exp(shifted)
        p = e / e.sum(axis=1, keepdims=True)
        rows = dp.arange(batch)
        loss = -dp.log(p[rows, yb] + 1e-12).mean()
        # backward, by hand
        dlogits = p.copy()
        dlogits[rows, yb] -= 1
        dlogits = dlogits / batch
        grads = {"w2": a1.T @ dlogits, "b2": dlogits.sum(axis=0)}
        da1 = dlogits @ w2.T
        dh1 = da1 * (h1 > 0)
        grads["w1"], grads["b1"] = a0.T @ dh1, dh1.sum(axis=0)
        da0 = dh1 @ w1.T
        dh0 = da0 * (h0 > 0)
        grads["w0"], grads["b0"] = xb.T @ dh0, dh0.sum(axis=0)
        for name, grad in grads.items():                      # SGD
            params[name] = params[name] - lr * grad
        return loss

    def result() -> List[numpy.ndarray]:
        return [dp.asnumpy(params[k]) for k in sorted(params)]
    return step, result


def make_kmeans(dp: Any, seed: int) -> Tuple[Callable[[], Any], Callable[[], List[numpy.ndarray]]]:
    rng = numpy.random.default_rng(seed)
    points, dims, k = 8192, 8, 12
    centres_true = rng.standard_normal((k, dims)) * 4
    labels_true = rng.integers(0, k, points)
    x = dp.asarray((centres_true[labels_true] + rng.standard_normal((points, dims))).astype(numpy.float32))
    state = {"centres": x[dp.asarray(rng.choice(points, k, replace=False))]}
    state["labels"] = dp.zeros(points, dtype=dp.int64)

    def step() -> Any:
        centres = state["centres"]
        d = ((x[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)   # distances by broadcasting
        labels = dp.argmin(d, axis=1)
        new = dp.empty_like(centres)
        for j in range(k):
            members = x[labels == j]
            new[j] = members.mean(axis=0) if members.shape[0] else centres[j]
        state["centres"], state["labels"] = new, labels
        return d.min(axis=1).sum()

    def result() -> List[numpy.ndarray]:
        return [dp.asnumpy(state["centres"]), dp.asnumpy(state["labels"])]
    return step, result


def make_linalg_fft_sort(dp: Any, seed: int) -> Tuple[Callable[[], Any], Callable[[], List[numpy.ndarray]]]:
    rng = numpy.random.default_rng(seed)
    n, signals, length = 96, 16, 4096
    a = dp.asarray(rng.standard_normal((n, n)))
    b = dp.asarray(rng.standard_normal(n))
    sig = dp.asarray(rng.standard_normal((signals, length)))
    state: Dict[str, Any] = {"shift": 1.0}

    def step() -> Any:
        m = a + state["shift"] * dp.eye(n)
        x = dp.linalg.solve(m, b)
        q, r = dp.linalg.qr(m)
        spectrum = dp.fft.rfft(sig * x[:signals, None], axis=1)
        power = dp.abs(spectrum) ** 2
        ordered = dp.sort(power, axis=1)
        top = dp.argsort(power[0])[-8:]
        summary = dp.stack([power.mean(axis=1), power.std(axis=1), ordered[:, -1],
                            dp.cumsum(dp.abs(dp.diagonal(r)))[:signals]])
        state["shift"] = 1.0 + float(dp.linalg.norm(q @ r - m)) * 1e3
        state.update(x=x, summary=summary, top=top)
        return summary

    def result() -> List[numpy.ndarray]:
        return [dp.asnumpy(state[key]) for key in ("x", "summary", "top")] + [numpy.array(state["shift"])]
    return step, result


WORKLOADS = {"mlp": functools.partial(make_mlp, features=784, hidden=512, batch=256, samples=8192),
             "mlp_small": make_mlp, "kmeans": make_kmeans, "linalg_fft_sort": make_linalg_fft_sort}


# ---------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------
def _device_allocs(xpu: Any) -> int:
    return int(xpu.memory_stats(0).get("num_device_alloc", 0))


def _one_run(dp: Any, xpu: Any, queue: Any, make: Callable, seed: int, warmup: int, iterations: int,
             hooked: bool) -> Dict[str, Any]:
    """Build the workload from ``seed``, warm up, time ``iterations`` steps."""
    import contextlib
    context = xpu.using_allocator() if hooked else contextlib.nullcontext()
    with context:
        step, result = make(dp, seed)
        for _ in range(warmup):
            step()
        queue.wait()
        counters, device_allocs = xpu.allocator_counters(), _device_allocs(xpu)
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        queue.wait()
        elapsed = time.perf_counter() - start
        after, device_after = xpu.allocator_counters(), _device_allocs(xpu)
        out = result()
        del step, result
    delta = {key: after[key] - counters.get(key, 0) for key in after}
    return {"seconds_per_iteration": elapsed / iterations, "counters": delta,
            "device_allocs": device_after - device_allocs, "result": out}


def _identical(a: List[numpy.ndarray], b: List[numpy.ndarray]) -> Tuple[bool, float]:
    same = all(x.shape == y.shape and x.dtype == y.dtype and numpy.array_equal(x, y, equal_nan=True)
               for x, y in zip(a, b)) and len(a) == len(b)
    worst = max((float(numpy.max(numpy.abs(x.astype(float) - y.astype(float)))) if x.size else 0.0)
                for x, y in zip(a, b)) if not same else 0.0
    return same, worst


def measure_workload(dp: Any, xpu: Any, queue: Any, name: str, repeats: int, warmup: int,
                     iterations: int) -> Dict[str, Any]:
    make = WORKLOADS[name]
    times: Dict[bool, List[float]] = {False: [], True: []}
    pooled = bypassed = pooled_bytes = bypassed_bytes = raw = 0
    identical, worst = True, 0.0
    for repeat in range(repeats):
        runs = {}
        for hooked in ((False, True) if repeat % 2 == 0 else (True, False)):
            runs[hooked] = _one_run(dp, xpu, queue, make, 1234 + repeat, warmup, iterations, hooked)
            times[hooked].append(runs[hooked]["seconds_per_iteration"])
        counters = runs[True]["counters"]
        pooled += counters["pooled.allocations"]
        pooled_bytes += counters["pooled.bytes"]
        bypassed += counters["bypassed.allocations"]
        bypassed_bytes += counters["bypassed.bytes"]
        raw += runs[True]["device_allocs"] + counters["bypassed.allocations"]
        same, diff = _identical(runs[False]["result"], runs[True]["result"])
        identical, worst = identical and same, max(worst, diff)
    plain, hooked = statistics.median(times[False]), statistics.median(times[True])
    steps = repeats * iterations
    return {"workload": name, "plain_s": plain, "hooked_s": hooked, "speedup": plain / hooked,
            "plain_runs_s": times[False], "hooked_runs_s": times[True],
            "allocations_per_iteration": (pooled + bypassed) / steps,
            "bytes_per_iteration": (pooled_bytes + bypassed_bytes) / steps,
            "pooled_calls_share": pooled / (pooled + bypassed) if pooled + bypassed else 0.0,
            "pooled_bytes_share": pooled_bytes / (pooled_bytes + bypassed_bytes) if pooled_bytes + bypassed_bytes
            else 0.0,
            "raw_allocs_per_iteration": raw / steps, "identical": identical, "max_abs_difference": worst,
            "repeats": repeats, "warmup": warmup, "iterations": iterations}


def measure_empty(dp: Any, xpu: Any, queue: Any, size: int, repeats: int, min_time: float) -> Dict[str, Any]:
    count = max(size // 4, 1)
    times: Dict[bool, List[float]] = {False: [], True: []}

    def one() -> None:
        dp.empty(count, dtype="f4")
    for repeat in range(repeats):
        for hooked in ((False, True) if repeat % 2 == 0 else (True, False)):
            if hooked:
                with xpu.using_allocator():
                    times[True].append(seconds_per_call(one, repeats=1, min_time=min_time))
            else:
                times[False].append(seconds_per_call(one, repeats=1, min_time=min_time))
        queue.wait()
    plain, hooked = statistics.median(times[False]), statistics.median(times[True])
    return {"size": size, "plain_s": plain, "hooked_s": hooked, "speedup": plain / hooked}


def run(quick: bool = False) -> Dict[str, Any]:
    import unimem  # noqa: F401  (finds the OpenCL CPU runtime before dpctl looks for devices)
    import unimem.xpu as xpu
    from unimem._runtime import devices as _devices

    if not _devices.is_available("xpu"):
        raise SystemExit(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
    import dpnp as dp
    if xpu.allocator_installed():
        raise SystemExit("unimem.xpu.set_allocator() is in effect: the plain runs would not be plain")
    queue = dp.empty(1).sycl_queue
    device = queue.sycl_device
    # warm-up: long enough for the pools to reach the high-water mark of blocks
    # still held by kernels in flight (their frees come back asynchronously)
    repeats, warmup, iterations = (3, 6, 4) if quick else (7, 10, 12)
    # relative sizes: each ~ the same time
    iterations_of = {"mlp": 2, "mlp_small": 5, "kmeans": 1, "linalg_fft_sort": 1}
    rows = [measure_workload(dp, xpu, queue, name, repeats, warmup, iterations * iterations_of[name])
            for name in WORKLOADS]
    print_table(f"ordinary dpnp, plain vs unimem.xpu.using_allocator(), on {device.name} "
                f"({device.backend}); median of {repeats} interleaved runs",
                ["workload", "plain / iter", "hooked / iter", "speedup", "arrays / iter", "pooled (calls)",
                 "pooled (bytes)", "raw allocs / iter", "identical"],
                [[r["workload"], format_time(r["plain_s"]), format_time(r["hooked_s"]), f"{r['speedup']:.2f}x",
                  f"{r['allocations_per_iteration']:.0f}", f"{100 * r['pooled_calls_share']:.1f}%",
                  f"{100 * r['pooled_bytes_share']:.1f}%", f"{r['raw_allocs_per_iteration']:.2f}",
                  "yes" if r["identical"] else f"NO (max diff {r['max_abs_difference']:.3g})"] for r in rows])
    empty_rows = [measure_empty(dp, xpu, queue, size, 3 if quick else 7, 0.005 if quick else 0.02)
                  for size in SIZES]
    print_table("dpnp.empty(n) (allocate and drop), plain vs with unimem's allocator installed",
                ["size", "plain dpnp", "with unimem", "speedup"],
                [[size_name(r["size"]), format_time(r["plain_s"]), format_time(r["hooked_s"]),
                  f"{r['speedup']:.2f}x"] for r in empty_rows])
    slowest = min(rows, key=lambda r: r["speedup"])
    heavy = next(r for r in rows if r["workload"] == HEAVY)
    least_pooled = min(rows, key=lambda r: min(r["pooled_calls_share"], r["pooled_bytes_share"]))
    most_raw = max(rows, key=lambda r: r["raw_allocs_per_iteration"])
    worst_empty = min(empty_rows, key=lambda r: r["speedup"])
    different = [r["workload"] for r in rows if not r["identical"]]
    targets = [
        {"target": "no workload slower than plain dpnp",
         "measured": f"slowest {slowest['speedup']:.2f}x ({slowest['workload']})",
         "met": slowest["speedup"] >= 1.0},
        {"target": f"allocation-heavy workload ({HEAVY}) >= 1.3x faster",
         "measured": f"{heavy['speedup']:.2f}x", "met": heavy["speedup"] >= 1.3},
        {"target": "100% of Python-level allocations pooled (steady state)",
         "measured": f"lowest {100 * min(least_pooled['pooled_calls_share'], least_pooled['pooled_bytes_share']):.1f}%"
                     f" ({least_pooled['workload']})",
         "met": all(r["pooled_calls_share"] == 1.0 and r["pooled_bytes_share"] == 1.0 for r in rows)},
        {"target": "0 raw device allocations per iteration (steady state, Python-level)",
         "measured": f"most {most_raw['raw_allocs_per_iteration']:.2f} ({most_raw['workload']})",
         "met": most_raw["raw_allocs_per_iteration"] == 0},
        {"target": "results identical with and without the allocator",
         "measured": "identical" if not different else f"differ: {', '.join(different)}", "met": not different},
        {"target": "dpnp.empty faster with the allocator, every size",
         "measured": f"worst {worst_empty['speedup']:.2f}x at {size_name(worst_empty['size'])}",
         "met": worst_empty["speedup"] > 1.0},
    ]
    xpu.empty_cache()
    return report("dpnp", targets, device=device.name, backend=str(device.backend), quick=quick,
                  workloads=rows, empty=empty_rows)


if __name__ == "__main__":
    command_line(run, __doc__)
