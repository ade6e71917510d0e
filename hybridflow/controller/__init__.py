"""The single-controller runtime: workers, worker groups, dispatch, resource pools, Ray."""

from hybridflow.controller.decorator import (
    CollectSpec,
    Dispatch,
    DispatchMode,
    DispatchPlan,
    Execute,
    GroupLayout,
    MeshCoord,
    get_dispatch_mode,
    mesh_compute_proto,
    register,
    register_dispatch_mode,
    split_protos,
)
from hybridflow.controller.errors import WorkerError, WorkerLost
from hybridflow.controller.kept_processes import (
    keep_worker_processes,
    kept_placement_groups,
    kept_process_counts,
    stop_keeping_worker_processes,
)
from hybridflow.controller.ray_runtime import ray_session, start_ray
from hybridflow.controller.ray_worker_group import RayWorkerGroup, RoleSpec
from hybridflow.controller.resource_pool import RayResourcePool, ResourcePool, ResourcePoolManager, Role
from hybridflow.controller.worker import DistEnv, Worker
from hybridflow.controller.worker_group import GroupFuture, WorkerGroup

__all__ = [
    "CollectSpec",
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "DistEnv",
    "Execute",
    "GroupFuture",
    "GroupLayout",
    "MeshCoord",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePool",
    "ResourcePoolManager",
    "Role",
    "RoleSpec",
    "Worker",
    "WorkerError",
    "WorkerLost",
    "WorkerGroup",
    "get_dispatch_mode",
    "keep_worker_processes",
    "kept_placement_groups",
    "kept_process_counts",
    "mesh_compute_proto",
    "ray_session",
    "register",
    "register_dispatch_mode",
    "split_protos",
    "start_ray",
    "stop_keeping_worker_processes",
]
