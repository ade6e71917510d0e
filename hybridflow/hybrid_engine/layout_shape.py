"""The shape of a model's layout over its ranks: dp x sp x t training ranks that generate in groups of tg.

The one layout type of the project: the planner costs candidate shapes (planner/cost.py), and the
hybrid actor builds its device meshes from one (layout.py's ``ActorLayouts``). This module holds
no device-mesh code. Rank tables, with m = t / tg and f = dp * sp, the ranks FSDP2 shards over (regroup.py says
why the groups are these):

    training   (f, t)             ranks.view(f, t)
    rows       (dp, sp, t)        ranks.view(dp, sp, t)                       [d, :, j]: ranks holding the same rows
    gather     (f * tg, m)        ranks.view(f * tg, m)                       row: one generation shard
    generation (f * m, tg)        ranks.view(f, tg, m).transpose(1, 2)        row: ranks generating together

Sequence parallelism (sp > 1, Ulysses) splits each micro-batch's tokens over sp ranks that hold the same rows and the
same tensor-parallel shard of each layer (FSDP2 shards over them too): attention exchanges the shard's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.regroup import Regrouping


@dataclass(frozen=True)
class LayoutShape:
    """dp x sp x t training ranks (rows split over dp, each micro-batch's sequence over sp, each layer over t;
    FSDP2 over dp x sp) generating in groups of tg."""

    dp: int
    t: int
    tg: int
    sp: int = 1

    def __post_init__(self) -> None:
        Regrouping(t=self.t, tg=self.tg)  # the one check that tg divides t

    @classmethod
    def over(cls, devices: int, t: int = 1, tg: int = 1) -> LayoutShape:
        """The layout of ``devices`` ranks in tensor-parallel groups of t (FSDP2 over the devices / t groups)."""
        if devices % t:
            raise ValueError(f"{devices} devices do not split into tensor-parallel groups of t={t}")
        return cls(dp=devices // t, t=t, tg=tg)

    @property
    def world(self) -> int:
        """Ranks (devices) of the layout, dp * sp * t."""
        return self.dp * self.sp * self.t

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards each parameter over, dp * sp (sequence-parallel peers hold their own shards)."""
        return self.dp * self.sp

    @property
    def micro_dp(self) -> int:
        """Generation groups per training tensor-parallel group, t / tg."""
        return self.t // self.tg

    def training_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.fsdp, self.t)

    def gather_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.fsdp * self.tg, self.micro_dp)

    def generation_ranks(self) -> torch.Tensor:
        grid = torch.arange(self.world).view(self.fsdp, self.tg, self.micro_dp)
        return grid.transpose(1, 2).reshape(self.fsdp * self.micro_dp, self.tg)
