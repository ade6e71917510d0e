"""The hybrid actor: trains with FSDP2 and generates in the same process, on the same devices.

Two layouts over the same ranks (hybrid_engine/layout.py): training (dp, t) and generation in groups
of tg. ``generate_sequences`` splits prompts over the generation groups and collects one rank of
each; ``compute_log_prob`` / ``update_actor`` split rows over the training dp ranks. The driver sees
neither: dispatch reads the meshes each rank declares.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.batch_keys import GLOBAL_STEP, METRICS, SAMPLING, SAMPLING_ROUND
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state, save_training_state
from hybridflow.engine.fsdp import full_parameters
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.policy import PolicyEngine
from hybridflow.hybrid_engine import HybridEngine
from hybridflow.hybrid_engine.layout import ActorLayouts
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.rollout.build import build_rollout
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.run_files import ACTOR_STATE, HF_FILES
from hybridflow.tools import load_tools
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.sharded_model import build_trainable, samples_per_rank

TRAIN_MESH = "actor_train"  # the (dp, tp) training layout: compute_log_prob and update_actor split rows over dp
GENERATE_MESH = "actor_generate"  # the generation layout: generate_sequences splits prompts over its dp


class ActorRolloutWorker(Worker):
    """model_path: the policy's model directory; layout: the actor's (dp, t, tg) over this group's ranks;
    tool_config, default_agent: the multi-turn files as absolute paths (all from the run plan)."""

    def __init__(
        self,
        *,
        config: ActorRolloutRefConfig,
        model_path: str,
        layout: LayoutShape,
        tool_config: str,
        default_agent: str,
        total_training_steps: int,
        seed: int,
    ):
        super().__init__()
        self.config = config
        self.seed = seed
        self.tokenizer = load_tokenizer(model_path)
        # training: t ranks split each layer and see the same rows, FSDP2 over the dp ranks;
        # generation: groups of tg ranks split each layer and see the same prompts
        self.layouts = ActorLayouts.build(self.device, layout)
        mesh = self.layouts.training
        self.register_dispatch_mesh(TRAIN_MESH, mesh)
        self.generation_coord = self.register_dispatch_mesh(GENERATE_MESH, self.layouts.generation)
        self.dp_size = mesh["dp"].size()
        trained = build_trainable(
            load_causal_lm,
            model_path,
            config.model,
            config.actor.fsdp,
            config.actor.optim,
            self.device,
            seed,
            total_training_steps,
            mesh,
        )
        self.actor = PolicyEngine(trained, config.actor, dp_group=mesh["dp"].get_group())
        generation_dtype = parse_dtype(config.rollout.dtype, self.device)
        generator = load_causal_lm(model_path, dtype=generation_dtype).to(self.device)
        tools = load_tools(tool_config) if config.rollout.multi_turn.enable and tool_config else None
        self.rollout = build_rollout(
            generator,
            self.tokenizer,
            config.rollout,
            self.layouts.generation_group,
            tools=tools,
            default_agent=default_agent,
        )
        del generator  # the rollout keeps its own copy (1/tg of the weights)
        self.hybrid = HybridEngine(
            trained,
            self.rollout,
            self.device,
            param_offload=config.actor.param_offload,
            optimizer_offload=config.actor.optimizer_offload,
            dtype=generation_dtype,
            shape=layout,
            gather_group=self.layouts.gather_group,
        )

    def _sampling(self, meta_info: dict) -> SamplingParams:
        """The call's settings: training (rollout.*), validation (rollout.val_kwargs) or greedy (ReMax's baseline)."""
        cfg = self.config.rollout
        # the generation group's index (its ranks sample alike); dynamic sampling's round r of a step samples
        # as groups r·G .. r·G+G-1 would: seeds stay distinct
        groups = self.generation_coord.dp_size
        rank = self.generation_coord.dp_rank + int(meta_info.get(SAMPLING_ROUND, 0)) * groups
        seed = cfg.sampling_seed(step=int(meta_info[GLOBAL_STEP]), rank=rank)
        sampling = meta_info[SAMPLING]
        if sampling == "greedy":
            return SamplingParams.greedy(max_new_tokens=cfg.response_length, seed=seed)
        source = cfg.val_kwargs if sampling == "validate" else cfg
        return SamplingParams.from_config(source, max_new_tokens=cfg.response_length, seed=seed)

    @register(dispatch_mode=mesh_compute_proto(GENERATE_MESH))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Switch to generation, generate, switch back (see HybridEngine); the switch's metrics in the output.
        Every rank of a generation group gets the same prompts; one of them is collected."""
        return self.hybrid.generate(prompts, self._sampling(prompts.meta_info))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained weights gathered from the shards (fp32, on CPU) on rank 0; every rank takes part."""
        weights = {name: tensor.detach().cpu().clone() for name, tensor in full_parameters(self.actor.model)}
        return weights if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """The actor's training state under ``directory/actor``, plus its HF config and tokenizer for export."""
        target = Path(directory) / ACTOR_STATE
        save_training_state(target, self.actor.trained, self.rank)
        if self.rank == 0:
            self.actor.model.config.save_pretrained(target / HF_FILES)
            self.actor.model.generation_config.save_pretrained(target / HF_FILES)
            self.tokenizer.save_pretrained(target / HF_FILES)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.actor.trained, self.rank)

    @register(dispatch_mode=mesh_compute_proto(TRAIN_MESH))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs and entropys (B, R)."""
        return self.actor.compute_log_prob(data, self.config.rollout.temperature, with_entropy=True)

    @register(dispatch_mode=mesh_compute_proto(TRAIN_MESH))
    def update_actor(self, data: DataProto) -> DataProto:
        """The policy update; its metrics in the output. Given a batch without old_log_probs (an
        on-policy step, or the bypass mode: the rollout's log-probs as the old policy), the log-probs
        and entropy of each row's first forward come back too (PolicyEngine.update_policy)."""
        cfg = self.config
        mini_batch = samples_per_rank(
            cfg.actor.ppo_mini_batch_size, cfg.rollout.n, self.dp_size, "actor.ppo_mini_batch_size"
        )
        step = int(data.meta_info[GLOBAL_STEP])
        output = self.actor.update_policy(data, mini_batch, cfg.rollout.temperature, seed=self.seed + step)
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)  # the step's peak: reset when it generated
        metrics["perf/worker_rss_gb"] = resident_gb()  # what the process holds between steps (mean over ranks)
        return output
