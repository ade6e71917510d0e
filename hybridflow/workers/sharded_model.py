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
from hybridflow.engine.tensor_parallel import apply_tensor_parallel
from hybridflow.models.loading import enable_activation_checkpointing


def quiet_libraries() -> None:
    """Worker processes print what matters: no per-load weight reports or known-harmless warnings."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def build_sharded(
    load: Callable[..., nn.Module],
    path: str,
    fsdp: FSDPConfig,
    device: torch.device,
    seed: int,
    mesh: DeviceMesh | None = None,
    *,
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """Load the model directory ``path`` (the run plan's), then shard: over all ranks (FSDP2), or on a
    (dp, tp) ``mesh`` tensor parallelism inside each tp group and FSDP2 over dp."""
    quiet_libraries()
    torch.manual_seed(seed)  # heads that are freshly initialised come out the same on every rank
    module = load(path, dtype=torch.float32)
    if gradient_checkpointing:
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    module = module.to(device)
    if mesh is None:
        return shard_model(module, data_parallel_mesh(device), fsdp)
    apply_tensor_parallel(module, mesh["tp"])
    return shard_model(module, mesh["dp"], fsdp)


def build_trainable(
    load: Callable[..., nn.Module],
    path: str,
    model: ModelConfig,
    fsdp: FSDPConfig,
    optim: OptimConfig,
    device: torch.device,
    seed: int,
    total_steps: int,
    mesh: DeviceMesh | None = None,
) -> TrainedModel:
    """``build_sharded`` (``model``: its gradient checkpointing), with AdamW and its learning-rate schedule
    over ``total_steps`` training steps."""
    sharded = build_sharded(
        load, path, fsdp, device, seed, mesh, gradient_checkpointing=model.enable_gradient_checkpointing
    )
    return TrainedModel.build(sharded, optim, total_steps)


def samples_per_rank(prompts: int, n: int, world_size: int, what: str) -> int:
    samples = prompts * n
    if samples % world_size:
        raise ValueError(f"{what}: {prompts} prompts x {n} samples = {samples} does not divide over {world_size} ranks")
    return samples // world_size
