"""Keeping a finished run's worker processes for the next run of the same driver (opt-in).

A worker process spends 4-6 CPU-seconds importing torch, Ray, FSDP2 and transformers before it
runs anything, several times what a tiny model's run costs. A driver that makes many short runs on
one Ray cluster (a test suite, a sweep in a notebook) can ask to keep them: when a pool is released
cleanly, each of its processes drops its roles, leaves its process group and returns to the state
a new process starts in (``WorkerHost.reset``), and the pool's placement groups wait here with them.
The next pool of the same shape (processes per node, resources per process, threads, environment)
takes them instead of starting new ones. A process that cannot be reset (an error, a hung
collective, vLLM's engine was started in it, a thread it started still runs) is ended as usual.

Kept processes hold their placement groups, and with them the cluster's CPUs: a pool that finds
none of its shape ends the oldest kept ones until the cluster has room for it. Nothing is kept
unless the driver calls ``keep_worker_processes``; ``stop_keeping_worker_processes`` ends them all.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup

RESET_TIMEOUT_S = 10.0  # a process that does not answer its reset in this time is ended (a hung collective)


@dataclass
class KeptPool:
    """A released pool's placement groups and, per worker group it held, that group's reset processes."""

    key: Hashable
    placement_groups: list[PlacementGroup]
    host_sets: list[list]

    @property
    def processes(self) -> int:
        return sum(len(hosts) for hosts in self.host_sets)

    def resource(self, name: str) -> float:
        """How much of ``name`` (CPU, GPU) the placement groups hold."""
        return sum(bundle.get(name, 0.0) for group in self.placement_groups for bundle in group.bundle_specs)

    def end(self) -> None:
        """Give the placement groups back; Ray ends the processes placed in them."""
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)


class WorkerProcessKeeper:
    """The driver's kept pools, oldest first, and counts of what happened to its processes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # pools may be placed and released from several threads at once
        self.max_processes = 0  # 0: keep nothing
        self.kept: list[KeptPool] = []  # oldest first
        self.cluster: str | None = None  # the Ray node the kept pools live on; another cluster's are gone
        # processes reused / kept / ended to make room or stay within the bound, and why others were not kept
        self.counts: Counter[str] = Counter()

    def current(self) -> list[KeptPool]:
        """The kept pools, forgotten (not ended: Ray ended them) when the driver is now on another cluster."""
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        if node != self.cluster:
            self.kept, self.cluster = [], node
        return self.kept

    def keeping(self) -> bool:
        """Whether pools keep and take processes now (a pool computes its shape only then)."""
        return self.max_processes > 0 and ray.is_initialized()

    def take(self, key: Hashable) -> KeptPool | None:
        """The oldest kept pool of shape ``key``, no longer kept (None: there is none). Call when ``keeping()``."""
        with self.lock:
            kept = self.current()
            for index, pool in enumerate(kept):
                if pool.key == key:
                    self.counts["reused"] += pool.processes
                    return kept.pop(index)
        return None

    def make_room(self, cpus: float, gpus: float) -> None:
        """End the oldest kept pools until the cluster's free resources, with theirs, fit a new pool's."""
        if not self.kept or not ray.is_initialized():
            return
        available = ray.available_resources()  # may lag behind: end_oldest is the fallback
        free_cpus, free_gpus = available.get("CPU", 0.0), available.get("GPU", 0.0)
        while free_cpus < cpus or free_gpus < gpus:
            ended = self.end_oldest()
            if ended is None:
                return
            free_cpus, free_gpus = free_cpus + ended.resource("CPU"), free_gpus + ended.resource("GPU")

    def end_oldest(self, why: str = "ended to make room") -> KeptPool | None:
        """End the kept pool kept longest (None: there is none)."""
        if not ray.is_initialized():
            return None
        with self.lock:
            kept = self.current()
            oldest = kept.pop(0) if kept else None
        if oldest is not None:
            self.counts[why] += oldest.processes
            oldest.end()
        return oldest

    def park(self, pool: KeptPool, fresh: list[list]) -> bool:
        """Reset the processes of ``fresh`` (worker groups that ran) and keep the pool with them and its spare
        ones; False (nothing kept, the caller ends them) when the pool is over the bound or a process did not reset.
        Call when ``keeping()``."""
        if not 0 < pool.processes <= self.max_processes:
            return False
        hosts = [host for group in fresh for host in group]
        replies = [host.reset.remote() for host in hosts]
        ready, _ = ray.wait(replies, num_returns=len(replies), timeout=RESET_TIMEOUT_S)
        if len(ready) < len(replies):
            self.counts[f"not kept: no answer to the reset in {RESET_TIMEOUT_S:.0f} s"] += len(hosts)
            return False
        try:
            reasons = [reason for reason in ray.get(replies) if reason]
        except Exception as error:  # a process that died or raised is not kept
            reasons = [f"the reset failed ({type(error).__name__})"]
        if reasons:
            self.counts[f"not kept: {reasons[0]}"] += len(hosts)
            return False
        self.counts["kept"] += pool.processes
        with self.lock:
            kept = self.current()
            ending = []
            while kept and sum(p.processes for p in kept) + pool.processes > self.max_processes:
                ending.append(kept.pop(0))
                self.counts["ended to stay within the bound"] += ending[-1].processes
            kept.append(pool)
        for old in ending:
            old.end()
        return True

    def count_started(self, processes: int) -> None:
        """Count processes started anew while keeping is on (beside those reused)."""
        if self.max_processes:
            self.counts["started"] += processes


keeper = WorkerProcessKeeper()


def keep_worker_processes(max_processes: int = 8) -> None:
    """From now on, a pool released cleanly keeps up to ``max_processes`` worker processes (all pools together,
    the newest kept) for the next pools of the same shape in this driver; 0 ends the kept ones and keeps none."""
    if max_processes < 0:
        raise ValueError(f"max_processes must be >= 0, got {max_processes}")
    keeper.max_processes = max_processes
    if not max_processes:
        stop_keeping_worker_processes()


def stop_keeping_worker_processes() -> None:
    """End every kept process (their placement groups go back to the cluster) and keep none from now on."""
    keeper.max_processes = 0
    while keeper.end_oldest("ended when keeping stopped") is not None:
        pass
    keeper.kept = []


def kept_placement_groups() -> list[PlacementGroup]:
    """The placement groups kept processes hold now (a run on a shared cluster leaves only these placed)."""
    return [group for pool in (keeper.current() if ray.is_initialized() else []) for group in pool.placement_groups]


def kept_process_counts() -> dict[str, int]:
    """Since the driver started: processes reused, kept, ended to make room or stay within the bound, and
    those not kept by reason (threads still running, vLLM imported, ...)."""
    return dict(keeper.counts)
