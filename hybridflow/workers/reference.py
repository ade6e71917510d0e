"""The frozen reference policy, for the KL term."""

from __future__ import annotations

from hybridflow.controller import register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.frozen_policy import FrozenPolicyWorker

REF_MESH = "ref"  # the reference's rows (RoleMeshes.rows): compute_ref_log_prob splits them over dp


class RefPolicyWorker(FrozenPolicyWorker):
    """model_path: the policy's model directory; layout: the reference's (dp, t) over this group's ranks."""

    def __init__(self, *, config: ActorRolloutRefConfig, model_path: str, layout: LayoutShape, seed: int):
        super().__init__()
        self.config = config
        self.ref = self.build_frozen_policy(
            REF_MESH,
            layout,
            model_path,
            config.ref,
            seed,
            gradient_checkpointing=config.model.enable_gradient_checkpointing,
        )

    @register(dispatch_mode=mesh_compute_proto(REF_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R), at the rollout's temperature."""
        return self.ref.compute_log_prob(data, self.config.rollout.temperature)
