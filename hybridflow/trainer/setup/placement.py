"""Placement: which resource pool each model role runs on (``trainer.placement``), and the worker groups.

The HybridFlow paper's three placements, plus an explicit form:

- ``all_colocate``: one pool; every role of the run is fused into one process per rank (one
  process group), and the stages run one after another.
- ``group_colocate``: the actor and the reference on pool ``actor``, the critic, the reward
  model and the teacher on pool ``critic``, the rollout role (async modes) on pool ``rollout``: stages
  of the groups overlap.
- ``separate``: one pool per role, named after it.
- ``custom``: ``trainer.resource_pool_spec`` names the pools with their processes per node (pools
  may differ in size) and ``trainer.role_pool`` maps each role (actor_rollout, ref, critic,
  reward_model, rollout, teacher) to one.

The rollout role exists only when generation runs apart from the actor
(``trainer.async_training.mode``), and then never on the actor's pool: its point is to generate
while the actor trains.

The presets give every pool ``trainer.n_workers_per_node`` processes on each of ``trainer.nnodes``
nodes, so ``separate`` uses as many processes as the run has roles times that. Roles on one pool
share its processes; roles on different pools are different Ray actors with their own process
groups, and the driver's non-blocking calls let them work at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.controller import RayResourcePool, RayWorkerGroup, Role, RoleSpec
from hybridflow.controller.ray_runtime import tuning_env
from hybridflow.trainer.setup.config import ConfigError, HybridFlowConfig
from hybridflow.trainer.setup.role_parts import ROLE_PARTS, needs_reference
from hybridflow.trainer.setup.roles import RoleGroups


@dataclass(frozen=True)
class Placement:
    """Pools (name -> processes per node) and the pool of each role the run needs (part of the run plan)."""

    pools: dict[str, list[int]]
    role_pool: dict[Role, str]

    def world_size(self, role: Role) -> int:
        """Ranks of the pool ``role`` runs on: its data-parallel size."""
        return sum(self.pools[self.role_pool[role]])

    def roles_on(self, pool: str) -> list[Role]:
        return [role for role, name in self.role_pool.items() if name == pool]

    @property
    def processes(self) -> int:
        return sum(sum(nodes) for nodes in self.pools.values())


def place_roles(config: HybridFlowConfig, roles: tuple[Role, ...]) -> Placement:
    """The pools and the role -> pool map of ``roles`` under ``trainer.placement``; ConfigError naming the key
    when it does not fit."""
    placement = _presets(config, roles)
    _check_rollout_apart(config, placement)
    return placement


def _presets(config: HybridFlowConfig, roles: tuple[Role, ...]) -> Placement:
    trainer = config.trainer
    per_pool = [trainer.n_workers_per_node] * trainer.nnodes
    if trainer.placement == "all_colocate":
        return Placement({"global": per_pool}, {role: "global" for role in roles})
    if trainer.placement == "group_colocate":
        role_pool = {role: ROLE_PARTS[role].pool for role in roles}
        return Placement({name: list(per_pool) for name in dict.fromkeys(role_pool.values())}, role_pool)
    if trainer.placement == "separate":
        return Placement({role.value: list(per_pool) for role in roles}, {role: role.value for role in roles})
    return _custom_plan(config, roles)


def _check_rollout_apart(config: HybridFlowConfig, placement: Placement) -> None:
    """The rollout role, where the run has one, on a pool the actor does not train on."""
    rollout_pool = placement.role_pool.get(Role.Rollout)
    if rollout_pool is None or rollout_pool != placement.role_pool[Role.ActorRollout]:
        return
    mode = config.trainer.async_training.mode
    key = "trainer.role_pool.rollout" if config.trainer.placement == "custom" else "trainer.placement"
    raise ConfigError(
        key,
        f"async_training.mode={mode} generates on the rollout role's pool while the actor trains, but both are on "
        f"pool '{rollout_pool}'",
        "use trainer.placement=group_colocate or separate, or give the rollout role a pool of its own (custom)",
    )


def _custom_plan(config: HybridFlowConfig, roles: tuple[Role, ...]) -> Placement:
    trainer = config.trainer
    spec, mapping = trainer.resource_pool_spec, trainer.role_pool
    example = (
        "trainer.resource_pool_spec.actor=[2] trainer.resource_pool_spec.critic=[1] "
        "trainer.role_pool.actor_rollout=actor trainer.role_pool.critic=critic"
    )
    if not spec:
        raise ConfigError("trainer.resource_pool_spec", "placement=custom needs named pools", f"e.g. {example}")
    for name, nodes in spec.items():
        if not nodes or any(int(n) < 1 for n in nodes):
            raise ConfigError(
                f"trainer.resource_pool_spec.{name}",
                f"{nodes} is not a list of process counts per node (each >= 1)",
                "e.g. [2] for 2 processes on one node",
            )
    for role_name, pool in mapping.items():
        if role_name not in ROLE_PARTS:
            raise ConfigError(f"trainer.role_pool.{role_name}", "no such role", f"roles are {', '.join(ROLE_PARTS)}")
        if pool not in spec:
            raise ConfigError(
                f"trainer.role_pool.{role_name}",
                f"pool '{pool}' is not in trainer.resource_pool_spec ({', '.join(spec)})",
                "name a pool of trainer.resource_pool_spec, or add it there",
            )
    missing = [role.value for role in roles if role.value not in mapping]
    if missing:
        raise ConfigError(
            "trainer.role_pool",
            f"this run needs the roles {', '.join(r.value for r in roles)}, and {', '.join(missing)} have no pool",
            f"map each to a pool, e.g. trainer.role_pool.{missing[0]}={next(iter(spec))}",
        )
    role_pool = {role: mapping[role.value] for role in roles}
    used = dict.fromkeys(role_pool.values())
    return Placement({name: [int(n) for n in spec[name]] for name in used}, role_pool)


def build_groups(config: HybridFlowConfig, placement: Placement, specs: dict[Role, RoleSpec]) -> RoleGroups:
    """One Ray worker group per pool, its roles fused into one process per rank; a view per role. The caller
    releases them (``RoleGroups.release``) when the run ends."""
    trainer = config.trainer
    groups: dict[Role, RayWorkerGroup] = {}
    pools: list[RayResourcePool] = []
    try:
        for pool_name, nodes in placement.pools.items():
            pool = RayResourcePool(
                nodes,
                use_gpu=trainer.device == "cuda",
                max_colocate_count=trainer.max_colocate_count,
                cpus_per_worker=trainer.cpus_per_worker,
                threads_per_worker=trainer.threads_per_worker or None,
                ready_timeout_s=trainer.placement_timeout_s,
                name=pool_name,
                worker_env=tuning_env(trainer.cpu_kernel_cache_capacity),
            )
            pools.append(pool)
            pool_specs = {role.value: specs[role] for role in placement.roles_on(pool_name)}
            views = RayWorkerGroup.colocated(pool, pool_specs, name=pool_name)
            groups.update({Role(name): view for name, view in views.items()})
    except BaseException:  # a pool that did not place or start: give back the ones that did
        for pool in pools:
            pool.release(keep_processes=False)
        raise
    reference_on_actor = needs_reference(config) and config.actor_rollout_ref.model.lora.enabled
    return RoleGroups.from_roles(
        groups, pool_of=placement.role_pool, reference_on_actor=reference_on_actor, resource_pools=pools
    )
