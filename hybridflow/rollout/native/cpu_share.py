"""Torch threads that follow the cores other processes leave free, while the engine generates.

torch splits each op evenly over its threads and waits for the slowest. A thread whose core another busy
process also wants runs at half speed and is descheduled for whole time slices, and every one of the
hundreds of ops in a decode step waits for it: with one of this machine's two cores kept busy, the engine
generated 3.8x slower on 2 threads than idle, but only 1.6x slower on 1 thread (bench/rollout.py --workloads
64x64 --backends native --busy-cores 1, with --threads 2 and 1; docs/results.md). So while generating,
`ThreadGovernor.tick` looks every `interval_s` at how much CPU the other processes took since its last look
(/proc/stat's busy time of all CPUs less this process's own) and sets torch to the cores left, between 1 and
the thread count it started with, which it restores at the end. On this machine the engine's tokens and
log-probs are bitwise the same on 1 and 2 threads (checked with smollm2 in bf16, sampled), so following the
free cores changes the speed, not the samples; `rollout.native.follow_free_cores=false` keeps the threads fixed.
"""

from __future__ import annotations

import os
import time

import torch

from hybridflow.procfs import machine_busy_s, own_cpu_s


def threads_for(others_cores: float, cores: int, max_threads: int) -> int:
    """Threads for the cores the other processes leave (``others_cores``: how many cores' worth of CPU they
    used), rounded to the nearest core, between 1 and ``max_threads``."""
    return max(1, min(max_threads, int(cores - others_cores + 0.5)))


class ThreadGovernor:
    """Sets torch's intra-op threads to the free cores every ``interval_s`` of a generation (see the module
    docstring); `restore` puts back the thread count it started with."""

    def __init__(self, enabled: bool = True, interval_s: float = 0.5):
        self.max_threads = torch.get_num_threads()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.interval_s = interval_s
        self.enabled = enabled and self.max_threads > 1 and machine_busy_s() is not None
        self.threads = self.max_threads
        self._mark = self._sample() if self.enabled else None

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        return time.monotonic(), machine_busy_s() or 0.0, own_cpu_s()

    def others_cores(self) -> float | None:
        """Cores' worth of CPU the other processes used since the last look (None before `interval_s` passed);
        the look becomes the new mark."""
        now = self._sample()
        wall = now[0] - self._mark[0]
        if wall < self.interval_s:
            return None
        others = max(0.0, (now[1] - self._mark[1]) - (now[2] - self._mark[2])) / wall
        self._mark = now
        return others

    def tick(self) -> None:
        if not self.enabled:
            return
        others = self.others_cores()
        if others is None:
            return
        threads = threads_for(others, self.cores, self.max_threads)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def restore(self) -> None:
        if self.enabled and self.threads != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self.threads = self.max_threads
