"""Which roles a run needs (their parts: role_parts.py), and the worker groups that play them."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.advantage import AdvantageEstimator
from hybridflow.controller import RayResourcePool, RayWorkerGroup, Role
from hybridflow.trainer.setup.config import HybridFlowConfig
from hybridflow.trainer.setup.role_parts import ROLE_PARTS


def needed_roles(config: HybridFlowConfig, estimator: AdvantageEstimator) -> list[Role]:
    """The roles a run needs, in their parts' order (role_parts.py: the actor always; the reference for a KL term
    unless the actor trains LoRA adapters; the critic for an estimator that needs values; the reward model when
    enabled; the rollout role when generation runs apart; the teacher when one is given)."""
    return [role for role, part in ROLE_PARTS.items() if part.needed(config, estimator)]


class GroupOf:
    """A ``RoleGroups`` attribute that is one role's group (None for a role the run does not need)."""

    def __init__(self, role: Role):
        self.role = role

    def __get__(self, groups: RoleGroups | None, owner: type | None = None) -> Any:
        return self if groups is None else groups.of(self.role)


@dataclass(kw_only=True)
class RoleGroups:
    """The worker groups of a run by role (``of``; the built-in roles also by name: ``critic``, ``teacher``, ...;
    None for a role the run does not need), and the resource pool each runs on. ``ref`` is the group that computes
    the reference log-probs: the reference's, or a LoRA actor's (adapters off)."""

    groups: dict[Role, RayWorkerGroup]
    pool_of: dict[Role, str]
    resource_pools: list[RayResourcePool] = field(default_factory=list)  # what the groups were placed in

    @classmethod
    def from_roles(
        cls,
        groups: Mapping[Role, RayWorkerGroup],
        pool_of: Mapping[Role, str],
        *,
        reference_on_actor: bool = False,
        resource_pools: Sequence[RayResourcePool] = (),
    ) -> RoleGroups:
        """``reference_on_actor``: the actor computes the reference log-probs (LoRA, adapters off)."""
        by_role = dict(groups)
        if reference_on_actor:
            by_role[Role.RefPolicy] = by_role[Role.ActorRollout]
        return cls(groups=by_role, pool_of=dict(pool_of), resource_pools=list(resource_pools))

    def of(self, role: Role) -> RayWorkerGroup | None:
        return self.groups.get(role)

    @property
    def actor_rollout(self) -> RayWorkerGroup:
        return self.groups[Role.ActorRollout]

    ref = GroupOf(Role.RefPolicy)  # the reference's, or a LoRA actor's (adapters off)
    critic = GroupOf(Role.Critic)
    reward_model = GroupOf(Role.RewardModel)
    rollout = GroupOf(Role.Rollout)  # generation apart from the actor (async modes); None: the actor generates
    teacher = GroupOf(Role.Teacher)

    def scoring_passes(self) -> list[tuple[RayWorkerGroup, str]]:
        """(group, method) of each role that scores every batch after generation (its part's ``scores``), in the
        parts' order."""
        return [
            (self.groups[role], part.scores)
            for role, part in ROLE_PARTS.items()
            if part.scores and self.groups.get(role) is not None
        ]

    def release(self, keep_processes: bool = True) -> None:
        """Give the resource pools back to the Ray cluster; Ray ends the worker processes placed in them. A run
        on a cluster it did not start (one the program or a notebook had started, or several runs in one
        process) leaves it as it found it, except for the processes a driver that keeps them
        (``keep_worker_processes``) keeps after a run that ended well (``keep_processes``)."""
        for pool in self.resource_pools:
            pool.release(keep_processes)
        self.resource_pools = []

    def kill(self) -> None:
        """End every pool's processes now (after a failure: a thread's call waiting on them returns with their
        error); a pool already dead, or Ray already gone, is passed over."""
        for group in self.by_pool().values():
            with contextlib.suppress(Exception):
                group.kill()

    @property
    def generator(self) -> RayWorkerGroup:
        """The group that generates: the rollout role's when it runs apart, else the hybrid actor."""
        return self.rollout if self.rollout is not None else self.actor_rollout

    def by_pool(self) -> dict[str, RayWorkerGroup]:
        """One group per pool (the roles of a pool share its processes, so any of them stands for it)."""
        pools: dict[str, RayWorkerGroup] = {}
        for role, group in self.groups.items():
            if role in self.pool_of:  # a LoRA actor's reference has no pool of its own
                pools.setdefault(self.pool_of[role], group)
        return pools
