"""The timeline of one training step: which pool (or the driver) ran which stage, from when to when; and the
one way the driver times and shows a stage (``StepTimeline.stage``).

Workers time every call they run (``WorkerHost.take_spans``); the driver times its own stages
(reward scoring, advantages). One step's spans go to ``<run_dir>/timeline.jsonl`` (run_files.py
defines the file and its ``Span``), times in seconds since the step began; ``hybridflow report`` draws
them as a Gantt chart per pool, so stages that overlap on different pools are visible at a glance.
Clocks are each process's wall clock: across machines they are as good as the machines' time sync.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from hybridflow.controller import RayWorkerGroup
from hybridflow.run_files import Span, append_spans
from hybridflow.trainer.services.progress import RunProgress

# the stage a worker method is (the names of the timing_s/* metrics); other methods keep their names
STAGE_OF_METHOD = {
    "generate_sequences": "gen",
    "compute_log_prob": "old_log_prob",
    "compute_ref_log_prob": "ref",
    "compute_teacher_log_prob": "teacher",
    "compute_values": "values",
    "compute_rm_score": "rm",
    "update_critic": "update_critic",
    "update_actor": "update_actor",
    "send_weights": "weight_transfer",  # asynchronous modes: the actor's pool sends, the rollout's receives
    "receive_weights": "weight_transfer",
}

# how the progress display names a stage (the timeline and the timing_s/* metrics use the keys)
STAGE_LABELS = {
    "gen": "generation",
    "update_actor": "actor update",
    "update_critic": "critic update",
    "validate": "validation",
    "save_checkpoint": "checkpoint",
    "weight_transfer": "weight transfer",
    "train_batch": "training",
}


class PoolGroups(Protocol):
    """The run's worker groups by pool (``RoleGroups``)."""

    def by_pool(self) -> Mapping[str, RayWorkerGroup]: ...


class StepTimeline:
    """The spans of one step, gathered from the driver's own stages and from every pool's workers."""

    def __init__(self, step: int, progress: RunProgress | None = None) -> None:
        self.step = step
        self.progress = progress
        self.start = time.time()
        self.spans: list[Span] = []

    def _add(self, lane: str, stage: str, rank: int, start: float, end: float) -> None:
        """A span from wall-clock times."""
        self.spans.append(Span(self.step, lane, stage, rank, start - self.start, end - self.start))

    def driver_span(self, stage: str, start: float, end: float) -> None:
        """The driver's own work from ``start`` to ``end`` (wall clock), timed by the caller."""
        self._add("driver", stage, -1, start, end)

    @contextlib.contextmanager
    def stage(self, name: str, *, on_driver: bool = False) -> Iterator[None]:
        """One stage of the step, shown on the progress display while it runs. ``on_driver``: the driver does
        the work itself (reward, adv, validate, save_checkpoint), so it is timed here, as a span of the
        driver's lane; a stage that workers run is timed by them (``collect``) and only shown here."""
        start = time.time()
        with contextlib.ExitStack() as shown:
            if self.progress is not None:
                shown.enter_context(self.progress.stage(STAGE_LABELS.get(name, name)))
            try:
                yield
            finally:
                if on_driver:
                    self.driver_span(name, start, time.time())

    def absorb(self, other: StepTimeline) -> None:
        """Take the spans of ``other`` (the driver's work for another step that ran during this one, e.g. the
        next batch's reward scoring in asynchronous training), re-timed from this step's start."""
        shift = other.start - self.start
        for span in other.spans:
            self.spans.append(Span(self.step, span.lane, span.stage, span.rank, span.start + shift, span.end + shift))
        other.spans = []

    def collect(self, groups: PoolGroups, pools: Collection[str] | None = None) -> None:
        """Take the spans every pool's workers (or those of ``pools``) recorded since the last take."""
        for pool, group in groups.by_pool().items():
            if pools is None or pool in pools:
                self.collect_group(pool, group)

    def collect_group(self, pool: str, group: RayWorkerGroup) -> None:
        """Take the spans the workers of ``group`` (on ``pool``) recorded since the last take."""
        for rank, spans in enumerate(group.take_spans()):
            for _role, method, start, end in spans:
                self._add(pool, STAGE_OF_METHOD.get(method, method), rank, start, end)

    def stage_seconds(self) -> dict[str, float]:
        """Per stage: the busiest rank's (or the driver's) total time in it."""
        per_rank: dict[tuple[str, str, int], float] = defaultdict(float)
        for span in self.spans:
            per_rank[(span.stage, span.lane, span.rank)] += span.end - span.start
        seconds: dict[str, float] = {}
        for (stage, _lane, _rank), total in per_rank.items():
            seconds[stage] = max(seconds.get(stage, 0.0), total)
        return seconds

    def append_to(self, path: Path) -> None:
        """The step's spans, in start order, at the end of ``path`` (timeline.jsonl)."""
        append_spans(path, sorted(self.spans, key=lambda s: (s.start, s.lane, s.rank)))
