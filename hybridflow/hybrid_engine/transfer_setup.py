"""What both pools of a weight transfer must agree on, in one picklable value the driver hands to every
rank: where the group meets, both layouts, the weights, the bucket size and the timeout. Each rank makes
the same ``TransferPlan`` from it, so no plan is ever exchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.pool_transfer import TransferAddress, TransferGroup, join_transfer_group
from hybridflow.hybrid_engine.transfer_plan import ParamSpec, TransferPlan, plan_transfer


@dataclass(frozen=True, kw_only=True)
class TransferSetup:
    address: TransferAddress  # the rendezvous actor rank 0 hosts
    actor: LayoutShape  # the actor's training layout (dp, t)
    rollout: LayoutShape  # the rollout's: dp generation replicas of tg ranks
    params: tuple[ParamSpec, ...]  # the actor's weights, in its parameter order
    # a LoRA actor's adapters (transfer_plan.adapter_transfer_params), all that moves after the first transfer;
    # () for a model trained whole
    adapter_params: tuple[ParamSpec, ...] = ()
    adapter_scaling: float = 0.0  # a LoRA actor's alpha / rank
    bucket_bytes: int
    timeout_s: float

    def plan(self, dtype: torch.dtype) -> TransferPlan:
        """Every bucket of a transfer in the generation ``dtype``: the same on every rank of both pools."""
        return self._plan(self.params, dtype)

    def adapter_plan(self, dtype: torch.dtype) -> TransferPlan | None:
        """The plan of a LoRA actor's adapters (None: the model trains whole)."""
        return self._plan(self.adapter_params, dtype) if self.adapter_params else None

    def _plan(self, params: tuple[ParamSpec, ...], dtype: torch.dtype) -> TransferPlan:
        return plan_transfer(
            self.actor,
            replicas=self.rollout.dp,
            tg=self.rollout.tg,
            params=params,
            element_size=dtype.itemsize,
            bucket_bytes=self.bucket_bytes,
        )

    def join(self, *, actor_side: bool, rank: int, device: torch.device, store=None) -> TransferGroup:
        """Join the group as rank ``rank`` of the actor's pool or of the rollout's (actor rank 0 passes the
        store it hosts); TransferJoinError after ``timeout_s`` when the other ranks do not come."""
        return join_transfer_group(
            self.address,
            rank=rank if actor_side else self.actor.world + rank,
            actors=self.actor.world,
            rollouts=self.rollout.world,
            timeout=self.timeout_s,
            device=device,
            store=store,
        )
