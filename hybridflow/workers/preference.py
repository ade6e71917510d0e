"""The preference role: a causal LM trained with DPO on pairs of answers, beside the reference it is pulled towards
(workers/supervised.py: the layout, the calls and the checkpoints every supervised role shares).

The reference is a frozen copy of the starting model, sharded the same way; under LoRA it is the trained model with
its adapters off, so it costs no memory. An RL run starts from the model directory ``hybridflow export`` writes.
"""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.preference import PreferenceConfig
from hybridflow.controller import register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.preference import PreferenceEngine
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto
from hybridflow.workers.sharded_model import build_sharded
from hybridflow.workers.supervised import SUPERVISED_MESH, SupervisedWorker


class PreferenceWorker(SupervisedWorker):
    """``preference``: the DPO/IPO/hinge settings; ``evaluate``: each answer's log-prob under the model and the
    reference (engine/preference.py)."""

    def objective_engine(
        self, trained: Any, *, model, engine, optim, preference: PreferenceConfig, **objective: Any
    ) -> PreferenceEngine:
        reference = None
        if not model.lora.enabled:
            reference = build_sharded(load_causal_lm, self.model_path, engine.fsdp, self.device, self.seed, self.mesh)
            reference = reference.eval().requires_grad_(False)
        return PreferenceEngine(
            trained, engine, optim, preference, reference=reference, dp_group=self.mesh["dp"].get_group()
        )

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R): the reference's token log-probs of each answer."""
        return self.objective.reference_log_probs(data)
