"""Expert parallelism: each mixture-of-experts layer's experts split over ``ep`` data-parallel ranks, tokens sent to
the rank that holds their expert and back by all-to-all.

The data-parallel ranks form an (edp, ep) mesh (``expert_mesh``): ``ep`` consecutive ranks split the experts, rank e
of a group holding experts [e·E/ep, (e+1)·E/ep), and the ranks at one position of every group hold the same experts
(replicas). An expert weight (Hugging Face's fused ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)) becomes a
DTensor on that mesh, placements (Replicate, Shard(0)): checkpoints, exports and the gradient norm read it whole as
they read tensor-parallel weights. FSDP2 leaves these weights alone (``expert_weights`` are its ignored parameters);
the router and every other weight are sharded over all data-parallel ranks as before.

An experts module's forward on this rank's tokens (T, H), with their top-k experts and routing weights (T, k):

1. each (token, choice) pair goes to the rank that holds its expert: the pairs sorted by expert (stable), the counts
   exchanged, the token vectors sent by all-to-all, whose backward is the reverse exchange;
2. the rank runs each of its experts on the rows it received for it (an expert with none runs on zero rows, so that
   every rank joins every collective of the backward);
3. the outputs go back by the reverse all-to-all, are scaled by their routing weights and summed per token.

Gradients: FSDP2 averages a gradient over the dp ranks, and each rank's loss carries the dp size as a factor
(engine/update.py), so a weight's gradient is the batch's. An expert weight's gradient on its rank already sums the
contributions of every token its group sent it; it is summed over the replicas and divided by the dp size in the
backward of the weight's use (``_ReplicaMean``), which gives the same gradient. Forgetting the division is the known
pitfall: expert gradients come out dp times too large.

LoRA on the experts (peft's ``target_parameters``): peft's wrapper adds every expert's B_e A_e to the whole weight,
which no rank holds. Here the wrappers' forward is this one, and a rank adds to the experts it holds their own
scaling · B_e A_e (engine/lora.py ``expert_adapter_delta``). The adapters stay whole, ordinary parameters sharded by
FSDP2 over all data-parallel ranks: a rank's gradient of A_e and B_e comes from the tokens its group sent expert e (zero
where it does not hold e), and FSDP2's mean over the dp ranks is then what ``_ReplicaMean`` gives the expert weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hybridflow.engine.lora import expert_adapter_delta, expert_adapters
from hybridflow.models.routing import EXPERT_WEIGHTS, experts_modules


def expert_mesh(device: torch.device, dp: int, ep: int) -> DeviceMesh:
    """The (edp, ep) mesh over ``dp`` data-parallel ranks: ``ep`` consecutive ranks split the experts."""
    if ep < 1 or dp % ep:
        raise ValueError(f"expert parallel size {ep} must divide the data-parallel size {dp}")
    return init_device_mesh(device.type, (dp // ep, ep), mesh_dim_names=("edp", "ep"))


def check_experts(module: nn.Module, ep: int, what: str = "expert parallel size") -> None:
    """Refuse an experts module this forward does not compute as the family does, or whose experts ``ep`` ranks (of
    ``what``: expert or tensor parallelism) do not split evenly."""
    layout = {
        name: getattr(module, name, None) for name in ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    }
    if layout != {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}:
        raise ValueError(
            f"{type(module).__name__}: a {what} above 1 runs gated experts stored [gate; up] without biases "
            f"(Qwen3-MoE, OLMoE, Mixtral); this one is {layout}"
        )
    experts = module.gate_up_proj.shape[0]
    if experts % ep:
        raise ValueError(f"{type(module).__name__}: {what} {ep} does not divide its {experts} experts")


class _Exchange(torch.autograd.Function):
    """Rows of ``x`` sent to the ranks of ``group``, ``send[i]`` rows to rank i, ``receive[i]`` rows from it; the
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


class _ReplicaMean(torch.autograd.Function):
    """The identity; its backward sums the gradient over the replicas (``group``) and divides it by ``dp``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group: dist.ProcessGroup | None, dp: int) -> torch.Tensor:
        ctx.group, ctx.dp = group, dp
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.dp, None, None


def expert_parallel_forward(
    experts: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    mesh: DeviceMesh,
    adapters: Mapping[str, nn.Module] | None = None,
) -> torch.Tensor:
    """The experts' output (T, H) for this rank's tokens ``hidden`` (T, H): see the module docstring. ``adapters``:
    peft's wrapper of each adapted expert weight, by the weight's name."""
    group, ep = mesh["ep"].get_group(), mesh["ep"].size()
    replicas = mesh["edp"].get_group() if mesh["edp"].size() > 1 else None
    local_gate_up, local_down = (
        _held_weight(experts, name, (adapters or {}).get(name), mesh, replicas) for name in EXPERT_WEIGHTS
    )
    per_rank = local_gate_up.shape[0]  # experts on each rank
    k = top_k_index.shape[1]
    chosen = top_k_index.reshape(-1)  # (T·k,): pair p is token p // k's choice p % k
    order = torch.argsort(chosen, stable=True)  # pairs by expert, so by the rank that holds it
    tokens = order // k  # each sent pair's token
    send = torch.bincount(chosen // per_rank, minlength=ep)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    send_list, receive_list = send.tolist(), receive.tolist()
    rows = _Exchange.apply(hidden[tokens], send_list, receive_list, group)
    # which of this rank's experts each received row is for: the experts' ids travel the same way
    ids = torch.empty(sum(receive_list), dtype=chosen.dtype, device=chosen.device)
    dist.all_to_all_single(ids, chosen[order].contiguous(), receive_list, send_list, group=group)
    local = ids - dist.get_rank(group) * per_rank
    computed = held_experts_output(experts, rows, local, local_gate_up, local_down)
    returned = _Exchange.apply(computed, receive_list, send_list, group)  # in the order the pairs were sent
    weights = top_k_weights.reshape(-1)[order].to(returned.dtype)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, tokens, returned * weights[:, None])


def held_experts_output(
    experts: nn.Module, rows: torch.Tensor, local: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Each of ``rows`` (N, H) through its expert ``local`` (N,) among the ones this rank holds (``gate_up`` and
    ``down``, (n, 2I, H) and (n, H, I)), in the rows' order. Every held expert runs, also on zero rows, so that the
    backward reaches the same collectives on every rank."""
    by_expert = torch.argsort(local, stable=True)
    sizes = torch.bincount(local, minlength=gate_up.shape[0]).tolist()
    outputs, start = [], 0
    sorted_rows = rows[by_expert]
    for expert, size in enumerate(sizes):
        x = sorted_rows[start : start + size]
        gated = experts._apply_gate(nn.functional.linear(x, gate_up[expert].to(x.dtype)))
        outputs.append(nn.functional.linear(gated, down[expert].to(x.dtype)))
        start += size
    return torch.empty_like(sorted_rows).index_copy(0, by_expert, torch.cat(outputs))


def _held_weight(
    experts: nn.Module, name: str, adapter: nn.Module | None, mesh: DeviceMesh, replicas: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's experts of the weight ``name`` (its rows of the DTensor), their adapters' products added."""
    held = _ReplicaMean.apply(getattr(experts, name).to_local(), replicas, mesh.size())
    delta = None
    if adapter is not None:
        delta = expert_adapter_delta(adapter, mesh["ep"].get_local_rank() * held.shape[0], held.shape[0])
    return held if delta is None else held + delta.to(held.dtype)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Split every experts module's weights over ``mesh``'s "ep" ranks (replicated over "edp") and route its tokens
    there; returns the expert weights, which FSDP2 must leave alone. The weights must be the same on every rank
    (loaded from one directory), each rank keeping its own experts' rows. Adapters on the experts (peft's wrappers
    around them) are added on each rank to the experts it holds."""
    ep = mesh["ep"].size()
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts layers to split over {ep} ranks")
    held_by = {}  # each experts module's id -> (what its MoE block calls: the module or peft's outermost wrapper,
    # the wrappers by weight name)
    for block in model.modules():
        called = getattr(block, "experts", None)
        if isinstance(called, nn.Module):
            inner, adapters = expert_adapters(called)
            held_by[id(inner)] = (called, adapters)
    weights: set[nn.Parameter] = set()
    for module in modules:
        check_experts(module, ep)
        for name in EXPERT_WEIGHTS:
            whole = getattr(module, name)
            sharded = distribute_tensor(whole.detach(), mesh, [Replicate(), Shard(0)], src_data_rank=None)
            parameter = nn.Parameter(sharded, requires_grad=whole.requires_grad)
            setattr(module, name, parameter)
            weights.add(parameter)
        if id(module) not in held_by:
            raise ValueError(f"{type(module).__name__} is not the experts of a MoE block (no block's .experts)")
        called, adapters = held_by[id(module)]
        called.forward = _bound_forward(module, mesh, adapters)
    return weights


def _bound_forward(module: nn.Module, mesh: DeviceMesh, adapters: Mapping[str, nn.Module]):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_forward(module, hidden_states, top_k_index, top_k_weights, mesh, adapters)

    return forward


def is_expert_weight(parameter: torch.Tensor) -> bool:
    """Whether a parameter is an expert weight split by ``apply_expert_parallel``."""
    return isinstance(parameter, DTensor) and parameter.device_mesh.mesh_dim_names == ("edp", "ep")
