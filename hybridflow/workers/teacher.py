"""On-policy distillation's teacher: a frozen model that scores the student's sampled tokens."""

from __future__ import annotations

from hybridflow.batch_keys import TEACHER_LOG_PROB
from hybridflow.controller import register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.protocol import DataProto
from hybridflow.workers.config import TeacherConfig
from hybridflow.workers.frozen_policy import FrozenPolicyWorker

TEACHER_MESH = "teacher"  # the teacher's rows (RoleMeshes.rows): compute_teacher_log_prob splits them over dp


class TeacherWorker(FrozenPolicyWorker):
    """model_path: the teacher's model directory (the run plan's); layout: its (dp, t) over this group's ranks;
    temperature: the rollout's, so that teacher and student log-probs are of the same distribution."""

    def __init__(self, *, config: TeacherConfig, model_path: str, layout: LayoutShape, temperature: float, seed: int):
        super().__init__()
        self.temperature = temperature
        self.teacher = self.build_frozen_policy(
            TEACHER_MESH, layout, model_path, config, seed, key=TEACHER_LOG_PROB, pass_name="teacher_log_prob"
        )

    @register(dispatch_mode=mesh_compute_proto(TEACHER_MESH))
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """teacher_log_prob (B, R): the teacher's log-probs of the sampled response tokens, in their context."""
        return self.teacher.compute_log_prob(data, self.temperature)
