"""PyTorch's own ``torch.cuda.memory_summary`` table of any statistics, on a
machine without a GPU: its formatting code runs on a stats dict given to it
in place of the CUDA allocator's. It fails, never skips, where PyTorch's code
no longer reads the statistics this way (torch is in the test extra)."""
from typing import Any, List, Mapping

import pytest
import torch
import torch.cuda.memory as torch_cuda_memory


def pytorch_memory_summary(stats: Mapping[str, Any], abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary(0, abbreviated)`` of ``stats`` (a full
    ``memory_stats`` dict: PyTorch reads every key of its table)."""
    assert torch.cuda.memory_summary is torch_cuda_memory.memory_summary, (
        "torch.cuda.memory_summary is no longer torch.cuda.memory's: patch where it reads its statistics")
    asked: List[Any] = []

    def memory_stats(device: Any = None) -> Mapping[str, Any]:
        asked.append(device)
        return stats

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_cuda_memory, "memory_stats", memory_stats)
        table = torch.cuda.memory_summary(0, abbreviated=abbreviated)
    assert asked == [0], (f"torch.cuda.memory_summary did not read torch.cuda.memory.memory_stats(device=0) "
                          f"(asked: {asked}): PyTorch's internals changed; this table is not of the given stats")
    assert "PyTorch CUDA memory summary, device ID 0" in table, table
    return table
