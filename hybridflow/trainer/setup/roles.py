"""Which roles a run needs, and the worker groups that play them (by the ``Role`` vocabulary)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridflow.algorithms.advantage import AdvantageEstimator
from hybridflow.controller import RayResourcePool, RayWorkerGroup, Role
from hybridflow.trainer.setup.config import HybridFlowConfig


def needed_roles(config: HybridFlowConfig, estimator: AdvantageEstimator) -> list[Role]:
    """The actor always; the reference for a KL term (unless the actor trains LoRA adapters: then the actor
    with its adapters off is the reference); the critic for an estimator that needs values; the reward model
    when enabled; the rollout role when generation runs apart from the actor (async modes)."""
    roles = [Role.ActorRollout]
    if needs_reference(config) and not config.actor_rollout_ref.model.lora.enabled:
        roles.append(Role.RefPolicy)
    if estimator.needs_values:
        roles.append(Role.Critic)
    if config.reward_model.enable:
        roles.append(Role.RewardModel)
    if config.trainer.async_training.rollout_apart:
        roles.append(Role.Rollout)
    if config.teacher.enabled:
        roles.append(Role.Teacher)
    return roles


def needs_reference(config: HybridFlowConfig) -> bool:
    """Whether a KL term needs the reference policy's log-probs."""
    return config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss


@dataclass(kw_only=True)
class RoleGroups:
    """The worker groups of a run, one field per Role (roles a config does not need are None), and
    the resource pool each runs on."""

    actor_rollout: RayWorkerGroup
    ref: RayWorkerGroup | None  # computes the reference log-probs: the ref role's group, or a LoRA actor's
    critic: RayWorkerGroup | None
    reward_model: RayWorkerGroup | None
    rollout: RayWorkerGroup | None  # generation apart from the actor (async modes); None: the actor generates
    teacher: RayWorkerGroup | None  # on-policy distillation's teacher
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
        return cls(
            actor_rollout=groups[Role.ActorRollout],
            ref=groups[Role.ActorRollout] if reference_on_actor else groups.get(Role.RefPolicy),
            critic=groups.get(Role.Critic),
            reward_model=groups.get(Role.RewardModel),
            rollout=groups.get(Role.Rollout),
            teacher=groups.get(Role.Teacher),
            pool_of=dict(pool_of),
            resource_pools=list(resource_pools),
        )

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
        groups = {Role.ActorRollout: self.actor_rollout, Role.RefPolicy: self.ref, Role.Critic: self.critic}
        groups[Role.RewardModel] = self.reward_model
        groups[Role.Rollout] = self.rollout
        groups[Role.Teacher] = self.teacher
        pools: dict[str, RayWorkerGroup] = {}
        for role, group in groups.items():
            if group is not None and role in self.pool_of:  # a LoRA actor's reference has no pool of its own
                pools.setdefault(self.pool_of[role], group)
        return pools
