"""What the roles that score with a frozen causal LM share: the reference policy (reference.py) and on-policy
distillation's teacher (teacher.py)."""

from __future__ import annotations

from typing import Any

from hybridflow.controller import Worker
from hybridflow.engine.reference import FrozenPolicyEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm
from hybridflow.workers.sharded_model import RoleMeshes, build_sharded


class FrozenPolicyWorker(Worker):
    """A worker whose role scores the rows it is given with a frozen copy of a causal LM (no optimizer, no
    gradients), sharded like a trained role's."""

    def build_frozen_policy(
        self,
        mesh: str,
        layout: LayoutShape,
        model_path: str,
        section: Any,
        seed: int,
        *,
        gradient_checkpointing: bool = False,
        **engine: Any,
    ) -> FrozenPolicyEngine:
        """The scoring engine of the model directory ``model_path``, frozen and sharded over ``layout`` as its config
        ``section`` says (FSDP2, pipeline stages; micro-batches for the engine, with ``engine``'s settings). The rows
        its calls take split over the dp dimension of the dispatch mesh registered as ``mesh``."""
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(mesh, meshes.rows)
        stages = section.virtual_pipeline_model_parallel_size
        model = build_sharded(
            load_causal_lm,
            model_path,
            section.fsdp,
            self.device,
            seed,
            meshes.training,
            gradient_checkpointing=gradient_checkpointing,
            stages_per_rank=stages,
        )
        model.eval().requires_grad_(False)
        return FrozenPolicyEngine(model, section, sp_group=meshes.sp_group, **engine)
