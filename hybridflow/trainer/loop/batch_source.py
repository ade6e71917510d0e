"""Where an RL step's batch comes from: the part of a training mode (trainer/setup/modes.py) that feeds the loop.

    GenerateNow    (sync)          the step's prompts generated now, on the actor's pool, by the weights it trains
    GenerateAhead  (one_step_off)  generated during the step before, on the rollout's pool (generate_ahead.py)
    AsyncQueue     (fully_async)   taken from the queue the rollouter fills without stopping (async_queue.py)

A source hands the trainer each step's scored rollouts in rank order with what their generation measured, and
owns what it runs besides: the checkpoint's record of it (the loader's position, batches already generated), the
pools whose spans it collects, what validation must wait for, and its end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from hybridflow.data import PromptDataLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.generation import Generation, Metrics
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.setup.roles import RoleGroups


def train_batches(loader: PromptDataLoader, total_epochs: int) -> Iterator[DataProto]:
    """The loader's batches, epoch after epoch, from where it stands (a resumed loader: mid-epoch)."""
    while loader.state_dict()["epoch"] < total_epochs:
        yield from loader


class BatchSource:
    """What the RL trainer asks of a source. A subclass implements ``next``; the rest defaults to a source that runs
    nothing beside the step (``GenerateNow``)."""

    def __init__(self, generation: Generation, groups: RoleGroups, loader: PromptDataLoader):
        self.generation = generation
        self.groups = groups
        self.loader = loader

    def next(self, step: int, timeline: StepTimeline) -> tuple[DataProto, Metrics] | None:
        """Step ``step``'s batch and its generation's metrics; None when the data ran out."""
        raise NotImplementedError

    def after_learn(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        """After the step's updates, before the weights move (one_step_off waits for the next batch here)."""

    def account(self, step: int, timeline: StepTimeline, metrics: Metrics) -> None:
        """At the step's end: what the generation running beside it recorded."""

    def checkpoint(self) -> tuple[dict, list[tuple[str, bytes]]]:
        """The loader's position and the files a checkpoint holds of this source (name, contents)."""
        return self.loader.state_dict(), []

    def restore(self, checkpoint: Path, step: int) -> None:
        """Take back what ``checkpoint`` (after step ``step``) holds of this source, the loader's position aside."""

    def collect_spans(self, timeline: StepTimeline) -> None:
        """The spans of the pools the loop may take from now."""
        timeline.collect(self.groups)

    def validation(self, step: int, timeline: StepTimeline) -> AbstractContextManager[None]:
        """Held while validation generates with the weights after ``step``."""
        return contextlib.nullcontext()

    def end(self, failed: bool) -> None:
        """After the last step, or when a step failed: stop what runs in the background."""


class GenerateNow(BatchSource):
    """sync: the step's prompts generated at the start of the step, by the weights it then trains."""

    def __init__(self, generation: Generation, groups: RoleGroups, loader: PromptDataLoader, total_epochs: int):
        super().__init__(generation, groups, loader)
        self.batches = train_batches(loader, total_epochs)  # one iterator: dynamic sampling draws more prompts from it

    def next(self, step: int, timeline: StepTimeline) -> tuple[DataProto, Metrics] | None:
        prompts = next(self.batches, None)
        if prompts is None:
            return None
        metrics: Metrics = {}
        return self.generation.experience(prompts, self.batches, step, timeline, metrics), metrics
