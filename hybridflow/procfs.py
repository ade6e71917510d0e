"""This process's memory as the Linux kernel counts it (``/proc/self/status``), for metrics."""

from __future__ import annotations

import resource
from pathlib import Path

STATUS = Path("/proc/self/status")


def status_gb(field: str) -> float | None:
    """A memory line of /proc/self/status (``VmRSS``, ``VmHWM``, ...) in GiB; None where there is none."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return None


def resident_gb() -> float:
    """The resident set now (VmRSS); the peak since start where /proc is missing."""
    current = status_gb("VmRSS")
    return current if current is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
