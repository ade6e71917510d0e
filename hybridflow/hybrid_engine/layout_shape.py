"""The shape of a model's layout over its ranks: dp x sp x pp x t training ranks that generate in groups of pg x tg.

The one layout type of the project: the planner costs candidate shapes (planner/cost.py), and the
hybrid actor builds its device meshes from one (layout.py's ``ActorLayouts``). This module holds
no device-mesh code. Rank tables, with m = t / tg, f = dp * sp, the ranks FSDP2 shards over, and g = f * pp, the
blocks of t ranks that split each layer (regroup.py says why the groups are these):

    training   (f, t)             ranks.view(f, t)                            (pp = 1)
    pipeline   (f, pp, t)         ranks.view(f, pp, t)                        [d, :, j]: one model's stages
    rows       (dp, sp, t)        ranks.view(dp, sp, t)                       [d, :, j]: ranks holding the same rows
               (dp, sp, pp, t)    with pipeline stages                        [d, :, :, :]
    gather     (g * tg, m)        ranks.view(g * tg, m)                       row: one generation shard of a stage
    generation (g * m, tg)        ranks.view(g, tg, m).transpose(1, 2)        row: ranks generating together
    with generation stages (pg > 1), n = pp / pg:
    stage gather (f * pg * t, n)  ranks.view(f, pg, n, t), n last             row: one generation stage's layers
    generation (f * n * m, pg, tg)   ranks.view(f, pg, n, tg, m), (pg, tg) last    [r]: ranks generating together

Sequence parallelism (sp > 1, Ulysses) splits each micro-batch's tokens over sp ranks that hold the same rows and the
same tensor-parallel shard of each layer (FSDP2 shards over them too): attention exchanges the shard's heads. With
pipeline stages too, each stage's slice of a micro-batch goes to the next stage's rank of the same sp index.
Expert parallelism (ep > 1) splits each MoE layer's experts over ep of the dp ranks (engine/expert_parallel.py);
it needs t = sp = pp = 1 and changes no rank table.
Pipeline parallelism (pp > 1) splits the decoder layers into stages over pp ranks that hold the same rows. With
pg = 1 they generate with the whole model: each rank gathers its generation shard of its own stage's layers in its
gather group as above, and the other stages' from its pp peers, which hold the same shard of theirs
(hybrid_engine/reshard.py). With pg > 1 (pg dividing pp) the generation engine runs pg stages (rollout/native/
stages.py), and the regrouping of §5.3 applies to the stages as to tensor parallelism: the n = pp / pg consecutive pp
ranks of a stage gather group hold the training stages that make one generation stage, and each receives the other
n - 1's layers from them; the pg ranks generating together are strided (pp = 4, pg = 2: stages {0, 2} and {1, 3}).
Every rank also holds the embedding, the final norm and the head (from the first and last training stages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.regroup import Regrouping


@dataclass(frozen=True)
class LayoutShape:
    """dp x sp x pp x t training ranks (rows split over dp, each micro-batch's sequence over sp, the decoder layers
    over pp stages, each layer over t; FSDP2 over dp x sp) generating in groups of tg."""

    dp: int
    t: int
    tg: int
    sp: int = 1
    pp: int = 1
    ep: int = 1  # of the dp ranks, those that split each MoE layer's experts
    pg: int = 1  # generation pipeline stages, dividing pp

    def __post_init__(self) -> None:
        Regrouping(t=self.t, tg=self.tg)  # the one check that tg divides t
        if self.pp % self.pg:
            raise ValueError(f"pg={self.pg} generation stages must divide the pp={self.pp} training stages")
        if self.ep > 1 and (self.dp % self.ep or self.t * self.sp * self.pp > 1):
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}, with t, sp and pp 1")

    @classmethod
    def over(cls, devices: int, t: int = 1, tg: int = 1) -> LayoutShape:
        """The layout of ``devices`` ranks in tensor-parallel groups of t (FSDP2 over the devices / t groups)."""
        if devices % t:
            raise ValueError(f"{devices} devices do not split into tensor-parallel groups of t={t}")
        return cls(dp=devices // t, t=t, tg=tg)

    @property
    def world(self) -> int:
        """Ranks (devices) of the layout, dp * sp * pp * t."""
        return self.dp * self.sp * self.pp * self.t

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards each parameter over, dp * sp (sequence-parallel peers hold their own shards)."""
        return self.dp * self.sp

    @property
    def micro_dp(self) -> int:
        """Generation groups per training tensor-parallel group, t / tg."""
        return self.t // self.tg

    @property
    def stage_micro_dp(self) -> int:
        """Generation groups per pipeline of training stages, pp / pg: the pp ranks whose stages make one
        generation stage."""
        return self.pp // self.pg

    @property
    def generation_ranks_per_group(self) -> int:
        """The ranks generating together, pg x tg."""
        return self.pg * self.tg

    @property
    def layer_blocks(self) -> int:
        """The blocks of t ranks that each split a layer (of one stage), fsdp * pp."""
        return self.fsdp * self.pp

    def training_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.fsdp, self.t)

    def pipeline_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.fsdp, self.pp, self.t)

    def gather_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.layer_blocks * self.tg, self.micro_dp)

    def generation_ranks(self) -> torch.Tensor:
        """(groups, tg), or with generation stages (groups, pg, tg): each group's ranks by stage and shard."""
        if self.pg > 1:
            grid = torch.arange(self.world).view(self.fsdp, self.pg, self.stage_micro_dp, self.tg, self.micro_dp)
            return grid.permute(0, 2, 4, 1, 3).reshape(-1, self.pg, self.tg)
        grid = torch.arange(self.world).view(self.layer_blocks, self.tg, self.micro_dp)
        return grid.transpose(1, 2).reshape(self.layer_blocks * self.micro_dp, self.tg)

    def stage_gather_ranks(self) -> torch.Tensor:
        """(dp * pg * t, pp / pg): each row the pp ranks whose training stages make one generation stage (pg = 1:
        the pp ranks of one model)."""
        grid = torch.arange(self.world).view(self.fsdp, self.pg, self.stage_micro_dp, self.t)
        return grid.permute(0, 1, 3, 2).reshape(-1, self.stage_micro_dp)
