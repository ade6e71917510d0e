"""The preference side of one rank: DPO's update over pairs of answers, and the answers' log-probs for held-out
metrics.

Batches hold pairs as consecutive rows, chosen first (data/preference_dataset.py), with the reference's token
log-probs in ``ref_log_prob`` (a pass before the update: a frozen copy of the starting model, or this model with its
LoRA adapters off). Micro-batches never split a pair (``row_units``), so each micro-batch's loss is the sum of its
pairs' losses over the number of pairs in the whole batch on all ranks; the shared update loop (engine/update.py)
turns that into the gradient of the mean pair loss whatever the micro-batching.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    answer_log_probs,
    pair_halves,
    preference_loss,
)
from hybridflow.batch_keys import ANSWER_LOG_PROB, METRICS, REF_ANSWER_LOG_PROB, REF_LOG_PROB, RESPONSE_MASK
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.forward import batched_log_probs, pass_work, response_log_probs
from hybridflow.engine.lora import adapters_off
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.update import run_updates
from hybridflow.protocol import DataProto

DPO_LOSS = "dpo/loss"  # the mean pair loss of a step
PAIR_METRICS = ("dpo/reward_accuracy", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/reward_margin")


def pair_units(data: DataProto) -> list[int]:
    """Rows 2k and 2k+1 are one unit: a pair."""
    return [row // 2 for row in range(len(data))]


class PreferenceEngine:
    """A sharded model under DPO training, its optimizer, and the reference it is pulled towards.

    ``reference``: a frozen model; None: this model with its LoRA adapters off (a LoRA run's reference)."""

    def __init__(
        self,
        trained: TrainedModel,
        config: SFTEngineConfig,
        optim: OptimConfig,
        preference: PreferenceConfig,
        *,
        reference: nn.Module | None,
        dp_group: dist.ProcessGroup | None = None,
    ):
        self.trained = trained
        self.config = config
        self.preference = preference
        self.length_normalized = PREFERENCE_LOSSES.get(preference.loss_type).length_normalized
        self.reference = reference
        self.dp_group = dp_group  # the ranks that split the pairs (None: all); tensor-parallel peers share rows
        self.update_config = config.update_config(optim)
        self.meter = PassMeter(trained.model)

    @property
    def model(self) -> nn.Module:
        return self.trained.model

    @contextmanager
    def _reference_model(self) -> Iterator[nn.Module]:
        if self.reference is not None:
            yield self.reference
            return
        with adapters_off(self.model):
            yield self.model

    def _log_probs(self, model: nn.Module, data: DataProto) -> torch.Tensor:
        cfg = self.config
        model.eval()
        log_probs, _ = batched_log_probs(
            model,
            data,
            cfg.micro_batch_size_per_gpu,
            temperature=1.0,
            with_entropy=False,
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        )
        return log_probs

    def reference_log_probs(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R): the reference's token log-probs of each answer, with the pass's FLOP/s."""
        start = time.perf_counter()
        with self._reference_model() as model:
            log_probs = self._log_probs(model, data)
        work = pass_work(data, self.config.use_remove_padding)
        metrics = self.meter.metrics("ref_log_prob", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict({REF_LOG_PROB: log_probs}, meta_info={METRICS: metrics})

    def _micro_loss(self, micro: DataProto, agg: LossAggregation) -> tuple[torch.Tensor, dict]:
        log_probs, _ = response_log_probs(self.model, micro, remove_padding=self.config.use_remove_padding)
        mask = micro.batch[RESPONSE_MASK]
        policy = answer_log_probs(log_probs, mask, self.length_normalized)
        reference = answer_log_probs(micro.batch[REF_LOG_PROB], mask, self.length_normalized)
        output = preference_loss(*pair_halves(policy), *pair_halves(reference), self.preference)
        pairs = max((agg.global_seqs or 0.0) / 2, 1.0)  # every answer has trained tokens: rows / 2 of all ranks
        loss = output.losses.sum() / pairs
        margins = output.chosen_rewards - output.rejected_rewards
        metrics = {
            DPO_LOSS: loss.detach(),
            "dpo/reward_accuracy": (margins > 0).sum() / pairs,
            "dpo/chosen_reward": output.chosen_rewards.sum() / pairs,
            "dpo/rejected_reward": output.rejected_rewards.sum() / pairs,
            "dpo/reward_margin": margins.sum() / pairs,
        }
        return loss, metrics

    def train_batch(self, data: DataProto, seed: int) -> DataProto:
        """One optimizer step over this rank's pairs (their share of the global batch), metrics in the output."""
        metrics = run_updates(
            self.trained,
            data,
            self.update_config,
            self.meter,
            pass_name="dpo_update",
            prefix="dpo",
            mini_batch_size=len(data),
            seed=seed,
            micro_loss=self._micro_loss,
            loss_share_keys=(DPO_LOSS, *PAIR_METRICS),
            dp_group=self.dp_group,
            row_units=pair_units,
        )
        return DataProto(meta_info={METRICS: metrics})

    def evaluate(self, data: DataProto) -> DataProto:
        """Each answer's log-prob under this model and under the reference (B,) each, summed over its tokens (or
        averaged, for a length-normalised loss), without gradients: the caller forms the held-out pairs' metrics."""
        start = time.perf_counter()
        mask = data.batch[RESPONSE_MASK]
        policy = self._log_probs(self.model, data)  # batched_log_probs runs without gradients
        with self._reference_model() as model:
            reference = self._log_probs(model, data)
        work = pass_work(data, self.config.use_remove_padding)
        metrics = self.meter.metrics("dpo_eval", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict(
            {
                ANSWER_LOG_PROB: answer_log_probs(policy, mask, self.length_normalized),
                REF_ANSWER_LOG_PROB: answer_log_probs(reference, mask, self.length_normalized),
            },
            meta_info={METRICS: metrics},
        )
