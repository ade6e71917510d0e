"""The frozen reference policy's pass: log-probs of the sampled tokens, for the KL term."""

from __future__ import annotations

import time

from torch import nn

from hybridflow.batch_keys import METRICS, REF_LOG_PROB
from hybridflow.engine.config import RefConfig
from hybridflow.engine.flops import PassMeter
from hybridflow.engine.forward import batched_log_probs, pass_work
from hybridflow.protocol import DataProto


class ReferenceEngine:
    def __init__(self, model: nn.Module, config: RefConfig):
        self.model = model
        self.config = config
        self.meter = PassMeter(model)  # measures the device's peak FLOP/s once per process

    def compute_ref_log_prob(self, data: DataProto, temperature: float) -> DataProto:
        """Reference log-probs (B, R), with the pass's FLOP/s as metrics (``meta_info[METRICS]``)."""
        cfg = self.config
        self.model.eval()
        start = time.perf_counter()
        log_probs, _ = batched_log_probs(
            self.model,
            data,
            cfg.log_prob_micro_batch_size_per_gpu,
            temperature,
            with_entropy=False,
            remove_padding=cfg.use_remove_padding,
            max_token_len=cfg.log_prob_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        )
        work = pass_work(data, cfg.use_remove_padding)
        metrics = self.meter.metrics("ref_log_prob", work, time.perf_counter() - start, training=False)
        return DataProto.from_dict({REF_LOG_PROB: log_probs}, meta_info={METRICS: metrics})
