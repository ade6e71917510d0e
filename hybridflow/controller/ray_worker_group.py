"""Worker groups on Ray: one Ray actor per rank, hosting one or several (colocated) roles.

Each rank's actor is a ``WorkerHost``. It joins the group's torch.distributed process group,
then builds the role objects it hosts. Colocated roles share that process (and its process
group): the actor and the reference model can share memory, and the driver reaches each role
through its own ``RayWorkerGroup`` view.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.decorator import MeshCoord, registered_methods
from hybridflow.controller.errors import WorkerError, WorkerLost
from hybridflow.controller.fresh_process import FreshProcessState
from hybridflow.controller.kept_processes import keeper
from hybridflow.controller.resource_pool import RayResourcePool
from hybridflow.controller.worker import DistEnv, Worker, init_distributed, open_store
from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.library_output import quiet_this_process, verbose
from hybridflow.protocol import DataProto, materialize


@dataclass
class RoleSpec:
    """A worker class with the arguments its constructor takes on every rank."""

    cls: type[Worker]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.cls, type) and issubclass(self.cls, Worker)):
            raise TypeError(f"a role's class must subclass hybridflow.controller.Worker, got {self.cls!r}")


CPU = torch.device("cpu")


def on_device(value: Any, device: torch.device) -> Any:
    """A DataProto with its tensors on ``device`` (a new DataProto, the caller's untouched; its arrays and meta_info
    shared); any other value as it is."""
    if not isinstance(value, DataProto) or value.batch is None:
        return value
    if all(tensor.device == device for tensor in value.batch.values(include_nested=True, leaves_only=True)):
        return value
    return dataclasses.replace(value, batch=value.batch.to(device))


class _HostedError(Exception):
    """An exception raised inside a hosted role, with its traceback rendered as text on the worker."""

    def __init__(self, cause: BaseException, rendered: str):
        try:
            pickle.dumps(cause)
        except Exception:
            cause = RuntimeError(f"{type(cause).__name__}: {cause}")
        super().__init__(cause, rendered)
        self.cause = cause
        self.rendered = rendered

    def __str__(self) -> str:
        return f"{type(self.cause).__name__}: {self.cause}"


class WorkerHost:
    """The process of one rank: the distributed environment plus the role objects it hosts. A driver that keeps
    worker processes (kept_processes.py) resets it after a run and sets it up again for the next one."""

    def __init__(self):
        if not verbose():  # the driver's --debug reaches a worker as HYBRIDFLOW_DEBUG (library_output.quiet_env)
            quiet_this_process()
        self.roles: dict[str, Worker] = {}
        self.methods: dict[str, set[str]] = {}
        self.spans: list[tuple[str, str, float, float]] = []  # (role, method, start, end), wall-clock seconds
        self.store = None  # rank 0's rendezvous store, from open_store until setup
        self.fresh = FreshProcessState.now()
        # the rank's compute device: DataProto arguments arrive there and results leave on the CPU (Ray moves
        # host memory; a driver need not have a GPU)
        self.device = CPU

    def node_address(self) -> tuple[str, str]:
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def open_store(self, world_size: int) -> int:
        """As rank 0: open the group's rendezvous store; returns its port."""
        self.store = open_store(ray.util.get_node_ip_address(), world_size)
        return self.store.port

    def setup(self, specs: dict[str, RoleSpec], env: DistEnv, num_threads: int) -> int:
        building = None
        try:
            self.methods = {name: set(registered_methods(spec.cls)) for name, spec in specs.items()}
            torch.set_num_threads(num_threads)
            store, self.store = self.store, None
            init_distributed(env, store=store)
            self.device = torch.device("cuda", torch.cuda.current_device()) if env.device == "cuda" else CPU
            for building, spec in specs.items():
                self.roles[building] = spec.cls(*spec.args, **spec.kwargs)
        except BaseException as error:
            where = f"while building role '{building}' of this process:\n" if building else ""
            raise _HostedError(error, where + traceback.format_exc()) from error
        return os.getpid()

    def call(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        if method not in self.methods.get(role, ()):
            raise AttributeError(f"role '{role}' has no @register'ed method '{method}'")
        try:
            # waiting for another group's output is not this call's work
            args = tuple(on_device(materialize(a), self.device) for a in args)
            kwargs = {k: on_device(materialize(v), self.device) for k, v in kwargs.items()}
            start = time.time()
            result = getattr(self.roles[role], method)(*args, **kwargs)
            self.spans.append((role, method, start, time.time()))
            return on_device(result, CPU)
        except BaseException as error:
            raise _HostedError(error, traceback.format_exc()) from error

    def take_spans(self) -> list[tuple[str, str, float, float]]:
        """The (role, method, start, end) of every call since the last take, and forget them."""
        spans, self.spans = self.spans, []
        return spans

    def mesh_coord(self, role: str, mesh_name: str) -> MeshCoord:
        return self.roles[role].dispatch_mesh(mesh_name)

    def reset(self) -> str | None:
        """Drop the roles, leave the process group and restore what a new process starts with, for a next run;
        returns why this process cannot serve as a new one (None: it can; see ``FreshProcessState.restore``)."""
        self.roles, self.methods, self.spans = {}, {}, []
        return self.fresh.restore()


_RemoteHost = ray.remote(WorkerHost)


def _wait_all(group: str, method: str, futures: list, ranks: list[int]) -> list:
    """ray.get that fails fast: the first rank to raise ends the wait, even while peers block in a collective."""
    rank_of = {ref: rank for ref, rank in zip(futures, ranks)}
    pending = list(futures)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                ray.get(ref)
            except RayTaskError as error:
                cause = error.cause
                if isinstance(cause, _HostedError):
                    raise WorkerError(group, method, rank_of[ref], cause.cause, cause.rendered) from cause.cause
                raise WorkerError(group, method, rank_of[ref], cause or error, str(error)) from error
            except (RayActorError, WorkerCrashedError, OutOfMemoryError, NodeDiedError) as error:
                raise WorkerLost(group, method, rank_of[ref], error, str(error)) from error
    return ray.get(list(futures))


def spawn_hosts(pool: RayResourcePool, specs: dict[str, RoleSpec], group_name: str) -> list:
    """One WorkerHost actor per rank of ``pool``, joined into one torch.distributed group."""
    hosts = pool.take_spare_hosts() or _start_hosts(pool)
    addresses = ray.get([h.node_address.remote() for h in hosts])
    master_addr, _ = addresses[0]
    master_port = ray.get(hosts[0].open_store.remote(len(hosts)))
    local_ranks, seen = [], {}
    for _, node in addresses:
        local_ranks.append(seen.get(node, 0))
        seen[node] = local_ranks[-1] + 1
    device = "cuda" if pool.use_gpu else "cpu"
    envs = [
        DistEnv(
            rank=rank,
            world_size=len(hosts),
            local_rank=local_ranks[rank],
            master_addr=master_addr,
            master_port=master_port,
            device=device,
        )
        for rank in range(len(hosts))
    ]
    ranks = list(range(len(hosts)))
    setups = [h.setup.remote(specs, env, pool.threads_per_worker) for h, env in zip(hosts, envs)]
    _wait_all(group_name, "__init__", setups, ranks)
    pool.host_sets.append(hosts)
    return hosts


def _start_hosts(pool: RayResourcePool) -> list:
    keeper.count_started(pool.world_size)
    resources = pool.actor_resources
    environment = {"runtime_env": {"env_vars": pool.worker_env}} if pool.worker_env else {}  # merged with the job's
    return [
        _RemoteHost.options(
            num_cpus=resources["num_cpus"],
            num_gpus=resources["num_gpus"],
            **environment,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
        ).remote()
        for pg, index in pool.placements()
    ]


class RayWorkerGroup(WorkerGroup):
    """A worker group of one role, one Ray actor per rank of the resource pool."""

    def __init__(self, resource_pool: RayResourcePool, spec: RoleSpec, name: str | None = None):
        name = name or spec.cls.__name__
        self._attach(spawn_hosts(resource_pool, {name: spec}, name), name, spec.cls)

    @classmethod
    def colocated(
        cls, resource_pool: RayResourcePool, specs: dict[str, RoleSpec], name: str = "colocated"
    ) -> dict[str, RayWorkerGroup]:
        """Several roles fused into one process per rank; returns one group view per role."""
        if not specs:
            raise ValueError("colocated() needs at least one role")
        hosts = spawn_hosts(resource_pool, specs, name)
        groups = {}
        for role, spec in specs.items():
            group = cls.__new__(cls)
            group._attach(hosts, role, spec.cls)
            groups[role] = group
        return groups

    def _attach(self, hosts: list, role: str, worker_cls: type) -> None:
        self.hosts = hosts
        self.role = role
        self._bind_methods(role, worker_cls, len(hosts))

    def _execute(self, rank: int, method_name: str, args: tuple, kwargs: dict) -> Any:
        return self.hosts[rank].call.remote(self.role, method_name, args, kwargs)

    def _wait(self, method_name: str, futures: list, ranks: list[int]) -> list:
        return _wait_all(self.name, method_name, futures, ranks)

    def _fetch_mesh(self, mesh_name: str) -> list[MeshCoord]:
        return ray.get([h.mesh_coord.remote(self.role, mesh_name) for h in self.hosts])

    def take_spans(self) -> list[list[tuple[str, str, float, float]]]:
        """Per rank, the (role, method, start, end) of the calls its process ran since the last take
        (every role it hosts: colocated groups share the processes)."""
        return ray.get([host.take_spans.remote() for host in self.hosts])

    def kill(self) -> None:
        for host in self.hosts:
            ray.kill(host)
