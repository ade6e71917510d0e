"""The shape of a model's layout over its ranks: dp x t training ranks that generate in groups of tg.

The one layout type of the project: the planner costs candidate shapes (planner/cost.py), and the
hybrid actor builds its device meshes from one (layout.py's ``ActorLayouts``). This module holds
no device-mesh code. Rank tables, with m = t / tg (regroup.py says why the groups are these):

    training   (dp, t)            ranks.view(dp, t)
    gather     (dp * tg, m)       ranks.view(dp * tg, m)                      row: one generation shard
    generation (dp * m, tg)       ranks.view(dp, tg, m).transpose(1, 2)       row: ranks generating together
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.regroup import Regrouping


@dataclass(frozen=True)
class LayoutShape:
    """dp x t training ranks (FSDP2 over dp, tensor parallelism over t) generating in groups of tg."""

    dp: int
    t: int
    tg: int

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
        """Ranks (devices) of the layout, dp * t."""
        return self.dp * self.t

    @property
    def micro_dp(self) -> int:
        """Generation groups per training tensor-parallel group, t / tg."""
        return self.t // self.tg

    def training_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.dp, self.t)

    def gather_ranks(self) -> torch.Tensor:
        return torch.arange(self.world).view(self.dp * self.tg, self.micro_dp)

    def generation_ranks(self) -> torch.Tensor:
        grid = torch.arange(self.world).view(self.dp, self.tg, self.micro_dp)
        return grid.transpose(1, 2).reshape(self.dp * self.micro_dp, self.tg)
