"""The single-controller runtime in one page: data-parallel regression over SPMD workers on Ray.

Run: `make demo` (or `.venv/bin/python examples/runtime_demo.py`).

The driver holds the loop as plain Python; a worker group of 2 ranks holds model replicas.
Each step the driver makes a batch (a DataProto), one `DP_COMPUTE_PROTO` call splits it over
the ranks, each rank computes gradients on its chunk, an all-reduce inside the group averages
them, and every replica takes the same step. The driver only sees the collected metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, ray_session, register
from hybridflow.protocol import DataProto

TRUE_WEIGHTS = torch.tensor([2.0, -3.0, 0.5, 1.0])


class RegressionWorker(Worker):
    def __init__(self, lr: float):
        super().__init__()
        torch.manual_seed(0)  # identical replicas on every rank
        self.weights = torch.zeros(len(TRUE_WEIGHTS), requires_grad=True)
        self.lr = lr

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, data: DataProto) -> dict:
        features, targets = data.batch["features"], data.batch["targets"]
        loss = ((features @ self.weights - targets) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            dist.all_reduce(self.weights.grad, op=dist.ReduceOp.AVG)
            self.weights -= self.lr * self.weights.grad
            self.weights.grad.zero_()
        return {"rank": self.rank, "rows": len(data), "loss": loss.item()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> list[float]:
        return self.weights.detach().tolist()


def make_batch(generator: torch.Generator, size: int) -> DataProto:
    features = torch.randn(size, len(TRUE_WEIGHTS), generator=generator)
    targets = features @ TRUE_WEIGHTS + 0.01 * torch.randn(size, generator=generator)
    return DataProto.from_dict({"features": features, "targets": targets})


def main(steps: int = 30, batch_size: int = 64, world_size: int = 2) -> None:
    console = Console()
    generator = torch.Generator().manual_seed(0)
    with ray_session(num_cpus=world_size):  # one logical CPU per worker, whatever the machine's cores
        group = RayWorkerGroup(RayResourcePool([world_size]), RoleSpec(RegressionWorker, kwargs={"lr": 0.1}))
        table = Table("step", *[f"rank {r} loss" for r in range(world_size)], "rows per rank", title="SPMD regression")
        for step in range(1, steps + 1):
            metrics = group.train_step(make_batch(generator, batch_size))
            if step == 1 or step % 5 == 0:
                table.add_row(str(step), *[f"{m['loss']:.5f}" for m in metrics], str(metrics[0]["rows"]))
        console.print(table)
        replicas = group.get_weights()
    console.print(f"true weights     {TRUE_WEIGHTS.tolist()}")
    for rank, weights in enumerate(replicas):
        console.print(f"rank {rank} replica  {[round(w, 4) for w in weights]}")
    assert all(r == replicas[0] for r in replicas), "replicas diverged"
    error = (torch.tensor(replicas[0]) - TRUE_WEIGHTS).abs().max().item()
    console.print(f"replicas identical; max weight error {error:.4f}")


if __name__ == "__main__":
    main()
