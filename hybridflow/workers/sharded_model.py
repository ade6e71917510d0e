"""Building a role's model the same way everywhere: load, optional checkpointing, FSDP2 shard, optimizer."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.engine.checkpoint import save_training_state
from hybridflow.engine.config import FSDPConfig, TrainedModelConfig
from hybridflow.engine.expert_parallel import apply_expert_parallel, expert_mesh
from hybridflow.engine.fsdp import data_parallel_mesh, shard_model
from hybridflow.engine.fused_modules import fuse_elementwise
from hybridflow.engine.lora import LoraConfig, apply_lora, lora_scaling, save_adapter_config
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.pipeline import PIPELINE_DIM, build_pipelined, pipeline_mesh
from hybridflow.engine.sequence_parallel import row_mesh
from hybridflow.engine.tensor_parallel import apply_tensor_parallel, training_mesh
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models.dtypes import parse_dtype
from hybridflow.models.loading import enable_activation_checkpointing
from hybridflow.run_files import ADAPTER_FILES, HF_FILES


def quiet_libraries() -> None:
    """Worker processes print what matters: no per-load weight reports or known-harmless warnings."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@dataclass(frozen=True)
class RoleMeshes:
    """A trained or scored role's meshes over its ranks: ``training`` (dp x sp, t), which FSDP2 and tensor parallelism
    shard the model over (with pipeline stages (dp x sp, pp, t), whose pp ranks hold the same rows), and ``rows``,
    which dispatch splits the rows over along its "dp" dimension: the training mesh itself, or under Ulysses
    (dp, sp[, pp][, tp]) over the same ranks, whose sp ranks hold the same rows (and, with tp, the same heads, and with
    pp, the same stages) and split each micro-batch's tokens."""

    training: DeviceMesh
    rows: DeviceMesh

    @classmethod
    def build(cls, device: torch.device, layout: LayoutShape, training: DeviceMesh | None = None) -> RoleMeshes:
        """Every rank of the group calls this alike (it creates process groups); ``training``: one already built."""
        if training is None and layout.pp > 1:
            training = pipeline_mesh(device, layout.fsdp, layout.pp, layout.t)
        elif training is None:
            training = training_mesh(device, layout.fsdp, layout.t)
        rows = training if layout.sp == 1 else row_mesh(device, layout.dp, layout.sp, layout.t, layout.pp)
        return cls(training=training, rows=rows)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that split the rows (tensor- and sequence-parallel peers hold the same ones)."""
        return self.rows["dp"].get_group()

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The ranks that split each micro-batch's tokens (None: no sequence parallelism)."""
        return self.rows["sp"].get_group() if "sp" in (self.rows.mesh_dim_names or ()) else None


def build_sharded(
    load: Callable[..., nn.Module],
    path: str,
    fsdp: FSDPConfig,
    device: torch.device,
    seed: int,
    mesh: DeviceMesh | None = None,
    *,
    gradient_checkpointing: bool = False,
    lora: LoraConfig | None = None,
    stages_per_rank: int = 1,
    expert_parallel: int = 1,
) -> nn.Module:
    """Load the model directory ``path`` (the run plan's), then shard: over all ranks (FSDP2), or on a
    (dp, tp) ``mesh`` tensor parallelism inside each tp group and FSDP2 over dp; on a (dp, pp, tp) mesh split into
    pipeline stages first, ``stages_per_rank`` on each pp rank (above 1: the interleaved 1F1B schedule), each stage
    sharded so. With ``lora`` enabled the model gets peft's adapters first, its frozen base kept in the compute dtype
    (no fp32 master copy). ``expert_parallel`` > 1 (data parallelism alone): each MoE layer's experts split over
    that many ranks (engine/expert_parallel.py), the rest sharded by FSDP2 over all ranks."""
    quiet_libraries()
    torch.manual_seed(seed)  # heads that are freshly initialised come out the same on every rank
    module = load(path, dtype=torch.float32)
    if device.type == "cpu":
        fuse_elementwise(module)  # the same numbers, faster (engine/fused_modules.py)
    if gradient_checkpointing:
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    if lora is not None and lora.enabled:
        module = apply_lora(module, lora, frozen_dtype=parse_dtype(fsdp.param_dtype, device))
    module = module.to(device)
    if expert_parallel > 1:
        if mesh is not None and (PIPELINE_DIM in (mesh.mesh_dim_names or ()) or mesh["tp"].size() > 1):
            raise ValueError("expert parallelism runs on data-parallel ranks alone (no tensor or pipeline split)")
        dp_mesh = data_parallel_mesh(device) if mesh is None else mesh["dp"]
        experts = apply_expert_parallel(module, expert_mesh(device, dp_mesh.size(), expert_parallel))
        # FSDP2 through the process group, not shared memory (engine/host_collectives.py), whose buffers assume ranks
        # at most one collective apart: with the experts' all-to-alls between them, tests/engine/test_expert_parallel.py
        # hung in 2 of 8 runs with them and in none of 12 without
        return shard_model(module, dp_mesh, dataclasses.replace(fsdp, host_collectives=False), ignored=experts)
    if mesh is None:
        return shard_model(module, data_parallel_mesh(device), fsdp)

    pipelined = PIPELINE_DIM in (mesh.mesh_dim_names or ())
    # the shared-memory collectives keep two buffers, for ranks at most one collective apart: the interleaved
    # schedule gathers several stages ahead (engine/host_collectives.py), so stages reduce through the process group
    stage_fsdp = dataclasses.replace(fsdp, host_collectives=False) if pipelined else fsdp

    def shard(part: nn.Module) -> nn.Module:
        apply_tensor_parallel(part, mesh["tp"])
        return shard_model(part, mesh["dp"], stage_fsdp)

    if not pipelined:
        return shard(module)
    activations = parse_dtype(fsdp.param_dtype, device)
    return build_pipelined(module, mesh, shard, stages_per_rank=stages_per_rank, activation_dtype=activations)


def build_trainable(
    load: Callable[..., nn.Module],
    path: str,
    model: TrainedModelConfig,
    fsdp: FSDPConfig,
    optim: OptimConfig,
    device: torch.device,
    seed: int,
    total_steps: int,
    mesh: DeviceMesh | None = None,
    stages_per_rank: int = 1,
    expert_parallel: int = 1,
) -> TrainedModel:
    """``build_sharded`` (``model``: its gradient checkpointing and LoRA), with AdamW over the trainable
    parameters and its learning-rate schedule over ``total_steps`` training steps."""
    sharded = build_sharded(
        load,
        path,
        fsdp,
        device,
        seed,
        mesh,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        lora=model.lora,
        stages_per_rank=stages_per_rank,
        expert_parallel=expert_parallel,
    )
    return TrainedModel.build(sharded, optim, total_steps)


def save_policy_state(target: Path, trained: TrainedModel, rank: int, tokenizer: Any, model_path: str) -> None:
    """A trained model's checkpoint (a causal LM, or a reward model) under ``target`` (every rank takes part): its
    training state, and on rank 0 its HF config, generation config (a causal LM's) and tokenizer, and a LoRA
    model's adapter settings naming its base model ``model_path``: all that ``hybridflow export`` needs to write a
    model directory."""
    save_training_state(target, trained, rank)
    if rank != 0:
        return
    model = trained.model
    model.config.save_pretrained(target / HF_FILES)
    generation = getattr(model, "generation_config", None)  # a sequence classifier (a reward model) has none
    if generation is not None:
        generation.save_pretrained(target / HF_FILES)
    tokenizer.save_pretrained(target / HF_FILES)
    if lora_scaling(model) is not None:  # the adapters' settings and base model, for an export
        save_adapter_config(model, model_path, target / ADAPTER_FILES)
