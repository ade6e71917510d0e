"""The driver's side of the weight transfer between the actor's pool and the rollout's (asynchronous modes).

The workers move the weights themselves, over a process group that spans both pools
(hybrid_engine/pool_transfer.py); the driver only starts both sides of each step at once and reads what
they report. Nothing of the weights passes through the driver or the disk.
"""

from __future__ import annotations

from hybridflow.controller import RayWorkerGroup
from hybridflow.hybrid_engine.interrupt import Interrupter
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.pool_transfer import TransferAddress
from hybridflow.hybrid_engine.transfer_setup import TransferSetup
from hybridflow.trainer.setup.config import AsyncTrainingConfig
from hybridflow.trainer.setup.roles import RoleGroups
from hybridflow.trainer.setup.run_plan import RunPlan


class WeightLink:
    """The actor group's ranks and the rollout group's, joined by one transfer group (``connect``, once);
    ``send`` moves the actor's current weights to every rollout rank."""

    def __init__(
        self,
        actor: RayWorkerGroup,
        rollout: RayWorkerGroup,
        *,
        actor_layout: LayoutShape,
        rollout_layout: LayoutShape,
        bucket_mb: float,
        timeout_s: float,
    ):
        self.actor = actor
        self.rollout = rollout
        self.layouts = actor_layout, rollout_layout
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = timeout_s
        self.connected = False
        self.address: TransferAddress | None = None
        self.interrupter: Interrupter | None = None

    def connect(self) -> None:
        """Both groups join the transfer group, whose rendezvous the actor's rank 0 hosts. Every rank makes
        the plan of each transfer (which rank sends which slice to which) from the same ``TransferSetup``,
        so both sides agree without exchanging it."""
        if self.connected:
            return
        self.address = self.actor.transfer_endpoint()[0]
        params, adapter_params, adapter_scaling = self.actor.transfer_params()[0]
        setup = TransferSetup(
            address=self.address,
            actor=self.layouts[0],
            rollout=self.layouts[1],
            params=tuple(params),
            adapter_params=tuple(adapter_params),
            adapter_scaling=adapter_scaling,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
        )
        on_actor = self.actor.join_weight_transfer.future(setup)
        self.rollout.join_weight_transfer(setup)
        on_actor.get()
        self.connected = True

    def interrupt(self, call: int) -> None:
        """Stop the rollout's generation call ``call`` at its next decode step (partial rollout), through the
        transfer group's store."""
        if self.interrupter is None:
            self.interrupter = Interrupter(self.address, self.timeout_s)
        self.interrupter.interrupt(call)

    def send(self, version: int) -> dict[str, float]:
        """Move the actor's weights (those after step ``version``; a LoRA actor's adapters, after the first) to
        the rollout's ranks; the transfer's
        metrics: MB the busiest rollout rank received and what the formula says it must, MB the busiest
        actor rank sent, seconds (the slowest rank), buckets."""
        on_actor = self.actor.send_weights.future()
        received = self.rollout.receive_weights(version)
        sent = on_actor.get()
        return {
            "transfer/mb": max(r.received for r in received) / 2**20,
            "transfer/predicted_mb": max(r.predicted for r in received) / 2**20,
            "transfer/sent_mb": max(s.sent for s in sent) / 2**20,
            "transfer/seconds": max(r.seconds for r in [*received, *sent]),
            "transfer/buckets": float(max(r.buckets for r in received)),
        }


def link_actor_to_rollout(groups: RoleGroups, plan: RunPlan, settings: AsyncTrainingConfig) -> WeightLink:
    """The link of an asynchronous run: the actor's training layout to the rollout's generation layout."""
    return WeightLink(
        groups.actor_rollout,
        groups.rollout,
        actor_layout=plan.actor_layout,
        rollout_layout=plan.generation_layout,
        bucket_mb=settings.transfer_bucket_mb,
        timeout_s=settings.transfer_timeout_s,
    )
