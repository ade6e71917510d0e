"""On-policy distillation's teacher: a frozen model that scores the student's sampled tokens."""

from __future__ import annotations

from hybridflow.batch_keys import TEACHER_LOG_PROB
from hybridflow.controller import Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.reference import FrozenPolicyEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto
from hybridflow.workers.config import TeacherConfig
from hybridflow.workers.sharded_model import RoleMeshes, build_sharded

TEACHER_MESH = "teacher"  # the teacher's rows (RoleMeshes.rows): compute_teacher_log_prob splits them over dp


class TeacherWorker(Worker):
    """model_path: the teacher's model directory (the run plan's); layout: its (dp, t) over this group's ranks;
    temperature: the rollout's, so that teacher and student log-probs are of the same distribution."""

    def __init__(self, *, config: TeacherConfig, model_path: str, layout: LayoutShape, temperature: float, seed: int):
        super().__init__()
        self.temperature = temperature
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(TEACHER_MESH, meshes.rows)
        self.model = build_sharded(
            load_causal_lm,
            model_path,
            config.fsdp,
            self.device,
            seed,
            meshes.training,
            stages_per_rank=config.virtual_pipeline_model_parallel_size,
        ).eval()
        self.model.requires_grad_(False)
        self.teacher = FrozenPolicyEngine(
            self.model, config, key=TEACHER_LOG_PROB, pass_name="teacher_log_prob", sp_group=meshes.sp_group
        )

    @register(dispatch_mode=mesh_compute_proto(TEACHER_MESH))
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """teacher_log_prob (B, R): the teacher's log-probs of the sampled response tokens, in their context."""
        return self.teacher.compute_log_prob(data, self.temperature)
