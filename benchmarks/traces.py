"""Allocation traces of realistic workloads, generated (committed as code).

A trace is a list of events: ``("alloc", key, size)`` and ``("free", key)``.
Replayed through an allocator on a simulated device, it gives the peak
reserved memory against the peak requested memory (the live sizes asked for).

* :func:`transformer_training` - a GPT-style model trained with Adam: fp32
  parameters, optimizer state created at the first step, per-layer forward
  activations kept for the backward pass (attention scores included),
  gradients, and the temporaries of each kernel.
* :func:`kv_cache_inference` - generating tokens with a key/value cache per
  layer that grows by chunks (reallocated and copied), with per-token
  temporaries: ever larger sizes, the hard case for a caching allocator.
* :func:`random_mix` - log-uniform sizes from 512 B to 64 MiB with random
  lifetimes.
* :func:`creeping_sizes` - requests of about 1 MB whose sizes creep upward,
  random older ones freed to keep about 96 MiB live (issue 27): every freed
  block leaves a hole that the next, larger, request does not fit.
* :func:`random_frees` - a pool of mixed sizes (64 KiB to 8 MiB) filled,
  then phases that free a random share of it and refill it with sizes drawn
  from a shifting range: holes of every size all over the address range.
"""
from __future__ import annotations

import random
from typing import Callable, Dict, Iterator, List, Tuple, Union

Event = Union[Tuple[str, int, int], Tuple[str, int]]
MiB = 1 << 20


class _Recorder:
    def __init__(self) -> None:
        self.events: List[Event] = []
        self._next = 0

    def alloc(self, size: int) -> int:
        self._next += 1
        self.events.append(("alloc", self._next, int(size)))
        return self._next

    def free(self, key: int) -> None:
        self.events.append(("free", key))


def transformer_training(layers: int = 12, hidden: int = 1024, heads: int = 16, batch: int = 8,
                         seq: int = 512, vocab: int = 32000, steps: int = 3) -> List[Event]:
    """A GPT-style training loop (fp32 weights, fp16 activations, Adam)."""
    r = _Recorder()
    f32, f16 = 4, 2
    tokens = batch * seq
    shapes = [vocab * hidden] + [s for _ in range(layers) for s in (
        3 * hidden * hidden, hidden * hidden, 4 * hidden * hidden, 4 * hidden * hidden, hidden, hidden)]
    params = [r.alloc(n * f32) for n in shapes]
    grads: Dict[int, int] = {}
    optimizer: List[int] = []
    for step in range(steps):
        saved: List[List[int]] = []
        x = r.alloc(tokens * hidden * f16)                       # embeddings out
        for _ in range(layers):
            keep = []
            ln = r.alloc(tokens * hidden * f16); keep.append(ln)
            qkv = r.alloc(tokens * 3 * hidden * f16); keep.append(qkv)
            scores = r.alloc(batch * heads * seq * seq * f16); keep.append(scores)
            probs = r.alloc(batch * heads * seq * seq * f16); keep.append(probs)
            tmp = r.alloc(batch * heads * seq * 4)                # softmax row statistics
            r.free(tmp)
            attn = r.alloc(tokens * hidden * f16); keep.append(attn)
            proj = r.alloc(tokens * hidden * f16)
            h1 = r.alloc(tokens * 4 * hidden * f16); keep.append(h1)
            act = r.alloc(tokens * 4 * hidden * f16); keep.append(act)
            out = r.alloc(tokens * hidden * f16)
            r.free(proj)
            r.free(x)
            x = out
            saved.append(keep)
        logits = r.alloc(tokens * vocab * f16)
        loss_tmp = r.alloc(tokens * 4)
        r.free(loss_tmp)
        grad_x = r.alloc(tokens * vocab * f16)
        r.free(logits)
        r.free(x)
        upstream = r.alloc(tokens * hidden * f16)
        r.free(grad_x)
        for layer in reversed(range(layers)):
            for k, p in enumerate(params[1 + 6 * layer: 7 + 6 * layer]):
                if p not in grads:
                    grads[p] = r.alloc(shapes[1 + 6 * layer + k] * f32)
                work = r.alloc(shapes[1 + 6 * layer + k] * f16)   # this step's contribution
                r.free(work)
            for a in reversed(saved[layer]):
                g = r.alloc(_size_of(r, a))                      # the gradient of an activation
                r.free(a)
                r.free(g)
            nxt = r.alloc(tokens * hidden * f16)
            r.free(upstream)
            upstream = nxt
        r.free(upstream)
        if not optimizer:                                        # Adam's two moments, created lazily
            optimizer = [r.alloc(n * f32) for n in shapes for _ in range(2)]
        for n in shapes:                                         # the update's temporaries
            t = r.alloc(n * f32)
            r.free(t)
        for g in grads.values():
            r.free(g)
        grads.clear()
    for key in params + optimizer:
        r.free(key)
    return r.events


def _size_of(recorder: _Recorder, key: int) -> int:
    for event in reversed(recorder.events):
        if event[0] == "alloc" and event[1] == key:
            return event[2]                                      # type: ignore[misc]
    raise KeyError(key)


def kv_cache_inference(layers: int = 24, heads: int = 16, head_dim: int = 64, batch: int = 4,
                       prompt: int = 512, new_tokens: int = 256, chunk: int = 32,
                       hidden: int = 1024) -> List[Event]:
    """Token generation with a per-layer KV cache grown by ``chunk`` tokens at a time."""
    r = _Recorder()
    f16 = 2
    per_token = 2 * batch * heads * head_dim * f16              # keys and values
    weights = [r.alloc(12 * hidden * hidden * f16) for _ in range(layers)]
    capacity = prompt + chunk
    caches = [r.alloc(per_token * capacity) for _ in range(layers)]
    length = prompt
    for _ in range(new_tokens):
        x = r.alloc(batch * hidden * f16)
        for layer in range(layers):
            q = r.alloc(batch * hidden * f16)
            scores = r.alloc(batch * heads * (length + 1) * 4)
            out = r.alloc(batch * hidden * f16)
            r.free(scores)
            r.free(q)
            r.free(x)
            x = out
        r.free(x)
        length += 1
        if length == capacity:                                   # grow every cache: new, copy, free old
            capacity += chunk
            for layer in range(layers):
                bigger = r.alloc(per_token * capacity)
                r.free(caches[layer])
                caches[layer] = bigger
    for key in caches + weights:
        r.free(key)
    return r.events


def random_mix(operations: int = 20_000, seed: int = 0, max_live: int = 400) -> List[Event]:
    """Log-uniform sizes (512 B to 64 MiB), random lifetimes."""
    rng = random.Random(seed)
    r = _Recorder()
    live: List[int] = []
    for _ in range(operations):
        if live and (len(live) >= max_live or rng.random() < 0.5):
            r.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(r.alloc(int(2 ** rng.uniform(9, 26))))
    for key in live:
        r.free(key)
    return r.events


def creeping_sizes(steps: int = 3000, live_bytes: int = 96 * MiB, seed: int = 1) -> List[Event]:
    """About 1 MB requests growing by half over the run (with 5% jitter);
    while more than ``live_bytes`` are live, a random older one is freed."""
    rng = random.Random(seed)
    r = _Recorder()
    live: List[Tuple[int, int]] = []
    held = 0
    for step in range(steps):
        size = int(1_000_000 * (1 + 0.5 * step / steps) * rng.uniform(0.95, 1.05))
        live.append((r.alloc(size), size))
        held += size
        while held > live_bytes:
            key, freed = live.pop(rng.randrange(len(live) - 1))   # never the newest
            r.free(key)
            held -= freed
    for key, _ in live:
        r.free(key)
    return r.events


def random_frees(phases: int = 40, live_bytes: int = 256 * MiB, share: float = 0.3,
                 seed: int = 2) -> List[Event]:
    """Fill ``live_bytes`` with log-uniform sizes, then in each phase free a
    random ``share`` of the live blocks and refill with sizes from a range
    that drifts between 64 KiB-1 MiB and 1-8 MiB."""
    rng = random.Random(seed)
    r = _Recorder()
    live: List[Tuple[int, int]] = []
    held = 0
    for phase in range(phases + 1):
        low = 16 + 4 * (phase % 8) / 7                                # log2 of the smallest size
        while held < live_bytes:
            size = int(2 ** rng.uniform(low, low + 4))
            live.append((r.alloc(size), size))
            held += size
        rng.shuffle(live)
        for key, size in live[:int(len(live) * share)]:
            r.free(key)
            held -= size
        del live[:int(len(live) * share)]
    for key, _ in live:
        r.free(key)
    return r.events


TRACES: Dict[str, Callable[[], List[Event]]] = {
    "transformer training": transformer_training,
    "KV-cache inference": kv_cache_inference,
    "random mix": random_mix,
    "creeping sizes": creeping_sizes,
    "random frees": random_frees,
}


def replay(events: List[Event], malloc: Callable[[int], int], free: Callable[[int], None]) -> Iterator[int]:
    """Run a trace; yields after every event (so callers can sample)."""
    live: Dict[int, int] = {}
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = malloc(event[2])                    # type: ignore[misc]
        else:
            free(live.pop(event[1]))
        yield 0
