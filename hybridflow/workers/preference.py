"""The preference role: a causal LM trained with DPO on pairs of answers, beside the reference it is pulled towards.

Rows split over the data-parallel ranks of its (dp, t) layout as the SFT role's do, two per pair (the driver keeps a
pair on one rank). The reference is a frozen copy of the starting model, sharded the same way; under LoRA it is the
trained model with its adapters off, so it costs no memory. Checkpoints have the actor's layout (``actor/``), so
``hybridflow export`` writes a model directory from them, and an RL run starts from that.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.algorithms.preference import PreferenceConfig
from hybridflow.batch_keys import GLOBAL_STEP, METRICS
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state
from hybridflow.engine.config import SFTEngineConfig, TrainedModelConfig
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.optim import OptimConfig
from hybridflow.engine.preference import PreferenceEngine
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.sharded_model import build_sharded, build_trainable, save_policy_state

PREFERENCE_MESH = "dpo"  # the (dp, tp) layout: every call splits rows over dp


class PreferenceWorker(Worker):
    """model_path: the model directory (the run's); layout: (dp, t) over this group's ranks."""

    def __init__(
        self,
        *,
        model: TrainedModelConfig,
        engine: SFTEngineConfig,
        optim: OptimConfig,
        preference: PreferenceConfig,
        model_path: str,
        layout: LayoutShape,
        total_training_steps: int,
        seed: int,
    ):
        super().__init__()
        self.seed = seed
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        mesh = training_mesh(self.device, layout.dp, layout.t)
        self.register_dispatch_mesh(PREFERENCE_MESH, mesh)
        trained = build_trainable(
            load_causal_lm, model_path, model, engine.fsdp, optim, self.device, seed, total_training_steps, mesh
        )
        reference = None
        if not model.lora.enabled:
            reference = build_sharded(load_causal_lm, model_path, engine.fsdp, self.device, seed, mesh).eval()
            reference.requires_grad_(False)
        self.dpo = PreferenceEngine(
            trained, engine, optim, preference, reference=reference, dp_group=mesh["dp"].get_group()
        )

    @register(dispatch_mode=mesh_compute_proto(PREFERENCE_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R): the reference's token log-probs of each answer."""
        return self.dpo.reference_log_probs(data)

    @register(dispatch_mode=mesh_compute_proto(PREFERENCE_MESH))
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's pairs (``ref_log_prob`` given); its metrics in the output."""
        output = self.dpo.train_batch(data, seed=self.seed + int(data.meta_info[GLOBAL_STEP]))
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        metrics["perf/worker_rss_gb"] = resident_gb()
        return output

    @register(dispatch_mode=mesh_compute_proto(PREFERENCE_MESH))
    def evaluate(self, data: DataProto) -> DataProto:
        """Each answer's log-prob under the model and the reference (engine/preference.py)."""
        return self.dpo.evaluate(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        save_policy_state(Path(directory) / ACTOR_STATE, self.dpo.trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.dpo.trained, self.rank)
