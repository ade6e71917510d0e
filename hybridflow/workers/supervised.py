"""What the supervised roles share (SFT, DPO, the reward model): one model trained on labelled rows under a (dp, t)
layout, by one objective's engine.

Rows split over the data-parallel ranks of the layout, as the actor's do (a pair's two rows on one rank: the driver
keeps them together). Checkpoints have the actor's layout (``actor/``: training state, HF config, tokenizer, LoRA
adapter settings), so ``hybridflow export`` writes a model directory from any of them. A role is a subclass that
names the model it loads (``load_model``) and builds its objective's engine (``objective_engine``); the engine
trains a batch (``train_batch``), evaluates one (``evaluate``) and holds the trained model (``trained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.batch_keys import GLOBAL_STEP, METRICS
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state
from hybridflow.engine.config import SFTEngineConfig, TrainedModelConfig
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.optim import OptimConfig
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.sharded_model import build_trainable, save_policy_state

SUPERVISED_MESH = "supervised"  # the (dp, tp) layout: every call splits rows over dp


class SupervisedWorker(Worker):
    """model_path: the model directory (the run's); layout: (dp, t) over this group's ranks; ``objective``: the
    objective's own settings, for ``objective_engine``."""

    load_model = staticmethod(load_causal_lm)  # (path, ...) -> the model the objective trains

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
        **objective: Any,
    ):
        super().__init__()
        self.seed = seed
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.mesh = training_mesh(self.device, layout.dp, layout.t)
        self.register_dispatch_mesh(SUPERVISED_MESH, self.mesh)
        trained = build_trainable(
            self.load_model, model_path, model, engine.fsdp, optim, self.device, seed, total_training_steps, self.mesh
        )
        self.objective = self.objective_engine(trained, model=model, engine=engine, optim=optim, **objective)

    def objective_engine(self, trained: Any, *, model: TrainedModelConfig, engine: SFTEngineConfig, optim: OptimConfig,
                         **objective: Any) -> Any:  # fmt: skip
        """The engine that trains ``trained`` with this role's objective."""
        raise NotImplementedError

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on the batch (this rank's rows); its metrics in the output."""
        output = self.objective.train_batch(data, seed=self.seed + int(data.meta_info[GLOBAL_STEP]))
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        metrics["perf/worker_rss_gb"] = resident_gb()
        return output

    @register(dispatch_mode=mesh_compute_proto(SUPERVISED_MESH))
    def evaluate(self, data: DataProto) -> DataProto:
        """The objective's per-row measures of held-out rows (its engine's ``evaluate``)."""
        return self.objective.evaluate(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        trained = self.objective.trained
        save_policy_state(Path(directory) / ACTOR_STATE, trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.objective.trained, self.rank)
