"""The one training loop every trainer runs: resume, steps, validation and checkpoints when due, the run's records.

    resume (if asked) -> begin (step 0: the trainer made ready, validation before training when due)
        -> step 1, 2, ...: trainer.step -> validation when due -> checkpoint when due
                           -> timeline.jsonl, the trackers, the progress display
        -> the trainer's end (stops what it runs in the background; also when a step fails)

A trainer is what this loop is given: its ``step`` (one training step's work and metrics; None when its data
ran out), its ``validate``, what a checkpoint holds of it (``checkpoint``/``restore``), and the pools whose
workers' spans belong to the timeline (``collect_spans``). ``Trainer`` names the whole interface; a new kind
of training is one class that implements it (tests/trainer/test_step_loop.py has one in a dozen lines).

The loop owns the step number, the step's timeline (trainer/services/timeline.py: every stage timed and shown the same
way, the driver's and the workers'), the schedule (``Schedule``) and the run directory's records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hybridflow.run_files import TIMELINE_FILE
from hybridflow.trainer.services.checkpoint import CheckpointManager
from hybridflow.trainer.services.checkpoint_check import read_trainer_state
from hybridflow.trainer.services.progress import RunProgress
from hybridflow.trainer.services.timeline import StepTimeline
from hybridflow.trainer.services.tracking import Tracking
from hybridflow.trainer.setup.config import RunConfig

Metrics = dict[str, float]


@dataclass(frozen=True)
class CheckpointParts:
    """What a trainer's checkpoint holds: the driver's state (a JSON object: its step, the loader's position,
    ...) and the files its workers and background machinery write into the checkpoint's directory."""

    state: dict
    write: Callable[[Path], None]


class Trainer(Protocol):
    """What the loop needs of a trainer."""

    shown: tuple[tuple[str, str], ...]  # the metrics the progress line shows: (key, label)

    def begin(self, step: int, timeline: StepTimeline) -> None:
        """Before the first step of this process (``step``: 0, or the step a checkpoint resumed at)."""

    def step(self, step: int, timeline: StepTimeline) -> Metrics | None:
        """Train step ``step``; its metrics, or None when the data ran out before it."""

    def validate(self, step: int, timeline: StepTimeline) -> Metrics:
        """The held-out metrics, with the weights after ``step``."""

    def checkpoint(self, step: int) -> CheckpointParts: ...

    def restore(self, checkpoint: Path, state: dict) -> None:
        """Load a checkpoint's files and the state ``checkpoint`` returned (read and verified by the loop)."""

    def collect_spans(self, timeline: StepTimeline) -> None:
        """Take what the workers recorded since the last take into ``timeline``."""

    def end(self, failed: bool) -> None:
        """After the last step, or when a step failed (``failed``: stop background work now, as its pools end)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How long the run is and when validation and checkpoints are due (the ``trainer`` section's keys)."""

    total_steps: int
    test_freq: int  # validate every test_freq steps and after the last; <= 0: only after the last
    save_freq: int  # checkpoint every save_freq steps and after the last; <= 0: never
    val_before_train: bool
    has_validation: bool  # whether the run has a held-out set at all

    def validate_after(self, step: int) -> bool:
        last = step >= self.total_steps
        return self.has_validation and (last or (self.test_freq > 0 and step % self.test_freq == 0))

    def save_after(self, step: int) -> bool:
        last = step >= self.total_steps
        return self.save_freq > 0 and (last or step % self.save_freq == 0)


def run_schedule(trainer: RunConfig, total_steps: int, *, has_validation: bool) -> Schedule:
    """The schedule of a run's ``trainer`` section, ``total_steps`` long."""
    return Schedule(
        total_steps=total_steps,
        test_freq=trainer.test_freq,
        save_freq=trainer.save_freq,
        val_before_train=trainer.val_before_train,
        has_validation=has_validation,
    )


def fit_run(
    trainer: Trainer,
    run: RunConfig,
    *,
    total_steps: int,
    run_dir: Path,
    record: dict,
    has_validation: bool,
    resume_from: Path | None,
) -> dict[str, float]:
    """A command's run of ``trainer`` to its end: the schedule from its ``trainer`` section (``run``), its trackers
    (``record``: the config they log), finished whatever happens; the last step's metrics."""
    tracking = Tracking(run.logger, run_dir, record)
    schedule = run_schedule(run, total_steps, has_validation=has_validation)
    loop = StepLoop(
        trainer, schedule=schedule, run_dir=run_dir, tracking=tracking, max_ckpt_to_keep=run.max_ckpt_to_keep
    )
    try:
        return loop.fit(resume_from=resume_from)
    finally:
        tracking.finish()


class StepLoop:
    """Runs a ``Trainer`` to ``schedule.total_steps``, recording into ``run_dir`` and ``tracking``."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        schedule: Schedule,
        run_dir: Path,
        tracking: Tracking,
        max_ckpt_to_keep: int = -1,
    ):
        self.trainer = trainer
        self.schedule = schedule
        self.run_dir = run_dir
        self.tracking = tracking
        self.checkpoints = CheckpointManager(run_dir, max_ckpt_to_keep)
        self.step = 0

    def fit(self, resume_from: Path | None = None) -> Metrics:
        """Train to the schedule's last step, first resuming from ``resume_from`` (a verified checkpoint) if
        given; the last step's metrics."""
        if resume_from is not None:
            self.resume(resume_from)
        if self.step >= self.schedule.total_steps:
            print(f"nothing to train: the run is at step {self.step} of {self.schedule.total_steps}")
            return {}
        metrics: Metrics = {}
        trainer = self.trainer
        with RunProgress(self.schedule.total_steps, start_step=self.step, shown=trainer.shown) as progress:
            with self.ending():
                self.begin(progress)
                while True:
                    timeline = StepTimeline(self.step + 1, progress)
                    stepped = trainer.step(self.step + 1, timeline)
                    if stepped is None:  # the data ran out
                        break
                    self.step += 1
                    metrics = stepped
                    self.end_step(metrics, timeline, progress)
                    if self.step >= self.schedule.total_steps:
                        break
        return metrics

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """The trainer's end, after the last step or as a failure leaves the loop (a worker died, the user
        stopped the run): what it runs in the background must stop before the Ray session does."""
        try:
            yield
        except BaseException:
            self.trainer.end(failed=True)
            raise
        self.trainer.end(failed=False)

    def begin(self, progress: RunProgress) -> None:
        """Step 0: the trainer made ready, validation before training when due, and (a new run) step 0's
        timeline."""
        timeline = StepTimeline(0, progress)
        self.trainer.begin(self.step, timeline)
        if self.schedule.has_validation and self.schedule.val_before_train and self.step == 0:
            self.tracking.log(self.validate(timeline), step=0)
        self.trainer.collect_spans(timeline)
        if self.step == 0:
            timeline.append_to(self.run_dir / TIMELINE_FILE)

    def validate(self, timeline: StepTimeline) -> Metrics:
        with timeline.stage("validate", on_driver=True):
            return self.trainer.validate(self.step, timeline)

    def end_step(self, metrics: Metrics, timeline: StepTimeline, progress: RunProgress) -> None:
        """Validate when due; write the step's records (its timeline and metrics); checkpoint when due. A due
        checkpoint counts only once the records are written: a run killed at any moment and resumed from its
        newest checkpoint has the records of every step up to it (the resume drops those after it)."""
        if self.schedule.validate_after(self.step):
            metrics.update(self.validate(timeline))
        if not self.schedule.save_after(self.step):
            self.write_records(metrics, timeline)
        else:
            start = time.time()

            def records_first() -> None:
                end = time.time()
                timeline.driver_span("save_checkpoint", start, end)
                metrics["timing_s/save_checkpoint"] = end - start
                self.write_records(metrics, timeline)

            with timeline.stage("save_checkpoint"):  # shown; its span is the one records_first adds
                self.save_checkpoint(before_commit=records_first)
        progress.step_done(self.step, metrics)

    def write_records(self, metrics: Metrics, timeline: StepTimeline) -> None:
        self.trainer.collect_spans(timeline)
        timeline.append_to(self.run_dir / TIMELINE_FILE)
        self.tracking.log(metrics, step=self.step)

    def save_checkpoint(self, before_commit: Callable[[], None] | None = None) -> Path:
        parts = self.trainer.checkpoint(self.step)
        state = {"global_step": self.step, **parts.state}
        return self.checkpoints.save(self.step, parts.write, state, before_commit=before_commit)

    def resume(self, checkpoint: Path) -> None:
        state = read_trainer_state(checkpoint)  # before the workers load: a bad one fails here, not in them
        self.trainer.restore(checkpoint, state)
        self.step = state["global_step"]
        print(f"resumed from {checkpoint} at step {self.step}")
