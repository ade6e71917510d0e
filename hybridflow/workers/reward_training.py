"""The reward-model training role: a sequence classifier trained with the Bradley-Terry loss on preference pairs.

Rows split over the data-parallel ranks of its (dp, t) layout as the DPO role's do, two per pair (the driver keeps a
pair on one rank). The model is the starting model's backbone with a scalar head (models/loading.py
``load_reward_model``: zero where the directory has none). Checkpoints have the actor's layout (``actor/``), so
``hybridflow export`` writes a model directory from them that an RL run's ``reward_model.path`` loads.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.batch_keys import GLOBAL_STEP, METRICS
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state
from hybridflow.engine.config import SFTEngineConfig, TrainedModelConfig
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.optim import OptimConfig
from hybridflow.engine.reward_training import RewardTrainingEngine
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_reward_model, load_tokenizer
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.sharded_model import build_trainable, save_policy_state

REWARD_MESH = "rm"  # the (dp, tp) layout: every call splits rows over dp


class RewardTrainingWorker(Worker):
    """model_path: the model directory (the run's); layout: (dp, t) over this group's ranks."""

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
    ):
        super().__init__()
        self.seed = seed
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        mesh = training_mesh(self.device, layout.dp, layout.t)
        self.register_dispatch_mesh(REWARD_MESH, mesh)
        trained = build_trainable(
            load_reward_model, model_path, model, engine.fsdp, optim, self.device, seed, total_training_steps, mesh
        )
        pad = trained.model.config.get_text_config().pad_token_id  # load_reward_model sets it: the rule's pad
        self.rm = RewardTrainingEngine(trained, engine, optim, pad_token_id=pad, dp_group=mesh["dp"].get_group())

    @register(dispatch_mode=mesh_compute_proto(REWARD_MESH))
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's pairs; its metrics in the output."""
        output = self.rm.train_batch(data, seed=self.seed + int(data.meta_info[GLOBAL_STEP]))
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        metrics["perf/worker_rss_gb"] = resident_gb()
        return output

    @register(dispatch_mode=mesh_compute_proto(REWARD_MESH))
    def evaluate(self, data: DataProto) -> DataProto:
        """``sequence_score`` (B,): each row's score (engine/reward_training.py)."""
        return self.rm.evaluate(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        save_policy_state(Path(directory) / ACTOR_STATE, self.rm.trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.rm.trained, self.rank)
