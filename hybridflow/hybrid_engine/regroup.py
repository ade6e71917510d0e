"""The 3D-HybridEngine's regrouping (HybridFlow paper §5.3): which ranks generate together, and what
each rank must receive to switch from the training layout to the generation layout.

Inside one training tensor-parallel group of t ranks, rank k holds training shard k (1/t of each
sharded weight). Generation runs with tensor-parallel size tg (tg divides t), so each generation
shard j (1/tg of a weight) is made of the t/tg consecutive training shards j·t/tg .. (j+1)·t/tg - 1.

- gather groups: the t/tg ranks holding the pieces of generation shard j all-gather them, and all
  end up with generation shard j; a rank's own training shard is part of what it keeps (no copy
  held twice);
- generation groups: one rank from each gather group, the ranks with the same offset in their
  gather group (strided: t=4, tg=2 gives {0, 2} and {1, 3}); these tg ranks hold the tg different
  generation shards and generate together; the t/tg generation groups of a training group are
  the paper's micro data-parallel groups and generate different prompts.

Bytes each rank receives per switch, for a model of M bytes of sharded weights (`switch_bytes`):
`hybridflow` (M/t)(t/tg - 1): only the missing pieces, inside groups of t/tg; `hybridflow_v`
(the paper's vanilla version: all-gather over the training TP group, then slice) M(t - 1)/t;
`gather_all` (today's hybrid actor, DeepSpeed-Chat-like: every rank gathers the full model) M(N - 1)/N
over all N ranks. Peak parameter memory on a rank while generating: M/tg, M and M (a full copy).
With FSDP2 over the data-parallel dimension (dp), each rank first gathers its TP shard within its
dp group: (M/t)(dp - 1)/dp more bytes in every method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SWITCH_METHODS = ("hybridflow", "hybridflow_v", "gather_all")


@dataclass(frozen=True)
class Regrouping:
    """The groups of one training TP group of size t for generation TP size tg (tp-local ranks 0..t-1)."""

    t: int
    tg: int

    def __post_init__(self) -> None:
        if self.tg < 1 or self.t % self.tg:
            raise ValueError(
                f"the generation tensor-parallel size tg={self.tg} must divide the training one t={self.t}: "
                "each generation shard is made of whole training shards"
            )

    @property
    def micro_dp(self) -> int:
        """Generation groups per training TP group (the paper's micro data-parallel size), t / tg."""
        return self.t // self.tg

    def generation_shard(self, tp_rank: int) -> int:
        """The generation shard (0 .. tg-1) that training TP rank ``tp_rank`` holds while generating."""
        return tp_rank // self.micro_dp

    def gather_groups(self) -> list[list[int]]:
        """Ranks that all-gather their training shards into one generation shard, one list per shard."""
        return [list(range(j * self.micro_dp, (j + 1) * self.micro_dp)) for j in range(self.tg)]

    def generation_groups(self) -> list[list[int]]:
        """Ranks that generate together (one holding each generation shard), one list per micro-DP index."""
        return [[j * self.micro_dp + k for j in range(self.tg)] for k in range(self.micro_dp)]


def switch_bytes(model_bytes: float, *, dp: int, t: int, tg: int, method: str) -> float:
    """Bytes one rank receives to switch ``model_bytes`` of TP-sharded weights from (dp, t) training to
    tg generation, by ``method`` (SWITCH_METHODS); see the module docstring for the formulas."""
    unshard = model_bytes / t * (dp - 1) / dp  # FSDP2: the rank's TP shard, gathered over dp
    if method == "hybridflow":
        return unshard + model_bytes / t * (t // tg - 1)
    if method == "hybridflow_v":
        return unshard + model_bytes * (t - 1) / t
    if method == "gather_all":
        world = dp * t
        return model_bytes * (world - 1) / world
    raise ValueError(f"unknown switch method {method!r}; known: {', '.join(SWITCH_METHODS)}")


def predicted_switch_bytes(split_bytes: float, whole_bytes: float, *, dp: int, t: int, tg: int, method: str) -> float:
    """Bytes one rank receives for a whole model: ``split_bytes`` of tensor-parallel weights (switch_bytes)
    and ``whole_bytes`` of weights every tp rank holds whole (embeddings, norms, LM head), which only
    FSDP2's gather over dp brings, in every method."""
    return switch_bytes(split_bytes, dp=dp, t=t, tg=tg, method=method) + whole_bytes * (dp - 1) / dp


def peak_generation_bytes(model_bytes: float, *, tg: int, method: str) -> float:
    """Weight bytes a rank holds for generation: its generation shard (hybridflow) or a full copy."""
    return model_bytes / tg if method == "hybridflow" else model_bytes


def gather_generation_shard(training_shard: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's generation shard of one weight: its gather group's training shards (of equal
    shape) concatenated along the sharded ``dim`` in rank order (hybrid_engine/layout.py builds the
    groups; None: the rank's training shard is its generation shard). The input is part of the result."""
    if group is None or dist.get_world_size(group) == 1:
        return training_shard
    size = dist.get_world_size(group)
    pieces = [torch.empty_like(training_shard) for _ in range(size)]
    dist.all_gather(pieces, training_shard.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)
