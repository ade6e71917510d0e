"""Pipeline stages inside the native engine: a generation group whose ranks each hold a share of the decoder layers.

The 3D-HybridEngine's generation layout pg-tg-dg (HybridFlow §5): pg ranks generate together, rank s holding the
s-th of pg equal runs of consecutive decoder layers (and their KV cache), each perhaps tensor-parallel over tg
ranks of its own (parallel.py). Every rank of the group runs the same scheduler on the same prompts; in each
forward the first stage embeds the tokens, every stage runs its layers on what the stage before sent it and sends
the result on, and the last stage's residual stream goes to every rank of the group, which all hold the final norm
and the LM head (as tensor parallelism replicates them), so every rank computes the same logits and draws the
same tokens. One stage computes at a time (no micro-batches in flight): the layout exists for a model whose
weights and cache one rank cannot hold, and a group of pg ranks generates at the speed of one rank holding it all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.rollout.native.spec import ModelSpec


@dataclass(frozen=True)
class PipelineStageGroup:
    """The pg ranks that generate with one copy of the model's layers, this rank's stage among them, and the
    decoder layers (Hugging Face indices) it holds. Size 1: every layer on this rank."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> PipelineStageGroup:
        if group is None or dist.get_world_size(group) == 1:
            return cls()
        return cls(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The shapes this rank computes: 1/size of the decoder layers (ValueError unless size divides them)."""
        if spec.num_layers % self.size:
            raise ValueError(
                f"{spec.num_layers} decoder layers do not split into {self.size} generation pipeline stages "
                "(rollout.pipeline_model_parallel_size): use a size that divides them"
            )
        return dataclasses.replace(spec, num_layers=spec.num_layers // self.size)

    def held_layers(self, per_stage: int) -> range:
        """The Hugging Face indices of this rank's layers, ``per_stage`` of them."""
        return range(self.rank * per_stage, (self.rank + 1) * per_stage)

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def received(self, x: torch.Tensor) -> torch.Tensor:
        """What the stage before sent (the residual stream entering this rank's layers), shaped as ``x`` (the first
        stage: ``x`` itself, the embedded tokens)."""
        if self.rank == 0:
            return x
        incoming = torch.empty_like(x)
        dist.recv(incoming, src=self._global(self.rank - 1), group=self.group)
        return incoming

    def passed_on(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the residual stream after this rank's layers) sent to the next stage (the last: kept)."""
        if self.rank < self.size - 1:
            dist.send(x.contiguous(), dst=self._global(self.rank + 1), group=self.group)
        return x

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's ``x`` on every rank of the group (the others' own ``x`` is only its shape)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.broadcast(x, src=self._global(self.size - 1), group=self.group)
        return x

    def whole_routes(self, chosen: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every stage's MoE layers' chosen experts, in layer order, from this rank's (one (N, k) tensor a layer)."""
        if self.size == 1:
            return chosen
        mine = torch.stack(chosen) if chosen else torch.empty(0)
        stages = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(stages, mine, group=self.group)
        return [layer for stage in stages for layer in stage.unbind(0)]


ONE_STAGE = PipelineStageGroup()  # every layer on this rank
