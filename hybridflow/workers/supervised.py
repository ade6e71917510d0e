"""The supervised role (``hybridflow sft``, ``dpo``, ``rm``, and any registered objective): one model trained on
labelled rows under a (dp, t) layout, by its objective (algorithms/objectives/) through the one supervised engine.

Rows split over the data-parallel ranks of the layout, as the actor's do (a pair's two rows on one rank: the driver
keeps them together). The objective names the model (a causal LM, or a sequence classifier: the backbone with a
scalar head, zero where the directory has none) and whether it needs a reference: a frozen copy of the starting
model sharded the same way, or under LoRA the trained model with its adapters off, which costs no memory.
Checkpoints have the actor's layout (``actor/``: training state, HF config, tokenizer, LoRA adapter settings), so
``hybridflow export`` writes a model directory from any of them: an RL run starts from it, or loads it as its
reward model.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.algorithms.objectives import CAUSAL_LM, SEQUENCE_CLASSIFIER, Objective
from hybridflow.batch_keys import GLOBAL_STEP, METRICS
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state
from hybridflow.engine.config import SFTEngineConfig, TrainedModelConfig
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.optim import OptimConfig
from hybridflow.engine.supervised import SupervisedEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_reward_model, load_tokenizer
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.sharded_model import RoleMeshes, build_sharded, build_trainable, save_policy_state

SUPERVISED_MESH = "supervised"  # the (dp, tp) layout: every call splits rows over dp


MODEL_LOADERS = {CAUSAL_LM: load_causal_lm, SEQUENCE_CLASSIFIER: load_reward_model}  # an objective's model


class SupervisedWorker(Worker):
    """model_path: the model directory (the run's); layout: (dp, t) over this group's ranks; ``objective``: the
    the objective (algorithms/objectives/) with its settings, chosen on the driver (a user's registered objective too:
    it travels pickled)."""

    def __init__(
        self,
        *,
        model: TrainedModelConfig,
        engine: SFTEngineConfig,
        optim: OptimConfig,
        model_path: str,
        layout: LayoutShape,
        total_training_steps: int,
        seed: int,
        objective: Objective,
    ):
        super().__init__()
        self.seed = seed
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(SUPERVISED_MESH, meshes.rows)
        load_model = MODEL_LOADERS[objective.model]
        stages_per_rank = engine.virtual_pipeline_model_parallel_size
        trained = build_trainable(
            load_model,
            model_path,
            model,
            engine.fsdp,
            optim,
            self.device,
            seed,
            total_training_steps,
            meshes.training,
            stages_per_rank,
        )
        reference = None
        if objective.reference and not model.lora.enabled:
            reference = build_sharded(
                load_model,
                model_path,
                engine.fsdp,
                self.device,
                seed,
                meshes.training,
                stages_per_rank=stages_per_rank,
            )
            reference = reference.eval().requires_grad_(False)
        self.engine = SupervisedEngine(
            trained,
            engine,
            optim,
            objective,
            reference=reference,
            pad_token_id=trained.model.config.get_text_config().pad_token_id,  # a score skips it (load_reward_model)
            dp_group=meshes.dp_group,
            sp_group=meshes.sp_group,
        )

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on the batch (this rank's rows); its metrics in the output."""
        output = self.engine.train_batch(data, seed=self.seed + int(data.meta_info[GLOBAL_STEP]))
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        metrics["perf/worker_rss_gb"] = resident_gb()
        return output

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def evaluate(self, data: DataProto) -> DataProto:
        """The objective's measures of each held-out row (``Objective.held_out_rows``)."""
        return self.engine.evaluate(data)

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R): the reference's token log-probs of each answer (an objective with a reference)."""
        return self.engine.reference_log_probs(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        trained = self.engine.trained
        save_policy_state(Path(directory) / ACTOR_STATE, trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.engine.trained, self.rank)
