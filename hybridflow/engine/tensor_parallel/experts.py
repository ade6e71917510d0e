"""Tensor parallelism over a mixture's experts in training: each of a group's tp ranks holds E / tp experts whole
(the split generation uses too, models/tensor_parallel.py ``LayerSplit.experts``), runs them on the (token, choice)
pairs routed to them, and one all-reduce sums the experts' outputs, as a row-parallel layer's partial sums are summed.

The tp ranks hold the same tokens and route them alike (the router is whole on each rank). Megatron's two functions
bound the split region: its inputs (the tokens' states and routing weights) enter through the identity whose backward
sums the ranks' gradients (each rank's reach them through its own experts only), and its output leaves through the
all-reduce whose backward is the identity. An expert weight becomes a DTensor on the tp mesh, placement Shard(0), which
FSDP2 shards further over dp: checkpoints, the gradient norm and the switch to generation read it as any
tensor-parallel weight.

LoRA on the experts (peft's ``target_parameters``): peft's B interleaves the experts in its columns, so the adapters
stay whole on every tp rank. Each rank adds its own experts' scaling · B_e A_e, the factors entering through the same
identity: their gradients are summed over the group, the same on every rank, as a whole parameter's must be.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hybridflow.engine.expert_parallel import check_experts, held_experts_output
from hybridflow.engine.lora import expert_adapter_delta, expert_adapters
from hybridflow.models.routing import EXPERT_WEIGHTS, experts_modules


class _IntoSplit(torch.autograd.Function):
    """The identity; its backward sums the gradient over the tp ranks (``group``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _OutOfSplit(torch.autograd.Function):
    """The sum over the tp ranks (``group``); its backward is the identity."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        whole = partial.contiguous().clone()
        dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tensor_parallel_experts_forward(
    experts: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    tp_mesh: DeviceMesh,
    adapters: Mapping[str, nn.Module],
) -> torch.Tensor:
    """The experts' output (T, H) for the group's tokens ``hidden`` (T, H), each routed to its ``top_k_index``
    experts with ``top_k_weights`` (T, k): see the module docstring. ``adapters``: peft's wrapper of each adapted
    expert weight, by the weight's name."""
    group = tp_mesh.get_group()
    hidden, top_k_weights = _IntoSplit.apply(hidden, group), _IntoSplit.apply(top_k_weights, group)
    count = experts.gate_up_proj.to_local().shape[0]  # experts on each rank
    first = tp_mesh.get_local_rank() * count
    gate_up, down = (_held_weight(experts, name, adapters.get(name), first, group) for name in EXPERT_WEIGHTS)
    chosen = top_k_index.reshape(-1)  # (T·k,): pair p is token p // k's choice p % k
    held = torch.nonzero((chosen >= first) & (chosen < first + count)).squeeze(-1)  # the pairs for this rank
    tokens = held // top_k_index.shape[1]
    outputs = held_experts_output(experts, hidden[tokens], chosen[held] - first, gate_up, down)
    weights = top_k_weights.reshape(-1)[held].to(outputs.dtype)
    partial = torch.zeros_like(hidden).index_add(0, tokens, outputs * weights[:, None])
    return _OutOfSplit.apply(partial, group)


def _held_weight(
    experts: nn.Module, name: str, adapter: nn.Module | None, first: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's experts of the weight ``name``, their adapters' products added."""
    held = getattr(experts, name).to_local()
    delta = None
    if adapter is not None:
        delta = expert_adapter_delta(adapter, first, held.shape[0], shared=lambda t: _IntoSplit.apply(t, group))
    return held if delta is None else held + delta.to(held.dtype)


def split_experts(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the experts of a decoder ``layer`` over ``tp_mesh`` (in place): each rank keeps its E / tp experts of
    every expert weight (Shard(0)), and the experts' forward becomes ``tensor_parallel_experts_forward``. The weights
    must be the same on every rank (loaded from one directory)."""
    tp = tp_mesh.size()
    for block in layer.modules():
        called = getattr(block, "experts", None)
        if not isinstance(called, nn.Module):
            continue
        module, adapters = expert_adapters(called)
        if module not in experts_modules(module):
            raise ValueError(f"{type(module).__name__}: no fused 3-D expert weights to split over {tp} ranks")
        check_experts(module, tp, "tensor parallel size")
        for name in EXPERT_WEIGHTS:
            whole = getattr(module, name)
            split = distribute_tensor(whole.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(split, requires_grad=whole.requires_grad))
        called.forward = _bound_forward(module, tp_mesh, adapters)


def _bound_forward(module: nn.Module, tp_mesh: DeviceMesh, adapters: Mapping[str, nn.Module]):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_experts_forward(module, hidden_states, top_k_index, top_k_weights, tp_mesh, adapters)

    return forward
