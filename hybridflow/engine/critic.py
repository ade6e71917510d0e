"""The critic's training side: values and the clipped value-loss update on one rank."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.algorithms import LossAggregation, compute_value_loss
from hybridflow.engine.config import CriticConfig
from hybridflow.engine.forward import batched_values, response_values
from hybridflow.engine.update import run_updates
from hybridflow.protocol import DataProto


class CriticEngine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, config: CriticConfig):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config

    def compute_values(self, data: DataProto) -> torch.Tensor:
        self.model.eval()
        values = batched_values(self.model, data, self.config.forward_micro_batch_size_per_gpu)
        return values * data.batch["response_mask"]

    def _micro_loss(self, micro: DataProto, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        batch = micro.batch
        vpreds = response_values(self.model, micro)
        loss, metrics = compute_value_loss(
            vpreds, batch["values"], batch["returns"], batch["response_mask"], self.config.cliprange_value, agg
        )
        return loss, {"critic/vf_loss": loss.detach(), **{f"critic/{k}": v for k, v in metrics.items()}}

    def update_critic(self, data: DataProto, mini_batch_size: int, seed: int) -> dict[str, float]:
        cfg = self.config
        metrics = run_updates(
            self.model,
            self.optimizer,
            data,
            mini_batch_size=mini_batch_size,
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            seed=seed,
            grad_clip=cfg.grad_clip,
            loss_agg_mode=cfg.loss_agg_mode,
            micro_loss=self._micro_loss,
        )
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        metrics["critic/grad_norm"] = metrics.pop("grad_norm")
        metrics["critic/skipped_steps"] = metrics.pop("skipped_steps")
        return metrics
