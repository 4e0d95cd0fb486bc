"""Allocation traces recorded from real PyTorch runs, and how to read them.

PyTorch records its allocator's history with
``torch.cuda.memory._record_memory_history()``; ``torch.cuda.memory._snapshot()``
then holds, per device, the events in order (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``...). unimem's
snapshots use the same format, so :func:`from_snapshot` reads either.

On a machine with an NVIDIA GPU::

    python -m benchmarks.torch_traces record

runs two small workloads under PyTorch's caching allocator (a transformer
trained with AdamW, and generation with a growing sequence), and saves each
trace, small, in ``benchmarks/data/torch_<name>.json.gz`` with PyTorch's own
``max_memory_reserved()`` for the run. ``bench_memory`` replays every saved
trace and holds unimem to that figure.

The saved form is a list of integers: ``n > 0`` allocates ``n`` bytes (the
next key, counting from 1), ``-k`` frees the allocation with key ``k``.
Sizes are those in PyTorch's trace: the blocks it handed out (rounded to 512
bytes), not the bytes asked for.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
from typing import Any, Dict, List, Tuple

from .traces import Event

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def from_snapshot(snapshot: Dict[str, Any], device: int = 0) -> Tuple[List[Event], int]:
    """The allocation events of one device's trace, and the peak of the
    reserved memory the trace shows (segments allocated minus freed).

    A block counts as free at ``free_completed`` (when its stream uses are
    over and the allocator may reuse it). Frees of blocks allocated before
    the recording began (or dropped from a full ring buffer) are skipped.
    Calls to ``empty_cache()`` are not in the events: a replay keeps what
    the recorded run gave back (its peak can only be higher for it).
    """
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or not 0 <= device < len(traces):
        raise ValueError(f"the snapshot has no trace for device {device}")
    events: List[Event] = []
    live: Dict[int, int] = {}          # address -> key
    allocations = 0
    reserved = peak_reserved = 0
    for entry in traces[device]:
        action, addr, size = entry["action"], int(entry["addr"]), int(entry["size"])
        if action == "alloc":
            allocations += 1
            live[addr] = allocations
            events.append(("alloc", allocations, size))
        elif action == "free_completed":
            key = live.pop(addr, 0)
            if key:
                events.append(("free", key))
        elif action == "segment_alloc":
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif action == "segment_free":
            reserved -= size
    return close_live(events), peak_reserved


def close_live(events: List[Event]) -> List[Event]:
    """The trace with a free at its end for every block still live there (the
    model and optimizer state of the recorded run), so that a replay ends
    with nothing allocated."""
    live = {event[1] for event in events if event[0] == "alloc"}
    live.difference_update(event[1] for event in events if event[0] == "free")
    return events + [("free", key) for key in sorted(live)]


def encode(events: List[Event]) -> List[int]:
    """Events as integers (see the module's docstring). Keys must count up from 1."""
    out: List[int] = []
    expected = 1
    for event in events:
        if event[0] == "alloc":
            if event[1] != expected:
                raise ValueError(f"allocation keys must count up from 1; got {event[1]}, expected {expected}")
            expected += 1
            out.append(int(event[2]))              # type: ignore[misc]
        else:
            out.append(-int(event[1]))
    return out


def decode(numbers: List[int]) -> List[Event]:
    events: List[Event] = []
    key = 0
    for n in numbers:
        if n > 0:
            key += 1
            events.append(("alloc", key, n))
        elif n < 0:
            events.append(("free", -n))
        else:
            raise ValueError("0 is not an event")
    return events


def save(path: str, name: str, events: List[Event], reserved_peak: int, **about: Any) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(dict(about, name=name, reserved_peak=int(reserved_peak), events=encode(events)), f)


def load(path: str) -> Dict[str, Any]:
    """A saved trace: ``name``, ``reserved_peak`` (PyTorch's) and ``events``."""
    with gzip.open(path, "rt") as f:
        saved = json.load(f)
    saved["events"] = decode(saved["events"])
    return saved


def saved_traces(data_dir: str = DATA_DIR) -> List[Dict[str, Any]]:
    if not os.path.isdir(data_dir):
        return []
    return [load(os.path.join(data_dir, name)) for name in sorted(os.listdir(data_dir))
            if name.startswith("torch_") and name.endswith(".json.gz")]


# ---------------------------------------------------------------------------
# recording (needs PyTorch with CUDA)
# ---------------------------------------------------------------------------
def _transformer_training(torch: Any, steps: int) -> None:
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True),
        num_layers=6).cuda()
    head = torch.nn.Linear(512, 8000).cuda()
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-4)
    for step in range(steps):
        x = torch.randn(16, 256, 512, device="cuda")
        target = torch.randint(0, 8000, (16, 256), device="cuda")
        loss = torch.nn.functional.cross_entropy(head(model(x)).flatten(0, 1), target.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _growing_generation(torch: Any, steps: int) -> None:
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True),
        num_layers=6).cuda().eval()
    with torch.no_grad():
        sequence = torch.randn(8, 64, 512, device="cuda")
        for _ in range(steps * 40):
            out = model(sequence)
            sequence = torch.cat([sequence, out[:, -1:]], dim=1)       # one token longer each time


WORKLOADS = {"transformer_training": _transformer_training, "growing_generation": _growing_generation}


def record(data_dir: str = DATA_DIR, steps: int = 5) -> List[str]:
    """Run each workload under PyTorch's allocator with its memory history
    on, and save the trace with PyTorch's reserved peak."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("recording PyTorch's traces needs PyTorch with CUDA and a GPU")
    os.makedirs(data_dir, exist_ok=True)
    paths = []
    for name, workload in WORKLOADS.items():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        workload(torch, steps)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events, trace_peak = from_snapshot(snapshot, torch.cuda.current_device())
        path = os.path.join(data_dir, f"torch_{name}.json.gz")
        save(path, name, events, torch.cuda.max_memory_reserved(), trace_reserved_peak=trace_peak,
             torch_version=torch.__version__, gpu=torch.cuda.get_device_name())
        print(f"{name}: {len(events)} events, PyTorch reserved peak "
              f"{torch.cuda.max_memory_reserved() / 2**20:.0f} MiB -> {path}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="record PyTorch allocation traces (needs a GPU)")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("--steps", type=int, default=5)
    record(steps=parser.parse_args().steps)
