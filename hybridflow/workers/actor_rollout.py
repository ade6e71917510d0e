"""The actor: ``ActorWorker`` trains with FSDP2 (and tensor parallelism); ``ActorRolloutWorker``, the hybrid
actor, also generates in the same process, on the same devices.

Two layouts over the same ranks (hybrid_engine/layout.py): training (dp, t) and generation in groups
of tg. ``generate_sequences`` splits prompts over the generation groups and collects one rank of
each; ``compute_log_prob`` / ``update_actor`` split rows over the training dp ranks. The driver sees
neither: dispatch reads the meshes each rank declares. Where the rollout role generates on a pool of
its own (asynchronous modes, workers/rollout.py), the actor is an ``ActorWorker`` and sends it its
new weights (``send_weights``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.batch_keys import BATCH_SCALE, GLOBAL_STEP, METRICS
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.engine.checkpoint import load_training_state
from hybridflow.engine.lora import (
    adapter_tensors,
    adapters_off,
    base_parameters,
    lora_scaling,
    policy_parameters,
)
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.pipeline import held_tensors, whole_parameters
from hybridflow.engine.policy import PolicyEngine
from hybridflow.engine.reference import FrozenPolicyEngine
from hybridflow.hybrid_engine import HybridEngine
from hybridflow.hybrid_engine.layout import ActorLayouts
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.pool_transfer import TransferAddress, TransferReport, host_transfer_store, send_weights
from hybridflow.hybrid_engine.transfer_plan import ParamSpec, adapter_transfer_params, transfer_params
from hybridflow.hybrid_engine.transfer_setup import TransferSetup
from hybridflow.models import load_causal_lm, load_tokenizer, parse_dtype
from hybridflow.procfs import resident_gb
from hybridflow.protocol import DataProto
from hybridflow.run_files import ACTOR_STATE
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.generation import build_generator, call_sampling
from hybridflow.workers.sharded_model import RoleMeshes, build_trainable, save_policy_state

TRAIN_MESH = "actor_train"  # the training rows (RoleMeshes.rows): compute_log_prob and update_actor split them over dp
GENERATE_MESH = "actor_generate"  # the generation layout: generate_sequences splits prompts over its dp


class ActorWorker(Worker):
    """The actor that trains. model_path: the policy's model directory; layout: the actor's (dp, t) over this
    group's ranks (from the run plan)."""

    def __init__(
        self,
        *,
        config: ActorRolloutRefConfig,
        model_path: str,
        layout: LayoutShape,
        mini_batch_per_rank: int,
        total_training_steps: int,
        seed: int,
    ):
        super().__init__()
        self.config = config
        self.seed = seed
        self.mini_batch_per_rank = mini_batch_per_rank  # samples per optimizer step on this rank (the run plan's)
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        # training: t ranks split each layer and see the same rows, FSDP2 over the dp ranks;
        # generation (the hybrid actor's): groups of tg ranks split each layer and see the same prompts
        self.layouts = ActorLayouts.build(self.device, layout)
        meshes = RoleMeshes.build(self.device, layout, self.layouts.training)
        self.register_dispatch_mesh(TRAIN_MESH, meshes.rows)
        trained = build_trainable(
            load_causal_lm,
            model_path,
            config.model,
            config.actor.fsdp,
            config.actor.optim,
            self.device,
            seed,
            total_training_steps,
            meshes.training,
            config.actor.virtual_pipeline_model_parallel_size,
            expert_parallel=layout.ep,
        )
        self.actor = PolicyEngine(trained, config.actor, dp_group=meshes.dp_group, sp_group=meshes.sp_group)
        # LoRA: the reference policy is this model with its adapters off (no second copy of the weights)
        self.reference = None
        if config.model.lora.enabled:
            self.reference = FrozenPolicyEngine(trained.model, config.ref, sp_group=meshes.sp_group)
        self.generation_dtype = parse_dtype(config.rollout.dtype, self.device)  # what generation weights are in

    # ---- the weight transfer to a rollout role on its own pool (asynchronous modes) ----------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def transfer_endpoint(self) -> TransferAddress | None:
        """Rank 0 hosts the rendezvous of the group spanning both pools; its address (None elsewhere)."""
        if self.rank != 0:
            return None
        self.transfer_store, address = host_transfer_store()
        return address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def transfer_params(self) -> tuple[list[ParamSpec], list[ParamSpec], float]:
        """What transfers move (the same on every rank): the weights (names, full shapes, split dimensions);
        a LoRA model's adapters and their scaling (else [] and 0), all that moves after its first transfer."""
        model = self.actor.model
        scaling = lora_scaling(model)
        if scaling is None:
            return transfer_params(model), [], 0.0
        return transfer_params(model), adapter_transfer_params(model), scaling

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_transfer(self, setup: TransferSetup) -> None:
        self.transfer_plan = setup.plan(self.generation_dtype)
        self.adapter_plan = setup.adapter_plan(self.generation_dtype)
        self.base_sent = False  # a LoRA model's base goes once, with the first transfer
        store = getattr(self, "transfer_store", None)  # rank 0's
        self.transfer = setup.join(actor_side=True, rank=self.rank, device=self.device, store=store)
        self.transfer_timeout = setup.timeout_s

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self) -> TransferReport:
        """Send this rank's slices of the current weights to the rollout's ranks (every rank takes part): all
        of them, or a LoRA model's adapters (its base too the first time); in pipeline stages, its stages'."""
        model = self.actor.model

        def send(produce, plan) -> TransferReport:
            named = list(held_tensors(model, produce))
            return send_weights(named, self.generation_dtype, plan, self.transfer, timeout=self.transfer_timeout)

        if self.adapter_plan is None:
            return send(policy_parameters, self.transfer_plan)
        report = TransferReport()
        if not self.base_sent:
            report = send(base_parameters, self.transfer_plan)
            self.base_sent = True
        return report.add(send(adapter_tensors, self.adapter_plan))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained weights gathered from the shards (fp32, on CPU) on rank 0; every rank takes part."""
        weights = {name: tensor.detach().cpu().clone() for name, tensor in whole_parameters(self.actor.model)}
        return weights if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """The actor's training state under ``directory/actor``, plus its HF config and tokenizer for export."""
        save_policy_state(Path(directory) / ACTOR_STATE, self.actor.trained, self.rank, self.tokenizer, self.model_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(Path(directory) / ACTOR_STATE, self.actor.trained, self.rank)

    @register(dispatch_mode=mesh_compute_proto(TRAIN_MESH))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs and entropys (B, R)."""
        return self.actor.compute_log_prob(data, self.config.rollout.temperature, with_entropy=True)

    @register(dispatch_mode=mesh_compute_proto(TRAIN_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (B, R) of a LoRA actor: the base model's, its adapters off (RefPolicyWorker's otherwise)."""
        if self.reference is None:
            raise RuntimeError("the actor computes reference log-probs only with LoRA on (model.lora.rank > 0)")
        with adapters_off(self.actor.model):
            return self.reference.compute_log_prob(data, self.config.rollout.temperature)

    @register(dispatch_mode=mesh_compute_proto(TRAIN_MESH))
    def update_actor(self, data: DataProto) -> DataProto:
        """The policy update; its metrics in the output. Given a batch without old_log_probs (an
        on-policy step, or the bypass mode: the rollout's log-probs as the old policy), the log-probs
        and entropy of each row's first forward come back too (PolicyEngine.update_policy)."""
        step = int(data.meta_info[GLOBAL_STEP])
        temperature = self.config.rollout.temperature
        mini_batch = self.mini_batch_per_rank * int(data.meta_info.get(BATCH_SCALE, 1))  # a batch grown by branches
        output = self.actor.update_policy(data, mini_batch, temperature, seed=self.seed + step)
        metrics = output.meta_info[METRICS]
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)  # the step's peak: reset when it generated
        metrics["perf/worker_rss_gb"] = resident_gb()  # what the process holds between steps (mean over ranks)
        return output


class ActorRolloutWorker(ActorWorker):
    """The hybrid actor: trains, and generates on the same ranks (HybridEngine switches the weights).
    tool_config, default_agent: the multi-turn files as absolute paths (from the run plan)."""

    def __init__(
        self,
        *,
        config: ActorRolloutRefConfig,
        model_path: str,
        layout: LayoutShape,
        tool_config: str,
        default_agent: str,
        mini_batch_per_rank: int,
        total_training_steps: int,
        seed: int,
    ):
        super().__init__(
            config=config,
            model_path=model_path,
            layout=layout,
            mini_batch_per_rank=mini_batch_per_rank,
            total_training_steps=total_training_steps,
            seed=seed,
        )
        self.generation_coord = self.register_dispatch_mesh(GENERATE_MESH, self.layouts.generation)
        self.rollout = build_generator(
            model_path,
            self.tokenizer,
            config.rollout,
            dtype=self.generation_dtype,
            device=self.device,
            group=self.layouts.generation_group,
            stage_group=self.layouts.generation_stage_group,
            tool_config=tool_config,
            default_agent=default_agent,
        )
        self.hybrid = HybridEngine(
            self.actor.trained,
            self.rollout,
            self.device,
            param_offload=config.actor.param_offload,
            optimizer_offload=config.actor.optimizer_offload,
            dtype=self.generation_dtype,
            shape=layout,
            gather_group=self.layouts.gather_group,
            stage_gather_group=self.layouts.stage_gather_group,
        )

    @register(dispatch_mode=mesh_compute_proto(GENERATE_MESH))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Switch to generation, generate, switch back (see HybridEngine); the switch's metrics in the output.
        Every rank of a generation group gets the same prompts; one of them is collected."""
        sampling = call_sampling(self.config.rollout, prompts.meta_info, self.generation_coord)
        return self.hybrid.generate(prompts, sampling)
