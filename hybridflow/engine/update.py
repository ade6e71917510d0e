"""The shared optimisation loop: mini-batches for optimizer steps, micro-batches for accumulation.

Loss normalisation across micro-batches *and* data-parallel ranks: the loss aggregation is told
the token and sequence counts of the whole mini-batch over all ranks, so each micro-batch loss
is its share of the global mean. FSDP averages gradients over ranks; multiplying the loss by the
world size turns that average into the sum of shares, i.e. the gradient of the global mean.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation
from hybridflow.engine.fsdp import grad_norm_and_clip
from hybridflow.protocol import DataProto

MicroLossFn = Callable[[DataProto, LossAggregation], tuple[torch.Tensor, dict[str, float]]]


def global_aggregation(mode: str, response_mask: torch.Tensor) -> LossAggregation:
    """LossAggregation whose totals are the mini-batch's over every data-parallel rank."""
    mask = response_mask.bool()
    counts = torch.tensor([mask.sum(), mask.any(dim=-1).sum()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return LossAggregation(
        mode, global_tokens=float(counts[0]), global_seqs=float(counts[1]), norm_constant=float(response_mask.shape[-1])
    )


def _to_float(value: torch.Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def run_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    grad_clip: float,
    loss_agg_mode: str,
    micro_loss: MicroLossFn,
) -> dict[str, float]:
    """Optimizer steps over ``data`` (this rank's share); returns metrics averaged over micro-batches."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    totals: dict[str, list[float]] = defaultdict(list)
    model.train()
    for mini_batch in data.make_iterator(mini_batch_size, epochs=epochs, shuffle=shuffle, seed=seed):
        agg = global_aggregation(loss_agg_mode, mini_batch.batch["response_mask"])
        optimizer.zero_grad(set_to_none=True)
        for micro_batch in mini_batch.split(micro_batch_size):
            loss, metrics = micro_loss(micro_batch, agg)
            (loss * world_size).backward()
            for key, value in metrics.items():
                totals[key].append(_to_float(value))
        grad_norm = grad_norm_and_clip(model, grad_clip)
        if torch.isfinite(torch.tensor(grad_norm)):
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"].append(grad_norm)
        totals["skipped_steps"].append(0.0 if torch.isfinite(torch.tensor(grad_norm)) else 1.0)
    model.eval()
    return {key: sum(values) / len(values) for key, values in totals.items()}
