"""A frozen policy's pass: log-probs of the sampled tokens, the reference's (for the KL term) or a teacher's
(for on-policy distillation)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from hybridflow.batch_keys import METRICS, REF_LOG_PROB
from hybridflow.engine.config import RefConfig
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.log_prob import log_prob_pass
from hybridflow.engine.sequence_parallel import sp_size
from hybridflow.protocol import DataProto


class FrozenPolicyEngine:
    """``key``: the batch column its log-probs go to; ``pass_name``: its ``perf/*`` metrics' name."""

    def __init__(
        self,
        model: nn.Module,
        config: RefConfig,
        *,
        key: str = REF_LOG_PROB,
        pass_name: str = "ref_log_prob",
        sp_group: dist.ProcessGroup | None = None,
    ):
        self.model = model
        self.config = config
        self.key = key
        self.pass_name = pass_name
        self.sp_group = sp_group  # Ulysses: the ranks that split each micro-batch's tokens (None: none)
        self.meter = PassMeter(model, sp_size(sp_group))  # measures the device's peak FLOP/s once per process

    def compute_log_prob(self, data: DataProto, temperature: float) -> DataProto:
        """The log-probs (B, R) under ``key``, with the pass's FLOP/s as metrics (``meta_info[METRICS]``)."""
        log_probs, _, metrics = log_prob_pass(
            self.model,
            self.meter,
            data,
            self.config,
            pass_name=self.pass_name,
            temperature=temperature,
            with_entropy=False,
            sp_group=self.sp_group,
        )
        return DataProto.from_dict({self.key: log_probs}, meta_info={METRICS: metrics})
