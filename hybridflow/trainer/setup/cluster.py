"""Ray for a command's run, written once for every command (``train``, ``sft``/``dpo``/``rm``, ``serve``): a local
cluster sized for the run's ranks, or a joined one checked to hold them, each check a ConfigError naming its key.

``settings`` is the section that says where the workers run (``trainer`` for the trainers, ``worker`` for the
service): its ``ray_address``, ``ray_num_cpus``, ``nnodes``, ``cpus_per_worker`` and ``device``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import ray
import torch

from hybridflow.controller import ray_session
from hybridflow.trainer.setup.config import ConfigError
from hybridflow.trainer.setup.placement import Placement


class ClusterSettings(Protocol):
    ray_address: str
    ray_num_cpus: int
    nnodes: int
    cpus_per_worker: float
    device: str


def _check(condition: bool, key: str, problem: str, fix: str = "") -> None:
    if not condition:
        raise ConfigError(key, problem, fix)


def local_cluster_cpus(settings: ClusterSettings, placement: Placement) -> int:
    """Logical CPUs of the local Ray cluster: ``ray_num_cpus``, or (0) the machine's cores raised to what the workers
    of every pool reserve (threads per worker bound the real CPU use, so a small machine may host more ranks than it
    has cores)."""
    reserved = math.ceil(placement.processes * settings.cpus_per_worker)
    return settings.ray_num_cpus or max(os.cpu_count() or 1, reserved)


def check_local_cluster(settings: ClusterSettings, plan: Placement, section: str = "trainer") -> None:
    """A local Ray cluster is this one machine: the workers must fit on it (a joined cluster: check_cluster)."""
    _check(
        settings.nnodes == 1,
        f"{section}.nnodes",
        f"{settings.nnodes} nodes asked for, but a local Ray cluster is this one machine",
        f"set {section}.nnodes=1, or join a cluster of that many nodes with {section}.ray_address",
    )
    for name, nodes in plan.pools.items():
        _check(
            len(nodes) == 1,
            f"{section}.resource_pool_spec.{name}",
            f"pool '{name}' spans {len(nodes)} nodes, but a local Ray cluster is this one machine",
            f"give one process count per pool, e.g. [2], or join a cluster with {section}.ray_address",
        )
    cores = os.cpu_count() or 1
    _check(
        settings.cpus_per_worker <= (settings.ray_num_cpus or cores),
        f"{section}.cpus_per_worker",
        f"each rank asks for {settings.cpus_per_worker} CPUs, but this machine has {cores} cores"
        + (f" and {section}.ray_num_cpus={settings.ray_num_cpus}" if settings.ray_num_cpus else ""),
        f"set {section}.cpus_per_worker to at most {settings.ray_num_cpus or cores}",
    )
    reserved = plan.processes * settings.cpus_per_worker
    _check(
        reserved <= local_cluster_cpus(settings, plan),
        f"{section}.ray_num_cpus",
        f"{plan.processes} ranks in pools {plan.pools} x {settings.cpus_per_worker} CPUs = {reserved} do not fit "
        f"in {settings.ray_num_cpus}",
        f"raise {section}.ray_num_cpus, or set it to 0 (sized to the workers)",
    )
    if settings.device == "cuda":
        gpus = torch.cuda.device_count()
        _check(
            plan.processes <= gpus,
            f"{section}.placement",
            f"the pools {plan.pools} hold {plan.processes} ranks that need a GPU each; {gpus} are visible",
            f"use at most {gpus} ranks over all pools (fewer per pool, or colocate roles)",
        )


def pool_processes_per_node(plan: Placement) -> list[int]:
    """Processes on node i summed over the pools (a pool's i-th entry is on the cluster's i-th node)."""
    width = max(len(nodes) for nodes in plan.pools.values())
    return [sum(nodes[i] for nodes in plan.pools.values() if i < len(nodes)) for i in range(width)]


def check_cluster(settings: ClusterSettings, placement: Placement, section: str = "trainer") -> None:
    """After joining a Ray cluster (``ray_address``): enough live nodes, each able to hold one node's share of ranks,
    so a bad request fails now rather than after the placement timeout."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    _check(
        len(nodes) >= settings.nnodes,
        f"{section}.nnodes",
        f"{settings.nnodes} nodes asked for; the Ray cluster at {settings.ray_address} has {len(nodes)}",
        f"set {section}.nnodes to at most {len(nodes)}, or add nodes to the cluster",
    )
    per_node = pool_processes_per_node(placement)
    busiest = max(per_node)
    need_cpus = busiest * settings.cpus_per_worker
    need_gpus = busiest if settings.device == "cuda" else 0
    fitting = [r for r in nodes if r.get("CPU", 0) >= need_cpus and r.get("GPU", 0) >= need_gpus]
    _check(
        len(fitting) >= len(per_node),
        f"{section}.cpus_per_worker",
        f"each of {len(per_node)} nodes must hold up to {busiest} ranks (all pools) x {settings.cpus_per_worker} CPUs"
        + (f" and {need_gpus} GPUs" if need_gpus else "")
        + f"; the cluster's nodes have {[(r.get('CPU', 0), r.get('GPU', 0)) for r in nodes]} (CPUs, GPUs)",
        f"lower {section}.cpus_per_worker or the workers per node",
    )


@contextmanager
def ray_for_run(settings: ClusterSettings, placement: Placement, section: str = "trainer") -> Iterator[None]:
    """Ray while the block runs: the cluster at ``ray_address`` (checked to hold ``placement``'s ranks), or a local
    one sized for them, shut down when the block ends (``check_local_cluster`` checks it before, with the config)."""
    joined = settings.ray_address
    with ray_session(joined or None, None if joined else local_cluster_cpus(settings, placement)):
        if joined:
            check_cluster(settings, placement, section)
        yield
