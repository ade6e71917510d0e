"""The supervised fine-tuning role: a causal LM trained with FSDP2 (and tensor parallelism) on labelled tokens.

Rows split over the data-parallel ranks of its (dp, t) layout, as the actor's do; its checkpoints have the
actor's layout (``actor/``: training state, HF config, tokenizer, LoRA adapter settings), so ``hybridflow
export`` writes a model directory from either, and a GRPO run starts from that directory.
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
from hybridflow.engine.sft import SFTEngine
from hybridflow.engine.tensor_parallel import training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.sharded_model import build_trainable, save_policy_state

SFT_MESH = "sft"  # the (dp, tp) layout: train_batch and evaluate split rows over dp


class SFTWorker(Worker):
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
        self.register_dispatch_mesh(SFT_MESH, mesh)
        trained = build_trainable(
            load_causal_lm, model_path, model, engine.fsdp, optim, self.device, seed, total_training_steps, mesh
        )
        self.sft = SFTEngine(trained, engine, optim, dp_group=mesh["dp"].get_group())

    @register(dispatch_mode=mesh_compute_proto(SFT_MESH))
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on the batch (this rank's rows); its metrics in the output."""
        output = self.sft.train_batch(data, seed=self.seed + int(data.meta_info[GLOBAL_STEP]))
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)
        metrics["perf/worker_rss_gb"] = resident_gb()
        return output

    @register(dispatch_mode=mesh_compute_proto(SFT_MESH))
    def evaluate(self, data: DataProto) -> DataProto:
        """Each row's summed negative log-likelihood and trained-token count (engine/sft.py)."""
        return self.sft.evaluate(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        save_policy_state(Path(directory) / ACTOR_STATE, self.sft.trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.sft.trained, self.rank)
