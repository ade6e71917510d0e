"""When the weights move from the actor to the generator: the part of a training mode (trainer/setup/modes.py).

    SameWeights       (sync)          none move: the hybrid actor generates with the weights it trains (the
                                      3D-HybridEngine switches its layout inside the actor's workers)
    TransferEachStep  (one_step_off)  after every step, with both pools idle
    PushEvery         (fully_async)   every N steps, between two of the rollouter's generation calls

The two that move weights start at ``begin``: the rollout's pool gets the actor's weights (those of a
checkpoint) before anything is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridflow.trainer.asynchronous.rollouter import Rollouter
from hybridflow.trainer.loop.generation import Metrics
from hybridflow.trainer.loop.weight_link import WeightLink
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.setup.roles import RoleGroups


class WeightSync(Protocol):
    def begin(self, step: int, timeline: StepTimeline) -> None: ...

    def after_step(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None: ...


class SameWeights:
    def begin(self, step: int, timeline: StepTimeline) -> None:
        pass

    def after_step(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        pass


@dataclass
class TransferEachStep:
    """The actor's weights of each step to the rollout's ranks as the step ends (both pools idle meanwhile)."""

    link: WeightLink

    def begin(self, step: int, timeline: StepTimeline) -> None:
        self.link.connect()
        self.after_step(step, timeline, {})

    def after_step(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        with timeline.stage("weight_transfer", on_driver=True):
            metrics.update(self.link.send(version=step))


@dataclass
class PushEvery:
    """The actor's weights to the rollout's ranks every ``every`` steps, the rollouter paused between two of its
    calls (or, with partial rollout, its call cut short)."""

    link: WeightLink
    rollouter: Rollouter
    groups: RoleGroups
    rollout_pool: str  # whose spans a push collects: the receiving side's
    every: int

    def begin(self, step: int, timeline: StepTimeline) -> None:
        self.link.connect()
        self.push(step, timeline, {})

    def after_step(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        if step % self.every == 0:
            self.push(step, timeline, metrics)

    def push(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        with self.rollouter.paused() as waited_s:
            with timeline.stage("weight_transfer", on_driver=True):
                metrics.update(self.link.send(version=step))
            timeline.collect(self.groups, pools=[self.rollout_pool])  # the receiving side, while it is ours
            self.rollouter.set_version(step)
        metrics["async/push_wait_s"] = waited_s
