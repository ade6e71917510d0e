"""The frozen reference policy, for the KL term."""

from __future__ import annotations

from hybridflow.controller import Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.reference import FrozenPolicyEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.sharded_model import RoleMeshes, build_sharded

REF_MESH = "ref"  # the reference's rows (RoleMeshes.rows): compute_ref_log_prob splits them over dp


class RefPolicyWorker(Worker):
    """model_path: the policy's model directory; layout: the reference's (dp, t) over this group's ranks."""

    def __init__(self, *, config: ActorRolloutRefConfig, model_path: str, layout: LayoutShape, seed: int):
        super().__init__()
        self.config = config
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(REF_MESH, meshes.rows)
        self.model = build_sharded(
            load_causal_lm,
            model_path,
            config.ref.fsdp,
            self.device,
            seed,
            meshes.training,
            gradient_checkpointing=config.model.enable_gradient_checkpointing,
            stages_per_rank=config.ref.virtual_pipeline_model_parallel_size,
        ).eval()
        self.model.requires_grad_(False)
        self.ref = FrozenPolicyEngine(self.model, config.ref, sp_group=meshes.sp_group)

    @register(dispatch_mode=mesh_compute_proto(REF_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R), at the rollout's temperature."""
        return self.ref.compute_log_prob(data, self.config.rollout.temperature)
