"""A supervised objective's side of one rank (SFT, DPO, the reward model, or any registered objective): the update over
labelled rows, the reference pass, and the held-out rows' measures, all through the one packed forward
(engine/forward.py) and the shared update loop (engine/update.py).

The objective (algorithms/objectives/) says which forward it needs (token log-probs or sequence scores), whether rows
come in pairs (micro-batches never split one: ``row_units``) and whether a reference pass precedes the update; it
gives each micro-batch's loss as its share of the batch's loss on all ranks, so the gradient is the same whatever the
micro-batching. The reference is a frozen model, or (None) this model with its LoRA adapters off.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import SEQUENCE_SCORES, ForwardOutputs, Objective
from hybridflow.batch_keys import METRICS, REF_LOG_PROB
from hybridflow.engine.config import SFTEngineConfig
from hybridflow.engine.flops import PassMeter, pass_work
from hybridflow.engine.forward import ResponseOutputs, batched_log_probs, log_probs_of, response_outputs
from hybridflow.engine.lora import adapters_off
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.sequence_parallel import sp_size
from hybridflow.engine.sequence_scores import ScoreOutputs, batched_scores, pipelined_scores, score_outputs
from hybridflow.engine.update import run_updates
from hybridflow.protocol import DataProto


def pair_units(data: DataProto) -> list[int]:
    """Rows 2k and 2k+1 are one unit: a pair."""
    return [row // 2 for row in range(len(data))]


class SupervisedEngine:
    """A sharded model under ``objective``, its optimizer and learning-rate schedule; ``reference``: the frozen model
    of an objective with a reference (None: this model with its adapters off); ``pad_token_id``: the padding a
    sequence score skips; ``dp_group``: the ranks that split the rows (None: all; tensor- and sequence-parallel peers
    share rows); ``sp_group``: Ulysses, the ranks that split each micro-batch's tokens (None: none)."""

    def __init__(
        self,
        trained: TrainedModel,
        config: SFTEngineConfig,
        optim: OptimConfig,
        objective: Objective,
        *,
        reference: nn.Module | None = None,
        pad_token_id: int | None = None,
        dp_group: dist.ProcessGroup | None = None,
        sp_group: dist.ProcessGroup | None = None,
    ):
        self.trained = trained
        self.config = config
        self.objective = objective
        self.reference = reference
        self.pad_token_id = pad_token_id
        self.dp_group = dp_group
        self.sp_group = sp_group
        self.update_config = config.update_config(optim)
        self.meter = PassMeter(trained.model, sp_size(sp_group))

    @property
    def model(self) -> nn.Module:
        return self.trained.model

    @contextmanager
    def _reference_model(self) -> Iterator[nn.Module]:
        if not self.objective.reference:
            raise ValueError(f"the {self.objective.name!r} objective has no reference")
        if self.reference is not None:
            yield self.reference
            return
        with adapters_off(self.model):
            yield self.model

    def _forward(self, micro: DataProto) -> ScoreOutputs | ResponseOutputs:
        """The model's outputs on a micro-batch, with gradients: the sequence scores of a scoring objective, else the
        outputs that predict the answer tokens."""
        remove_padding = self.config.use_remove_padding
        if self.objective.output == SEQUENCE_SCORES:
            return score_outputs(self.model, micro, self.pad_token_id, remove_padding, self.sp_group)
        return response_outputs(self.model, micro, remove_padding, self.sp_group)

    def _all_rows(self, model: nn.Module, data: DataProto, output: str) -> torch.Tensor:
        """``output`` for every row of ``data``, micro-batch by micro-batch without gradients."""
        cfg = self.config
        model.eval()
        batching = dict(
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            sp_group=self.sp_group,
        )
        if output == SEQUENCE_SCORES:
            return batched_scores(model, data, cfg.micro_batch_size_per_gpu, self.pad_token_id, **batching)
        log_probs, _ = batched_log_probs(
            model, data, cfg.micro_batch_size_per_gpu, temperature=1.0, with_entropy=False, **batching
        )
        return log_probs

    def _staged(self) -> dict:
        """run_updates' pass through pipeline stages where it is not the token outputs' (a sequence score's)."""
        if self.objective.output != SEQUENCE_SCORES:
            return {}
        return {"staged": functools.partial(pipelined_scores, pad_token_id=self.pad_token_id)}

    def _micro_loss(
        self, micro: DataProto, agg: LossAggregation, outputs: ScoreOutputs | ResponseOutputs
    ) -> tuple[torch.Tensor, dict]:
        if self.objective.output == SEQUENCE_SCORES:
            forward = ForwardOutputs(scores=outputs.scores)
        else:
            forward = ForwardOutputs(log_probs=log_probs_of(outputs, micro)[0])
        return self.objective.loss(forward, micro.batch, agg)

    def train_batch(self, data: DataProto, seed: int) -> DataProto:
        """One optimizer step over this rank's rows (their share of the global batch), metrics in the output."""
        name = self.objective.name
        metrics = run_updates(
            self.trained,
            data,
            self.update_config,
            self.meter,
            pass_name=f"{name}_update",
            prefix=name,
            mini_batch_size=len(data),
            seed=seed,
            forward=self._forward,
            micro_loss=self._micro_loss,
            loss_share_keys=self.objective.share_keys,
            dp_group=self.dp_group,
            row_units=pair_units if self.objective.paired else None,
            sp_group=self.sp_group,
            **self._staged(),
        )
        return DataProto(meta_info={METRICS: metrics})

    def reference_log_probs(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R): the reference's token log-probs of each answer, with the pass's FLOP/s."""
        start = time.perf_counter()
        with self._reference_model() as model:
            log_probs = self._all_rows(model, data, self.objective.output)
        work = pass_work(data, self.config.use_remove_padding)
        metrics = self.meter.metrics("ref_log_prob", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict({REF_LOG_PROB: log_probs}, meta_info={METRICS: metrics})

    def evaluate(self, data: DataProto) -> DataProto:
        """The objective's measures of each held-out row (``held_out_rows``), without gradients; the driver forms the
        held-out metrics from them."""
        start = time.perf_counter()
        output = self.objective.output
        computed = self._all_rows(self.model, data, output)
        reference = None
        if self.objective.reference:
            with self._reference_model() as model:
                reference = self._all_rows(model, data, output)
        field = "scores" if output == SEQUENCE_SCORES else "log_probs"
        outputs = ForwardOutputs(**{field: computed}, reference_log_probs=reference)
        work = pass_work(data, self.config.use_remove_padding)
        metrics = self.meter.metrics(f"{self.objective.name}_eval", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict(self.objective.held_out_rows(outputs, data.batch), meta_info={METRICS: metrics})
