"""The actor's training side: old log-probs and the PPO-family policy update on one rank."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.algorithms import LossAggregation, agg_loss, compute_kl_loss, get_policy_loss
from hybridflow.engine.config import ActorConfig
from hybridflow.engine.forward import batched_log_probs, response_log_probs
from hybridflow.engine.update import run_updates
from hybridflow.protocol import DataProto


class PolicyEngine:
    """A sharded policy model with its optimizer and learning-rate schedule."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, config: ActorConfig):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.policy_loss = get_policy_loss(config.policy_loss.loss_mode)

    def compute_log_prob(self, data: DataProto, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.model.eval()
        return batched_log_probs(self.model, data, self.config.log_prob_micro_batch_size_per_gpu, temperature, with_entropy)

    def _micro_loss(self, micro: DataProto, agg: LossAggregation, temperature: float) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        batch = micro.batch
        mask = batch["response_mask"]
        with_entropy = cfg.entropy_coeff != 0
        log_prob, entropy = response_log_probs(self.model, micro, temperature, with_entropy=with_entropy)
        pg_loss, metrics = self.policy_loss(batch["old_log_probs"], log_prob, batch["advantages"], mask, cfg.policy_loss, agg)
        loss = pg_loss
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = pg_loss.detach()
        if with_entropy:
            entropy_loss = agg_loss(entropy, mask, agg)
            loss = loss - cfg.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = entropy_loss.detach()
        if cfg.use_kl_loss:
            kl_loss = compute_kl_loss(log_prob, batch["ref_log_prob"], mask, cfg.kl_loss_type, agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return loss, metrics

    def update_policy(self, data: DataProto, mini_batch_size: int, temperature: float, seed: int) -> dict[str, float]:
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
            micro_loss=lambda micro, agg: self._micro_loss(micro, agg, temperature),
        )
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        metrics["actor/grad_norm"] = metrics.pop("grad_norm")
        metrics["actor/skipped_steps"] = metrics.pop("skipped_steps")
        return metrics


