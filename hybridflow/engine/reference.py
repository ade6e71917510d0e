"""The frozen reference policy's pass: log-probs of the sampled tokens, for the KL term."""

from __future__ import annotations

from torch import nn

from hybridflow.batch_keys import METRICS, REF_LOG_PROB
from hybridflow.engine.config import RefConfig
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.log_prob import log_prob_pass
from hybridflow.protocol import DataProto


class ReferenceEngine:
    def __init__(self, model: nn.Module, config: RefConfig):
        self.model = model
        self.config = config
        self.meter = PassMeter(model)  # measures the device's peak FLOP/s once per process

    def compute_ref_log_prob(self, data: DataProto, temperature: float) -> DataProto:
        """Reference log-probs (B, R), with the pass's FLOP/s as metrics (``meta_info[METRICS]``)."""
        log_probs, _, metrics = log_prob_pass(
            self.model,
            self.meter,
            data,
            self.config,
            pass_name="ref_log_prob",
            temperature=temperature,
            with_entropy=False,
        )
        return DataProto.from_dict({REF_LOG_PROB: log_probs}, meta_info={METRICS: metrics})
