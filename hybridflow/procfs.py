"""What the Linux kernel counts (``/proc``): this process's memory, for metrics, and CPU time, this process's and
the machine's, for sharing the cores."""

from __future__ import annotations

import os
import resource
from pathlib import Path

STATUS = Path("/proc/self/status")
PROC_STAT = Path("/proc/stat")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


def machine_busy_s() -> float | None:
    """CPU seconds every process together has kept the CPUs busy since boot (user, nice, system, irq, softirq,
    steal; guest time is already inside user and nice); None without /proc."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields)
    return (user + nice + system + irq + softirq + steal) / TICKS_PER_S


def own_cpu_s() -> float:
    """CPU seconds of this process, all its threads."""
    times = os.times()
    return times.user + times.system
