"""The search of the HybridFlow paper's Algorithm 1: placements, device counts, layouts.

For every partition of the run's models into colocated sets, every set gets the fewest devices its
models fit in (memory is a hard constraint) and the remaining devices are split among the sets in
every way (whole nodes on a multi-node cluster). For each model and device count the best layout is
the one with the fewest seconds over the model's own stages (cached, as the paper's ``d_cost``). A
step costs, per phase of the dataflow, the busiest set (the stages of one set run one after another,
different sets at once), summed over the phases. One step off policy (a rollout role on devices of its
own), generation overlaps the rest of the step: max(generation, scoring + updates) + the weight transfer.

Choosing each model's layout on its own stages is the paper's decomposition: it keeps the search
small, and can miss a plan where a model takes a slower layout so that another set's phase hides it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.planner.cluster import ClusterSpec
from hybridflow.planner.cost import layouts_for, memory_bytes, phases, stage_seconds, stages_filled
from hybridflow.planner.workload import Workload


@dataclass(frozen=True)
class DeviceSet:
    """Colocated models on ``devices`` devices, each in its layout."""

    roles: tuple[Role, ...]
    devices: int
    layouts: dict[Role, LayoutShape] = field(hash=False)
    stage_seconds: dict[str, float] = field(hash=False)  # summed over the set's models
    memory: float = 0.0  # bytes per device at the peak

    @property
    def name(self) -> str:
        return "+".join(role.value for role in self.roles)


@dataclass(frozen=True)
class Plan:
    sets: tuple[DeviceSet, ...]
    seconds: float  # predicted seconds per step
    phase_seconds: tuple[float, ...]  # per phase of phases(), then the weight transfer (one step off)

    @property
    def overlapped(self) -> bool:
        """Whether a rollout role generates on its own devices (one step off policy)."""
        return any(Role.Rollout in s.roles for s in self.sets)


def set_partitions(items: list) -> Iterator[list[list]]:
    """Every partition of ``items`` into non-empty blocks (Bell(len) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def device_splits(total: int, minimums: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way of giving each part at least its minimum, all ``total`` units used."""
    if len(minimums) == 1:
        if total >= minimums[0]:
            yield (total,)
        return
    for first in range(minimums[0], total - sum(minimums[1:]) + 1):
        for rest in device_splits(total - first, minimums[1:]):
            yield (first, *rest)


class Planner:
    def __init__(self, workload: Workload, cluster: ClusterSpec):
        self.workload = workload
        self.cluster = cluster
        self.unit = cluster.allocation_unit()

    @cache  # noqa: B019 (one planner per search; the cache dies with it)
    def best_layout(self, role: Role, devices: int) -> tuple[LayoutShape, dict[str, float]] | None:
        """The layout with the fewest seconds over the model's stages that fits a device alone and whose pipeline
        stages the run plan accepts (None: none)."""
        shape = self.workload.models[role]
        best = None
        for layout in layouts_for(role, shape, devices, self.cluster):
            if not stages_filled(role, layout, self.workload):
                continue
            static, transient = memory_bytes(role, shape, layout, self.workload)
            if static + transient > self.cluster.device_memory:
                continue
            seconds = stage_seconds(role, shape, layout, self.workload, self.cluster)
            if best is None or sum(seconds.values()) < sum(best[1].values()):
                best = (layout, seconds)
        return best

    def device_set(self, roles: tuple[Role, ...], devices: int) -> DeviceSet | None:
        """The set on ``devices`` devices with each model's best layout, or None where it does not fit."""
        chosen = {role: self.best_layout(role, devices) for role in roles}
        if any(value is None for value in chosen.values()):
            return None
        return evaluate_set(self.workload, self.cluster, {role: layout for role, (layout, _) in chosen.items()})

    def fewest_units(self, roles: tuple[Role, ...]) -> int | None:
        total = self.cluster.devices // self.unit
        for units in range(1, total + 1):
            if self.device_set(roles, units * self.unit) is not None:
                return units
        return None

    def plans(self) -> list[Plan]:
        """Every feasible plan, fastest first."""
        roles = list(self.workload.models)
        total = self.cluster.devices // self.unit
        found = []
        for partition in set_partitions(roles):
            blocks = [tuple(block) for block in partition]
            if any(Role.Rollout in block and Role.ActorRollout in block for block in blocks):
                continue  # the rollout role generates while the actor trains: never on its devices
            minimums = [self.fewest_units(block) for block in blocks]
            if any(m is None for m in minimums):
                continue
            for split in device_splits(total, minimums):
                sets = [self.device_set(block, units * self.unit) for block, units in zip(blocks, split)]
                if all(s is not None for s in sets):
                    found.append(step_plan(sets, overlapped=self.workload.rollout_apart))
        return sorted(found, key=lambda plan: plan.seconds)


def evaluate_set(workload: Workload, cluster: ClusterSpec, layouts: dict[Role, LayoutShape]) -> DeviceSet | None:
    """Colocated models in the given layouts (all on the same devices): their stages' seconds added up,
    or None where they do not fit (held memory adds up; transients do not, the stages run one at a time)."""
    devices = {layout.world for layout in layouts.values()}
    if len(devices) != 1:
        raise ValueError(f"colocated models share their devices; got layouts on {sorted(devices)}")
    static = transient = 0.0
    stages: dict[str, float] = {}
    for role, layout in layouts.items():
        held, peak = memory_bytes(role, workload.models[role], layout, workload)
        static, transient = static + held, max(transient, peak)
        for stage, value in stage_seconds(role, workload.models[role], layout, workload, cluster).items():
            stages[stage] = stages.get(stage, 0.0) + value
    if static + transient > cluster.device_memory:
        return None
    return DeviceSet(tuple(layouts), devices.pop(), dict(layouts), stages, static + transient)


def step_plan(sets: list[DeviceSet], overlapped: bool = False) -> Plan:
    """A step's seconds: per phase the busiest set, summed over the phases; ``overlapped`` (one step off
    policy): generation beside the scoring and update phases, then the weight transfer."""
    per_phase = tuple(max(sum(s.stage_seconds.get(stage, 0.0) for stage in phase) for s in sets) for phase in phases())
    transfer = max(s.stage_seconds.get("weight_transfer", 0.0) for s in sets)
    generation, *training = per_phase
    seconds = max(generation, sum(training)) + transfer if overlapped else sum(per_phase)
    return Plan(tuple(sets), seconds, (*per_phase, transfer))


def plan_run(workload: Workload, cluster: ClusterSpec) -> list[Plan]:
    """Every feasible plan of ``workload`` on ``cluster``, fastest first; ValueError when none fits."""
    plans = Planner(workload, cluster).plans()
    if not plans:
        sizes = ", ".join(f"{role.value} {shape.params / 1e9:.2f}B" for role, shape in workload.models.items())
        raise ValueError(
            f"no placement fits: the models ({sizes}) do not fit in {cluster.devices} devices of "
            f"{cluster.device_memory / 1e9:.0f} GB; add nodes or use smaller models or batches"
        )
    return plans
