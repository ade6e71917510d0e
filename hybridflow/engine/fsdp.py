"""FSDP2 wrapping, kept apart from the model code: each decoder layer, then the root, is one shard unit."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybridflow.engine.config import FSDPConfig
from hybridflow.engine.host_collectives import use_host_collectives
from hybridflow.engine.lora import policy_buffers, policy_parameters
from hybridflow.models.dtypes import parse_dtype


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


class AbsentLayer(nn.Module):
    """A decoder layer that another pipeline stage holds (engine/pipeline.py): passes the hidden states through."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model (the natural FSDP units); a pipeline stage's own only."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            present = [layer for layer in module if not isinstance(layer, AbsentLayer)]
            if present and "Layer" in type(present[0]).__name__:
                return present
    return []


def shard_model(
    model: nn.Module, mesh: DeviceMesh, config: FSDPConfig, ignored: set[nn.Parameter] | None = None
) -> nn.Module:
    """Shard parameters over ``mesh`` (fp32 masters); forward and backward run in ``param_dtype``. ``ignored``:
    parameters laid out otherwise, which FSDP2 neither shards nor casts nor reduces (expert-parallel weights)."""
    policy = MixedPrecisionPolicy(
        param_dtype=parse_dtype(config.param_dtype, torch.device(mesh.device_type)),
        reduce_dtype=parse_dtype(config.reduce_dtype),
    )
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    if config.host_collectives and mesh.device_type == "cpu":
        use_host_collectives([*layers, model], mesh.get_group())
    return model


def keeps_gathered_weights(reshard_after_forward: bool | None, device: torch.device) -> bool:
    """Whether an update keeps FSDP2's gathered weights from forward to backward (``gathered_through_backward``):
    the setting's opposite, or, where it is null, on CPU. There the gathered copy (2 bytes a parameter in bf16) is small
    beside what a rank holds for each parameter it trains anyway (the fp32 weight, its gradient and AdamW's two
    moments), while gathering and casting every weight again before its backward is a pass over all of them (about
    4 % of a one-rank update of SmolLM2-135M on the AMX host). On a GPU memory limits the batch: it reshards."""
    if reshard_after_forward is None:
        return device.type == "cpu"
    return not reshard_after_forward


@contextmanager
def gathered_through_backward(model: nn.Module, keep: bool) -> Iterator[None]:
    """With ``keep``: each FSDP2 unit keeps its gathered weights from its first forward to the end of the block,
    through its backward and the micro-batches after it (they gather nothing: the weights change only at the
    optimizer step, after the block), and everything is resharded on exit; without: FSDP2's default, gather in
    every forward and again in every backward. Gradients are still reduced after each micro-batch's backward, in
    the reduce dtype, so the update is bitwise the same either way. Peak memory is too: a unit that keeps its
    weights from forward to backward holds the whole model gathered when the forward ends anyway."""
    if not keep:
        yield
        return
    # the root unit (first) keeps its weights gathered after forward already (FSDP2's choice for the root)
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for index, unit in enumerate(units):
        if index:
            unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for index, unit in enumerate(units):
            if index:
                unit.set_reshard_after_forward(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.reshard()


def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each parameter and buffer, gathered one at a time on every rank (a LoRA
    model's weights merged, under the plain model's names)."""
    for name, tensor in itertools.chain(policy_parameters(model), policy_buffers(model)):
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> float:
    """The global gradient norm, after scaling the gradients down to ``max_norm`` when above it."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) <= 1:  # one layout (FSDP2 alone): torch's own norm and clipping
        norm = torch.nn.utils.get_total_norm(grads)
        local = norm.full_tensor() if isinstance(norm, DTensor) else norm
        # torch's clip_grad_norm_ multiplies by min(max_norm / (norm + 1e-6), 1): skip its pass over every
        # gradient when that factor is 1 (nothing changes) or not finite (the step is skipped anyway)
        coefficient = torch.clamp(max_norm / (local + 1e-6), max=1.0)
        if bool(coefficient < 1.0):
            scale_local_shards(grads, coefficient)
        return float(local)
    # tensor-parallel layers live on the (dp, tp) mesh, the rest on dp alone: torch cannot stack their
    # norms, so each parameter's norm is reduced on its own mesh (a scalar each) and then combined
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, 2.0)
        squares.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = sum(squares) ** 0.5
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0 and total == total and total != float("inf"):
        scale_local_shards(grads, coefficient)
    return total


@torch.no_grad()
def scale_local_shards(grads: list[torch.Tensor], coefficient: torch.Tensor | float) -> None:
    """Multiply every gradient by ``coefficient`` (a scalar) in place, each DTensor's local shard directly: the
    products DTensor's own multiply (and torch's ``clip_grads_with_norm_``) computes, bit for bit. Through DTensor's
    dispatch the multiply costs a sharding propagation per gradient, 0.27 s the first time an update clips
    SmolLM2-135M's 272 gradients (the GRPO step's second update, docs/log/training.md §44), 0.02 s every time after."""
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coefficient)


def gradient_square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a whole gradient, in float64: a DTensor's local shard's, summed over the mesh
    dimensions that shard it (its copies on the others counted once)."""
    if not isinstance(grad, DTensor):
        return grad.double().pow(2).sum()
    square = grad.to_local().double().pow(2).sum()
    for dim, placement in enumerate(grad.placements):
        if placement.is_shard():
            dist.all_reduce(square, group=grad.device_mesh.get_group(dim))
    return square
