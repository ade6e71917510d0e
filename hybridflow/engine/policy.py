"""The actor's training side: old log-probs and the PPO-family policy update on one rank."""

from __future__ import annotations

import time

import torch
from torch import nn

from hybridflow.algorithms import LossAggregation, agg_loss, compute_kl_loss, get_policy_loss
from hybridflow.engine.config import ActorConfig
from hybridflow.engine.dynamic_batch import row_lengths
from hybridflow.engine.flops import PassMeter
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
        self.meter = PassMeter(model)  # measures the device's peak FLOP/s once per process
        self.log_prob_metrics: dict[str, float] = {}  # perf/* of the last compute_log_prob

    def compute_log_prob(self, data: DataProto, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Old log-probs (and entropy), (B, R); its FLOP/s are left in ``self.log_prob_metrics``."""
        cfg = self.config
        self.model.eval()
        start = time.perf_counter()
        result = batched_log_probs(
            self.model,
            data,
            cfg.log_prob_micro_batch_size_per_gpu,
            temperature,
            with_entropy,
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.log_prob_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        )
        self.log_prob_metrics = self.meter.metrics("log_prob", row_lengths(data), time.perf_counter() - start, training=False)
        return result

    def _micro_loss(self, micro: DataProto, agg: LossAggregation, temperature: float) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        batch = micro.batch
        mask = batch["response_mask"]
        with_entropy = cfg.entropy_coeff != 0
        log_prob, entropy = response_log_probs(self.model, micro, temperature, with_entropy, cfg.use_remove_padding)
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
        """PPO epochs over this rank's batch; metrics include ``perf/mfu_update`` and ``perf/tflops_update``."""
        cfg = self.config
        start = time.perf_counter()
        metrics = run_updates(
            self.model,
            self.optimizer,
            self.scheduler,
            data,
            cfg,
            prefix="actor",
            mini_batch_size=mini_batch_size,
            seed=seed,
            micro_loss=lambda micro, agg: self._micro_loss(micro, agg, temperature),
            loss_share_keys=("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss"),
        )
        metrics.update(self.meter.metrics("update", row_lengths(data), time.perf_counter() - start, True, cfg.ppo_epochs))
        return metrics
