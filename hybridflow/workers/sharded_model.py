"""Building a role's model the same way everywhere: load, optional checkpointing, FSDP2 shard, optimizer."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.engine.config import FSDPConfig, ModelConfig
from hybridflow.engine.fsdp import data_parallel_mesh, shard_model
from hybridflow.engine.optim import OptimConfig, TrainedModel
from hybridflow.engine.tensor_parallel import apply_tensor_parallel, training_mesh
from hybridflow.models.loading import enable_activation_checkpointing


def quiet_libraries() -> None:
    """Worker processes print what matters: no per-load weight reports or known-harmless warnings."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def build_sharded(
    load: Callable[..., nn.Module],
    model: ModelConfig,
    fsdp: FSDPConfig,
    device: torch.device,
    seed: int,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Load, then shard: over all ranks (FSDP2), or on a (dp, tp) ``mesh`` tensor parallelism inside
    each tp group and FSDP2 over dp."""
    quiet_libraries()
    torch.manual_seed(seed)  # heads that are freshly initialised come out the same on every rank
    module = load(model.path, dtype=torch.float32)
    if model.enable_gradient_checkpointing:
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    module = module.to(device)
    if mesh is None:
        return shard_model(module, data_parallel_mesh(device), fsdp)
    apply_tensor_parallel(module, mesh["tp"])
    return shard_model(module, mesh["dp"], fsdp)


def build_trainable(
    load: Callable[..., nn.Module],
    model: ModelConfig,
    fsdp: FSDPConfig,
    optim: OptimConfig,
    device: torch.device,
    seed: int,
    total_steps: int,
    mesh: DeviceMesh | None = None,
) -> TrainedModel:
    """``build_sharded``, with AdamW and its learning-rate schedule over ``total_steps`` training steps."""
    return TrainedModel.build(build_sharded(load, model, fsdp, device, seed, mesh), optim, total_steps)


def role_mesh(device: torch.device, world_size: int, tp: int, key: str) -> DeviceMesh:
    """A role's (dp, tp) training mesh over its ``world_size`` ranks; ``key`` names the setting in errors."""
    if world_size % tp:
        raise ValueError(f"{key}={tp} does not divide the role's {world_size} ranks")
    return training_mesh(device, world_size // tp, tp)


def samples_per_rank(prompts: int, n: int, world_size: int, what: str) -> int:
    samples = prompts * n
    if samples % world_size:
        raise ValueError(f"{what}: {prompts} prompts x {n} samples = {samples} does not divide over {world_size} ranks")
    return samples // world_size
