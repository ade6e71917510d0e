"""Peak memory of a worker process, for the step metrics."""

from __future__ import annotations

import resource

import torch


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: the peak allocated since the last reset. CPU: the process's peak resident set (monotone)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
