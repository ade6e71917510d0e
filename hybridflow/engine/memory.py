"""Peak memory of a worker process, for the step metrics."""

from __future__ import annotations

import resource
from pathlib import Path

import torch

from hybridflow.procfs import status_gb

_CLEAR_REFS = Path("/proc/self/clear_refs")


def _resident_peak_gb() -> float:
    """The process's peak resident set since the last reset (Linux VmHWM), else since it started."""
    peak = status_gb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: the peak allocated since the last reset. CPU: the peak resident set since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _resident_peak_gb()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak. On CPU the kernel resets the peak resident set to the current one ("5" to clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # an older kernel or a sandbox: the peak then counts from the process's start
