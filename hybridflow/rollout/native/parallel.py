"""Tensor parallelism inside the native engine (Megatron-style, as the training plans split layers).

A generation group of ``size`` ranks generates the same prompts together; each rank holds 1/size of
every decoder layer and of the KV cache:

- column-parallel (rows of W split, each rank computes a slice of the outputs): the q, k and v
  projections with their biases (whole heads per rank) and gate/up (a slice of the MLP);
- row-parallel (columns of W split, each rank computes a partial sum): the output projection and
  down; one all-reduce after each makes the residual stream whole again on every rank;
- a mixture's experts: each rank holds 1/size of them whole and runs them on the tokens routed to them (the
  router is whole, so every rank routes alike); one all-reduce sums the experts' outputs;
- replicated: embeddings, norms and the LM head, so every rank computes the same logits and draws
  the same token (the sampler's randomness is a function of seed, request and step, not the rank).

A row-parallel bias is added by the group's rank 0 only, so that the all-reduce counts it once.
Which module is split how is the model family's table (models/tensor_parallel.py, ``LayerSplit``),
the same table the training plans are built from, so the hybrid engine's switch produces exactly
these slices from the training layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.models.split_sizes import check_split_sizes
from hybridflow.models.tensor_parallel import UNSPLIT, LayerSplit, layer_split
from hybridflow.rollout.native.spec import ModelSpec


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks that generate together: the model family's split, this rank's index in the group and
    the group itself."""

    split: LayerSplit
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, model_type: str, group: dist.ProcessGroup | None) -> TensorParallelGroup:
        """The group's size and this rank's place in it, with the family's split (None: generation on one rank,
        which splits nothing and so runs any family)."""
        if group is None or dist.get_world_size(group) == 1:
            return cls(UNSPLIT)
        return cls(layer_split(model_type), size=dist.get_world_size(group), rank=dist.get_rank(group), group=group)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of the group's partial results of a row-parallel layer (in place)."""
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full Hugging Face tensor ``name`` (a view; the tensor itself if unsplit)."""
        dim = self.split.shard_dim(name)
        if dim is None or self.size == 1:
            return full
        return full.chunk(self.size, dim=dim)[self.rank]

    def holds(self, name: str) -> bool:
        """False for a row-parallel bias on ranks other than 0 (it is added once, by rank 0)."""
        return not (self.rank and self.split.is_row_bias(name))

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The shapes one rank computes: 1/size of the query heads, key/value heads and MLP width (a mixture's
        experts keep their width: the rank holds 1/size of them, ``experts``)."""
        check_split_sizes(
            self.size,
            "rollout.tensor_model_parallel_size",
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            intermediate_size=spec.intermediate_size,
            experts=spec.num_experts,
        )
        sizes = (
            ("num_heads", "num_kv_heads") if spec.num_experts else ("num_heads", "num_kv_heads", "intermediate_size")
        )
        return dataclasses.replace(spec, **{name: getattr(spec, name) // self.size for name in sizes})

    def experts(self, count: int) -> range:
        """The experts, of a mixture's ``count``, that this rank holds and runs (``LayerSplit.experts``)."""
        share = count // self.size
        return range(self.rank * share, (self.rank + 1) * share)
