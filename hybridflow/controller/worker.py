"""The base class of a role: one SPMD process of a worker group."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.controller.decorator import MeshCoord


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """The torch.distributed environment of one rank, as a worker group assigns it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device: str  # cpu (gloo) | cuda (nccl)

    def to_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "HYBRIDFLOW_DEVICE": self.device,
        }

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read the environment a worker group (or torchrun) set; a lone process is rank 0 of 1."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)) or free_port(),
            device=env.get("HYBRIDFLOW_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"),
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def open_store(host: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on a port the system picks as it binds: a port chosen first and
    bound later can be taken in between by another process (seen as EADDRINUSE with many runs on one machine)."""
    return dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def init_distributed(env: DistEnv, timeout_s: float = 600.0, store: dist.Store | None = None) -> None:
    """Join the process group (gloo for CPU tensors, plus nccl for CUDA tensors on a GPU). ``store``: rank 0's
    (``open_store``) on rank 0; without it the ranks meet at ``env.master_addr:master_port`` (rank 0 listens)."""
    os.environ.update(env.to_environ())
    if dist.is_initialized():
        return
    if env.device == "cuda":
        torch.cuda.set_device(env.local_rank if torch.cuda.device_count() > env.local_rank else 0)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0, timeout=timeout
        )
    dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


class Worker:
    """Base class of a role's worker. The group sets up rank, world size and torch.distributed.

    Subclasses expose methods to the driver with ``@register``. A worker that shards its work
    over a device mesh declares it with ``register_dispatch_mesh`` so that mesh-aware dispatch
    knows which data-parallel chunk each rank takes.
    """

    def __init__(self) -> None:
        env = DistEnv.from_environ()
        if not dist.is_initialized():
            init_distributed(env)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = env.local_rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if env.device == "cuda" else torch.device("cpu")
        self._dispatch_meshes: dict[str, MeshCoord] = {}

    def register_dispatch_mesh(
        self, name: str, mesh: torch.distributed.device_mesh.DeviceMesh, dp_dim: str = "dp"
    ) -> MeshCoord:
        """Declare this rank's place in ``mesh`` for ``mesh_compute_proto(name)`` dispatch.

        The rank's chunk is chosen by its coordinate along ``dp_dim``; the rank whose other
        coordinates are all 0 is the one collected for its data-parallel group.
        """
        names = mesh.mesh_dim_names or ()
        if dp_dim not in names:
            raise ValueError(f"mesh has dimensions {names}, none named '{dp_dim}'")
        others = [d for d in names if d != dp_dim]
        coord = MeshCoord(
            dp_rank=mesh.get_local_rank(dp_dim),
            dp_size=mesh.size(names.index(dp_dim)),
            is_collector=all(mesh.get_local_rank(d) == 0 for d in others),
        )
        self._dispatch_meshes[name] = coord
        return coord

    def dispatch_mesh(self, name: str) -> MeshCoord:
        if name not in self._dispatch_meshes:
            raise ValueError(
                f"{type(self).__name__} declared no dispatch mesh '{name}'; call "
                f"self.register_dispatch_mesh('{name}', mesh) in __init__ (declared: {sorted(self._dispatch_meshes)})"
            )
        return self._dispatch_meshes[name]
