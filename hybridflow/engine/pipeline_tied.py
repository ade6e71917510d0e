"""A pipelined model whose head shares the embedding's weight (tied embeddings): the first stage holds the embedding
and the last the head, on pp ranks 0 and pp - 1; their gradients are summed over those two ranks after each backward,
so both copies take the same step and stay equal, as the one tensor of the unsplit model does (engine/pipeline.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybridflow.engine.pipeline_stages import PIPELINE_DIM, head_name, submodule_named

TIED_HEAD = "lm_head"  # the head that shares the embedding's weight in a model with tied embeddings


class TiedWeights:
    """A model whose head shares the embedding's weight: the first stage holds the embedding, the last the head (on
    pp ranks 0 and pp - 1, never one rank); after each backward their gradients are summed over ``group`` (those two
    ranks), so both copies take the same step. This rank holds one of them (the other None)."""

    def __init__(self, embedding: nn.Parameter | None, head: nn.Parameter | None, group: dist.ProcessGroup):
        self.embedding, self.head, self.group = embedding, head, group

    def sum_gradients(self) -> None:
        for p in (self.embedding, self.head):
            if p is None:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=self.group)
            p.grad = grad

    @property
    def duplicate(self) -> nn.Parameter | None:
        """The copy counted once only in the gradient norm (the head's), where this rank holds it."""
        return self.head


def tied_weights(
    model: nn.Module, mesh: DeviceMesh, stages: Sequence[nn.Module], indices: Sequence[int], num_stages: int
) -> TiedWeights | None:
    """The gradient sum of this rank's copies of ``model``'s tied embedding and head, held by its ``stages`` (stage
    numbers ``indices`` of ``num_stages``); None where the model's head is its own or this rank holds neither. Every
    rank takes part (it creates the groups of the first and the last pp rank)."""
    text_config = model.config.get_text_config()
    if not (bool(getattr(text_config, "tie_word_embeddings", False)) and head_name(model) == TIED_HEAD):
        return None
    group = _tie_group(mesh)
    embedding = next((_parameter_named(s, "embed_tokens") for s, i in zip(stages, indices) if i == 0), None)
    head = next((_parameter_named(s, TIED_HEAD) for s, i in zip(stages, indices) if i == num_stages - 1), None)
    if embedding is None and head is None:
        return None
    return TiedWeights(embedding, head, group)


def _tie_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of the first and the last pp rank at this rank's (dp, tp) place: every rank creates all of them."""
    if mesh[PIPELINE_DIM].size() == 2:
        return mesh[PIPELINE_DIM].get_group()
    grid = mesh.mesh  # (dp, pp, tp) global ranks
    pp_dim = mesh.mesh_dim_names.index(PIPELINE_DIM)
    pairs = grid.movedim(pp_dim, -1).reshape(-1, grid.shape[pp_dim])[:, [0, -1]]
    mine = None
    for pair in pairs.tolist():
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def _parameter_named(module: nn.Module, leaf: str) -> nn.Parameter:
    parent, attr = submodule_named(module, leaf)
    return getattr(parent, attr).weight
