"""Ulysses sequence parallelism's exchange (DeepSpeed-Ulysses, arXiv 2309.14509): the ranks of an sp group each
hold a slice of a packed sequence, and attention needs every token of its rows. Before attention an all-to-all
turns (heads, this rank's tokens) into (this rank's heads, every token); after it the inverse turns the output back.
Everything else in a layer is per token and runs on the slice.

``all_to_all`` is differentiable: its backward is the inverse exchange, so gradients reach the slice each token came
from. ``heads_for_sp`` makes the heads split over sp: it repeats key/value heads when a GQA model has fewer than sp of
them (each consecutively, so after the exchange rank r's query heads meet their own kv head: tiling would pair the
wrong kv head with half the ranks' queries, silently), and pads with zero heads where sp does not divide the query
or key/value heads. A repeat's backward sums the replicas' gradients: the exact GQA gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sum_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (differentiable: the backward sums every rank's gradient of the sum, so
    when every rank computes the same loss from it each rank's ``x`` receives sp times that loss's gradient)."""
    return _SumOver.apply(x, group)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"dimension {scatter_dim} of {tuple(x.shape)} does not split over {world} ranks")
    send = torch.stack(
        [part.contiguous() for part in x.chunk(world, dim=scatter_dim)]
    )  # (world, ...): part i to rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[i]: rank i's part for this rank
    return torch.cat(received.unbind(0), dim=gather_dim)  # rank order: rank i's slice of the gathered dimension


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` split into ``sp`` equal parts along ``scatter_dim``, part i sent to rank i, and the parts received from
    every rank concatenated along ``gather_dim`` in rank order (differentiable; one rank: ``x`` itself)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def heads_for_sp(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads_dim: int, sp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value heads that split evenly over ``sp`` ranks, rank r's query heads meeting their own key/value
    heads after the exchange. Where sp divides the query heads and the key/value heads divide sp or are divided by it,
    the key/value heads are repeated, each consecutively, up to a multiple of sp. Otherwise (SmolLM2-135M's 9 query and
    3 key/value heads over sp = 2) zero key/value heads, each with its group of zero query heads, pad them up to a
    multiple of sp (9 and 3 become 12 and 4: each rank attends with 6 and 2), GQA kept: the real query heads stay the
    first ones, the output's others are dropped (``[:H]``), and no real head reads a padding head. Repeats and padding
    are differentiable: the backward sums the replicas' gradients and drops the padding's."""
    heads, kv_heads = query.shape[heads_dim], key.shape[heads_dim]
    if heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0):
        if kv_heads % sp:
            key, value = (x.repeat_interleave(sp // kv_heads, dim=heads_dim) for x in (key, value))
        return query, key, value
    extra = -kv_heads % sp  # zero key/value heads, each with heads // kv_heads zero query heads

    def padded(x: torch.Tensor, count: int) -> torch.Tensor:
        return nn.functional.pad(x, [0, 0] * (x.dim() - 1 - heads_dim) + [0, count])

    return padded(query, extra * (heads // kv_heads)), padded(key, extra), padded(value, extra)


def gather_sequence_scatter_heads(x: torch.Tensor, group: dist.ProcessGroup, *, seq_dim: int, head_dim: int):
    """(…, all heads, this rank's tokens, …) -> (…, this rank's heads, every token, …)."""
    return all_to_all(x, group, scatter_dim=head_dim, gather_dim=seq_dim)


def gather_heads_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, seq_dim: int, head_dim: int):
    """The inverse: (…, this rank's heads, every token, …) -> (…, all heads, this rank's tokens, …)."""
    return all_to_all(x, group, scatter_dim=seq_dim, gather_dim=head_dim)


def row_mesh(device: torch.device, dp: int, sp: int, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """The (dp, sp) mesh over the process group's ranks, rank = dp_index * sp + sp_index, or with tensor parallelism
    (dp, sp, tp), rank = (dp_index * sp + sp_index) * tp + tp_index. Rows split over "dp"; the sp ranks of one dp and
    tp index hold the same rows and the same heads of each layer, and split each micro-batch's tokens. With pipeline
    stages (dp, sp, pp, tp), rank = ((dp_index * sp + sp_index) * pp + pp_index) * tp + tp_index: the sp ranks of one
    stage split its tokens (engine/pipeline.py ``pipeline_mesh`` over dp x sp)."""
    if pp > 1:
        return init_device_mesh(device.type, (dp, sp, pp, tp), mesh_dim_names=("dp", "sp", "pp", "tp"))
    if tp == 1:
        return init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    return init_device_mesh(device.type, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"))


def sp_size(group: dist.ProcessGroup | None) -> int:
    """The ranks of a sequence-parallel group (None: 1, no sequence parallelism)."""
    return dist.get_world_size(group) if group is not None else 1


def all_gather_slices(sliced: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's slice of a sequence (its first dimension), concatenated in rank order (int16 travels as int32:
    gloo gathers no int16)."""
    wide = sliced.to(torch.int32) if sliced.dtype == torch.int16 else sliced
    slices = [torch.empty_like(wide) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slices, wide, group=group)
    return torch.cat(slices).to(sliced.dtype)


@dataclass(frozen=True)
class ResponseShard:
    """Under sequence parallelism: which of the M kept outputs this rank computed (the rest are other sp ranks')."""

    mine: torch.Tensor  # (M,) bool
    group: dist.ProcessGroup
    real_tokens: int  # of this rank's slice of the packed tokens, those that are not the padding evening them

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's (M_r, ...) values -> every rank's (M, ...), summed over the sp group (differentiable: the
        backward sums every rank's gradient, so each local value receives sp times the gradient of the loss every rank
        computes alike; FSDP's mean over the dp x sp ranks divides it back)."""
        full = values.new_zeros((self.mine.shape[0], *values.shape[1:]))
        full = full.index_put((self.mine.nonzero()[:, 0],), values)
        return sum_over(full, self.group)
