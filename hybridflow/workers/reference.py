"""The frozen reference policy, for the KL term."""

from __future__ import annotations

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.reference import ReferenceEngine
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.sharded_model import build_sharded


class RefPolicyWorker(Worker):
    def __init__(self, *, config: ActorRolloutRefConfig, seed: int):
        super().__init__()
        self.config = config
        self.model = build_sharded(load_causal_lm, config.model, config.ref.fsdp, self.device, seed).eval()
        self.model.requires_grad_(False)
        self.ref = ReferenceEngine(self.model, config.ref)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R), at the rollout's temperature."""
        return self.ref.compute_ref_log_prob(data, self.config.rollout.temperature)
