"""The critic's training side: values and the clipped value-loss update on one rank.

Both passes return a DataProto whose ``meta_info[METRICS]`` holds their measurements.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES, ForwardOutputs
from hybridflow.batch_keys import METRICS, RESPONSE_MASK, VALUES
from hybridflow.engine.config import CriticConfig
from hybridflow.engine.flops import pass_work
from hybridflow.engine.forward import ResponseOutputs, batched_values, values_of
from hybridflow.engine.optim import TrainedModel
from hybridflow.engine.update import UpdatedEngine, run_updates
from hybridflow.protocol import DataProto


class CriticEngine(UpdatedEngine):
    """A sharded value model with its optimizer and learning-rate schedule (``UpdatedEngine``'s arguments)."""

    config: CriticConfig

    def __init__(self, trained: TrainedModel, config: CriticConfig, **groups: dist.ProcessGroup | None):
        super().__init__(trained, config, **groups)
        self.objective = OBJECTIVES.get("value")(config)

    def compute_values(self, data: DataProto) -> DataProto:
        """Values (B, R), 0 on response padding, with the pass's FLOP/s as metrics."""
        cfg = self.config
        self.model.eval()
        start = time.perf_counter()
        values = batched_values(
            self.model,
            data,
            cfg.forward_micro_batch_size_per_gpu,
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            sp_group=self.sp_group,
        )
        work = pass_work(data, cfg.use_remove_padding)
        metrics = self.meter.metrics("values", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict({VALUES: values * data.batch[RESPONSE_MASK]}, meta_info={METRICS: metrics})

    def _micro_loss(
        self, micro: DataProto, agg: LossAggregation, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, dict]:
        return self.objective.loss(ForwardOutputs(values=values_of(outputs)), micro.batch, agg)

    def update_critic(self, data: DataProto, mini_batch_size: int, seed: int) -> DataProto:
        """Value-loss epochs over this rank's batch; metrics include ``perf/mfu_critic_update`` and
        ``perf/tflops_critic_update``."""
        metrics = run_updates(
            self.trained,
            data,
            self.config,
            self.meter,
            pass_name="critic_update",
            prefix="critic",
            mini_batch_size=mini_batch_size,
            seed=seed,
            forward=self.outputs,
            micro_loss=self._micro_loss,
            dp_group=self.dp_group,
            loss_share_keys=self.objective.share_keys,
            sp_group=self.sp_group,
        )
        return DataProto(meta_info={METRICS: metrics})
