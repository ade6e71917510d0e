"""A progress display for a training run: the run's steps (done/total, ETA, last reward) and each long stage.

On a terminal it draws rich progress bars; elsewhere (a log file, CI, a pipe) it draws nothing and prints
one plain line now and then (``plain_every_s``; ``None`` for silence)::

    progress = RunProgress(total_steps)
    with progress.stage("validation"):
        ...
    for step in range(1, total_steps + 1):
        with progress.stage("generation"):
            ...
        progress.step_done(step, metrics)
    progress.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from time import monotonic
from typing import Any

from rich import get_console
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column

REWARD_KEY = "critic/score/mean"
VAL_KEY = "val/score/mean"
RL_SHOWN = ((REWARD_KEY, "reward"), (VAL_KEY, "val"))  # the metrics an RL run's status line shows, by label


def format_seconds(seconds: float) -> str:
    """``3725.0`` -> ``"1:02:05"``."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class StageHandle:
    """What ``RunProgress.stage`` yields: ``advance(n)`` moves a stage that was given a ``total``."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None, total: float | None = None):
        self._progress, self._task, self.total, self.completed = progress, task, total, 0.0

    def advance(self, amount: float = 1.0) -> None:
        self.completed += amount
        if self._progress is not None and self._task is not None:
            count = f"{self.completed:g}/{self.total:g}" if self.total else ""
            self._progress.update(self._task, advance=amount, count=count)


class RunProgress:
    """Steps done/total with ETA and the latest values of the ``shown`` metrics (an RL run's reward and validation
    score), plus a transient bar per running stage.

    ``enabled``: draw bars (None: only when the console is a terminal). ``start_step``: the step a resumed
    run starts after (the ETA counts only the steps of this process). Use as a context manager or call
    ``close()``.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool | None = None,
        *,
        start_step: int = 0,
        console: Console | None = None,
        plain_every_s: float | None = 60.0,
        shown: tuple[tuple[str, str], ...] = RL_SHOWN,
    ):
        self.console = console or get_console()  # rich's shared console: other rich output prints above the bars
        self.total_steps = total_steps
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.plain_every_s = plain_every_s
        self.start_step = self.step = start_step
        self.started = monotonic()
        self.last_plain = self.started
        self.shown = shown  # (metric key, label): the latest value of each is shown beside the ETA
        self.latest: dict[str, float] = {}
        self._first_done: tuple[int, float] | None = None  # (step, time) of the first step_done
        self._progress: Progress | None = None
        if self.enabled:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}", table_column=Column(min_width=20)),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                refresh_per_second=4,
            )
            self._run_task = self._progress.add_task(
                "run", total=total_steps, completed=start_step, count=f"{start_step}/{total_steps}", info=""
            )
            self._progress.start()

    # ---- stages ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def stage(self, name: str, total: float | None = None) -> Iterator[StageHandle]:
        """A bar for one long stage (generation, update, validation, checkpoint) while it runs; pulses when
        ``total`` is None."""
        if self._progress is None:
            yield StageHandle(total=total)
            return
        task = self._progress.add_task(f"  {name}", total=total, count=f"0/{total:g}" if total else "", info="")
        try:
            yield StageHandle(self._progress, task, total)
        finally:
            self._progress.remove_task(task)

    # ---- steps ----------------------------------------------------------------------------

    def step_done(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Record that training step ``step`` (1-based) finished, with its metrics (for the reward shown)."""
        metrics = metrics or {}
        self.step = step
        if self._first_done is None:
            self._first_done = (step, monotonic())
        for key, _ in self.shown:
            if isinstance(metrics.get(key), (int, float)):
                self.latest[key] = float(metrics[key])
        if self._progress is not None:
            eta = self.eta_seconds()
            info = " | ".join(
                [f"eta {format_seconds(eta) if eta is not None else '?'}"] + ([self._info()] if self._info() else [])
            )
            self._progress.update(self._run_task, completed=step, count=f"{step}/{self.total_steps}", info=info)
            return
        now = monotonic()
        due = self.plain_every_s is not None and now - self.last_plain >= self.plain_every_s
        if due or (self.plain_every_s is not None and step >= self.total_steps):
            self.last_plain = now
            self.console.print(self.status_line(), markup=False, highlight=False)

    def eta_seconds(self) -> float | None:
        """Mean time per step times the steps left; None before the first step.

        From the second step on, the mean is over the steps after the first one, so the validation before
        training and the first step's warm-up do not inflate it.
        """
        if self.step <= self.start_step:
            return None
        if self._first_done is None or self.step == self._first_done[0]:
            per_step = (monotonic() - self.started) / (self.step - self.start_step)
        else:
            per_step = (monotonic() - self._first_done[1]) / (self.step - self._first_done[0])
        return per_step * max(0, self.total_steps - self.step)

    def status_line(self) -> str:
        """``step 12/100 (12%) | elapsed 0:03:10 | eta 0:23:13 | reward 0.4375 | val 0.5``."""
        percent = 100.0 * self.step / self.total_steps if self.total_steps > 0 else 100.0
        eta = self.eta_seconds()
        parts = [
            f"step {self.step}/{self.total_steps} ({percent:.0f}%)",
            f"elapsed {format_seconds(monotonic() - self.started)}",
            f"eta {format_seconds(eta) if eta is not None else '?'}",
        ]
        return " | ".join(parts + ([self._info()] if self._info() else []))

    def _info(self) -> str:
        return " | ".join(f"{label} {self.latest[key]:.4g}" for key, label in self.shown if key in self.latest)

    def refresh(self) -> None:
        """Redraw now (the bars also redraw by themselves a few times a second)."""
        if self._progress is not None:
            self._progress.refresh()

    def close(self) -> None:
        """Stop drawing (leaves the final run bar on screen). Safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
