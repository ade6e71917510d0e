"""The timeline of one training step: which pool (or the driver) ran which stage, from when to when.

Workers time every call they run (``WorkerHost.take_spans``); the driver times its own stages
(reward scoring, advantages). One step's spans go to ``<run_dir>/timeline.jsonl``, one object per
span, times in seconds since the step began:

    {"step": 3, "lane": "critic", "stage": "values", "rank": 0, "start": 1.25, "end": 4.5}

``lane`` is a resource pool's name or ``driver`` (rank -1). ``hybridflow report`` draws them as a
Gantt chart per pool, so stages that overlap on different pools are visible at a glance. Clocks
are each process's wall clock: across machines they are as good as the machines' time sync.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridflow.trainer.roles import RoleGroups

TIMELINE_FILE = "timeline.jsonl"

# the stage a worker method is (the names of the timing_s/* metrics); other methods keep their names
STAGE_OF_METHOD = {
    "generate_sequences": "gen",
    "compute_log_prob": "old_log_prob",
    "compute_ref_log_prob": "ref",
    "compute_values": "values",
    "compute_rm_score": "rm",
    "update_critic": "update_critic",
    "update_actor": "update_actor",
}


@dataclass(frozen=True)
class Span:
    lane: str  # a pool's name, or "driver"
    stage: str
    rank: int  # the worker's rank in its pool; -1 on the driver
    start: float  # wall-clock seconds
    end: float


class StepTimeline:
    """The spans of one step, gathered from the driver's own stages and from every pool's workers."""

    def __init__(self) -> None:
        self.start = time.time()
        self.spans: list[Span] = []

    @contextlib.contextmanager
    def driver(self, stage: str) -> Iterator[None]:
        """Time a stage the driver itself runs."""
        start = time.time()
        try:
            yield
        finally:
            self.spans.append(Span("driver", stage, -1, start, time.time()))

    def collect(self, groups: RoleGroups) -> None:
        """Take the spans every pool's workers recorded since the last take."""
        for pool, group in groups.by_pool().items():
            for rank, spans in enumerate(group.take_spans()):
                for _role, method, start, end in spans:
                    self.spans.append(Span(pool, STAGE_OF_METHOD.get(method, method), rank, start, end))

    def stage_seconds(self) -> dict[str, float]:
        """Per stage: the busiest rank's (or the driver's) total time in it."""
        per_rank: dict[tuple[str, str, int], float] = defaultdict(float)
        for span in self.spans:
            per_rank[(span.stage, span.lane, span.rank)] += span.end - span.start
        seconds: dict[str, float] = {}
        for (stage, _lane, _rank), total in per_rank.items():
            seconds[stage] = max(seconds.get(stage, 0.0), total)
        return seconds

    def records(self, step: int) -> list[dict]:
        """The spans as timeline.jsonl objects, times relative to the step's start, in start order."""
        return [
            asdict(span) | {"step": step, "start": span.start - self.start, "end": span.end - self.start}
            for span in sorted(self.spans, key=lambda s: (s.start, s.lane, s.rank))
        ]

    def append_to(self, path: Path, step: int) -> None:
        with path.open("a") as out:
            for record in self.records(step):
                out.write(json.dumps(record) + "\n")
