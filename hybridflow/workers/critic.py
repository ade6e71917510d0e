"""The critic: a value head on the policy's backbone, trained on the returns."""

from __future__ import annotations

from pathlib import Path

from hybridflow.batch_keys import BATCH_SCALE, GLOBAL_STEP
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state, save_training_state
from hybridflow.engine.config import CriticConfig
from hybridflow.engine.critic import CriticEngine
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_critic
from hybridflow.protocol import DataProto
from hybridflow.run_files import CRITIC_STATE
from hybridflow.workers.sharded_model import RoleMeshes, build_trainable

CRITIC_MESH = "critic"  # the critic's rows (RoleMeshes.rows): compute_values and update_critic split them over dp


class CriticWorker(Worker):
    """model_path: the critic's model directory; layout: its (dp, t) over this group's ranks (the run plan's)."""

    def __init__(
        self,
        *,
        config: CriticConfig,
        model_path: str,
        layout: LayoutShape,
        mini_batch_per_rank: int,
        total_training_steps: int,
        seed: int,
    ):
        super().__init__()
        self.config = config
        self.mini_batch_per_rank = mini_batch_per_rank  # samples per optimizer step on this rank (the run plan's)
        self.seed = seed
        meshes = RoleMeshes.build(self.device, layout)
        self.register_dispatch_mesh(CRITIC_MESH, meshes.rows)
        trained = build_trainable(
            load_critic,
            model_path,
            config.model,
            config.fsdp,
            config.optim,
            self.device,
            seed,
            total_training_steps,
            meshes.training,
            config.virtual_pipeline_model_parallel_size,
            expert_parallel=layout.ep,
        )
        self.critic = CriticEngine(trained, config, dp_group=meshes.dp_group, sp_group=meshes.sp_group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        save_training_state(Path(directory) / CRITIC_STATE, self.critic.trained, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / CRITIC_STATE, self.critic.trained, self.rank)

    @register(dispatch_mode=mesh_compute_proto(CRITIC_MESH))
    def compute_values(self, data: DataProto) -> DataProto:
        """values (B, R)."""
        return self.critic.compute_values(data)

    @register(dispatch_mode=mesh_compute_proto(CRITIC_MESH))
    def update_critic(self, data: DataProto) -> DataProto:
        """The value update; its metrics in the output (no tensors)."""
        step = int(data.meta_info[GLOBAL_STEP])
        mini_batch = self.mini_batch_per_rank * int(data.meta_info.get(BATCH_SCALE, 1))  # a batch grown by branches
        return self.critic.update_critic(data, mini_batch, seed=self.seed + step)
