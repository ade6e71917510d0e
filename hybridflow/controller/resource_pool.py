"""Resource pools: where a worker group's ranks run.

A pool is a list of processes per node. On Ray each node's share is one placement group of
bundles (``{"CPU": c}`` or ``{"CPU": c, "GPU": 1}``), packed on one node; rank r runs in bundle r.
Several worker groups may share a pool: each actor takes ``1 / max_colocate_count`` of its bundle.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from hybridflow.controller.kept_processes import KeptPool, keeper

GIVE_WAY_AFTER_S = 1.0  # a pool not placed by then has kept processes end, one pool at a time, until it is


class _Roles(type):
    def __iter__(cls) -> Iterator[Role]:
        return iter(list(cls._known.values()))


class Role(str, metaclass=_Roles):
    """A model role of an RL dataflow: the one vocabulary for them. A role is its name, the name its worker group goes
    by (in errors, in a colocated process, in the trainer's ``RoleGroups``). The built-in roles are this class's
    attributes; ``Role.register(name)`` adds one (its part says the rest: trainer/setup/role_parts.py), and
    ``Role(name)`` is a known role or a ValueError naming the known ones. Iterating the class gives them in order."""

    _known: ClassVar[dict[str, Role]] = {}
    ActorRollout: ClassVar[Role]
    RefPolicy: ClassVar[Role]
    Critic: ClassVar[Role]
    RewardModel: ClassVar[Role]
    Rollout: ClassVar[Role]
    Teacher: ClassVar[Role]

    def __new__(cls, name: str) -> Role:
        role = cls._known.get(name)
        if role is None:
            raise ValueError(f"unknown role {name!r}; known: {', '.join(cls._known)}")
        return role

    @classmethod
    def register(cls, name: str) -> Role:
        """The role ``name``, added if it is new (registering a known name gives that role)."""
        if name not in cls._known:
            if not name or not name.isidentifier():
                raise ValueError(f"a role's name is a Python identifier (a group's name), got {name!r}")
            cls._known[name] = str.__new__(cls, name)
        return cls._known[name]

    @property
    def value(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Role({str(self)!r})"

    def __reduce__(self) -> tuple:  # a worker process may not have registered it: it is registered there too
        return (Role.register, (str(self),))


Role.ActorRollout = Role.register("actor_rollout")
Role.RefPolicy = Role.register("ref")
Role.Critic = Role.register("critic")
Role.RewardModel = Role.register("reward_model")
Role.Rollout = Role.register("rollout")  # generation on a pool of its own (asynchronous training); else the actor's
Role.Teacher = Role.register("teacher")  # on-policy distillation: a frozen model scoring the policy's samples


class ResourcePool:
    """Processes per node, independent of any backend."""

    def __init__(self, process_on_nodes: list[int], *, use_gpu: bool = False, max_colocate_count: int = 1):
        if not process_on_nodes or any(n <= 0 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must list a positive process count per node, got {process_on_nodes}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be at least 1, got {max_colocate_count}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)


class RayResourcePool(ResourcePool):
    def __init__(
        self,
        process_on_nodes: list[int],
        *,
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        cpus_per_worker: float = 1.0,
        name: str = "pool",
        ready_timeout_s: float = 60.0,
        threads_per_worker: int | None = None,
        worker_env: dict[str, str] | None = None,
    ):
        super().__init__(process_on_nodes, use_gpu=use_gpu, max_colocate_count=max_colocate_count)
        self.cpus_per_worker = cpus_per_worker
        # environment variables of this pool's worker processes, on top of those the cluster gives every worker
        self.worker_env = dict(worker_env or {})
        self.threads_per_worker = threads_per_worker or max(1, int(cpus_per_worker))
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self._placement_groups: list[PlacementGroup] | None = None
        self.host_sets: list[list] = []  # the processes of each worker group placed here, in rank order
        self._spare_host_sets: list[list] = []  # kept processes of an earlier run, waiting for a worker group

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, **({"GPU": 1.0} if self.use_gpu else {})}

    @property
    def actor_resources(self) -> dict[str, float]:
        """What one actor asks of its bundle, so that ``max_colocate_count`` actors fit in it."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_worker * share, "num_gpus": share if self.use_gpu else 0.0}

    @property
    def shape(self) -> tuple:
        """What a kept process must match to serve this pool (kept_processes.py). The environment is the one its
        processes get: the job's variables with the pool's on top, so that a pool asking for values the cluster
        already gives is served by the processes of one that asks for nothing."""
        job_env = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        return (
            tuple(self.process_on_nodes),
            self.use_gpu,
            self.cpus_per_worker,
            self.max_colocate_count,
            self.threads_per_worker,
            tuple(sorted({**job_env, **self.worker_env}.items())),
        )

    def take_spare_hosts(self) -> list | None:
        """Processes of an earlier run kept for this pool's shape (one per rank, already placed), or None."""
        self.placement_groups()
        return self._spare_host_sets.pop(0) if self._spare_host_sets else None

    def placement_groups(self) -> list[PlacementGroup]:
        if self._placement_groups is None and keeper.keeping() and (kept := keeper.take(self.shape)) is not None:
            self._placement_groups, self._spare_host_sets = kept.placement_groups, kept.host_sets
        if self._placement_groups is None:
            keeper.make_room(self.cpus_per_worker * self.world_size, float(self.world_size) if self.use_gpu else 0.0)
            groups = [
                placement_group(
                    [self.bundle] * count, strategy="STRICT_PACK", name=f"{self.name}_{uuid.uuid4().hex[:8]}_node{i}"
                )
                for i, count in enumerate(self.process_on_nodes)
            ]
            if not self._wait_placed(groups):
                for g in groups:
                    ray.util.remove_placement_group(g)
                raise RuntimeError(
                    f"resource pool '{self.name}' needs {self.process_on_nodes} processes per node, each "
                    f"{self.bundle}, but the Ray cluster ({ray.available_resources()}) could not place them in "
                    f"{self.ready_timeout_s:.0f}s; lower the worker count per node, or start Ray with more CPUs/GPUs"
                )
            self._placement_groups = groups
        return self._placement_groups

    def _wait_placed(self, groups: list[PlacementGroup]) -> bool:
        """Whether ``groups`` are placed within the pool's timeout. Kept processes (kept_processes.py) hold CPUs
        that the cluster's view of free resources may not show yet: while the groups wait, they end one kept
        pool at a time."""
        waiting = [g.ready() for g in groups]
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=min(left, GIVE_WAY_AFTER_S))
            if len(ready) == len(waiting):
                return True
            if time.monotonic() >= deadline:
                return False
            keeper.end_oldest()

    def placements(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) for every rank, in rank order."""
        return [(g, i) for g, count in zip(self.placement_groups(), self.process_on_nodes) for i in range(count)]

    def release(self, keep_processes: bool = True) -> None:
        """Give the placement groups back to the cluster; Ray ends the processes placed in them. When the driver
        keeps worker processes (``keep_worker_processes``) and ``keep_processes``, they are reset and kept for
        the next pool of this shape instead; pass False after a failure. After ``ray.shutdown()`` there is nothing
        to give back (the cluster took its placement groups; Ray's call would start a new cluster)."""
        groups, ran, spare = self._placement_groups, self.host_sets, self._spare_host_sets
        self._placement_groups, self.host_sets, self._spare_host_sets = None, [], []
        if groups is None or not ray.is_initialized():
            return
        if keep_processes and keeper.keeping() and keeper.park(KeptPool(self.shape, groups, ran + spare), fresh=ran):
            return
        for g in groups:
            ray.util.remove_placement_group(g)


@dataclass(kw_only=True)
class ResourcePoolManager:
    """Pools by name, and which pool each role runs in. Several roles may share one pool."""

    pool_spec: dict[str, list[int]]  # pool name -> processes per node
    role_to_pool: dict[Role, str]
    use_gpu: bool
    cpus_per_worker: float  # CPUs of each process's bundle
    max_colocate_count: int  # Ray actors that may share one bundle (one per role a pool hosts separately)
    pools: dict[str, RayResourcePool] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        unknown = {str(r): p for r, p in self.role_to_pool.items() if p not in self.pool_spec}
        if unknown:
            raise ValueError(f"roles {unknown} name pools that pool_spec does not define ({sorted(self.pool_spec)})")

    def create_pools(self) -> None:
        for name, nodes in self.pool_spec.items():
            self.pools[name] = RayResourcePool(
                nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=self.max_colocate_count,
                cpus_per_worker=self.cpus_per_worker,
                name=name,
            )

    def get_pool(self, role: Role) -> RayResourcePool:
        if role not in self.role_to_pool:
            raise KeyError(f"role {role} has no resource pool; assigned: {[str(r) for r in self.role_to_pool]}")
        if not self.pools:
            self.create_pools()
        return self.pools[self.role_to_pool[role]]
