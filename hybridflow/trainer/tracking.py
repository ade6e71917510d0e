"""Where step metrics go: a compact console table and a jsonl file (one line per step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONSOLE_KEYS = (
    "critic/score/mean",
    "val/score/mean",
    "response_length/mean",
    "actor/entropy",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "actor/kl_loss",
    "critic/vf_loss",
    "timing_s/step",
    "perf/tokens_per_second",
)


class ConsoleLogger:
    def __init__(self, console: Console | None = None):
        self.console = console or Console()

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = [(k, metrics[k]) for k in CONSOLE_KEYS if k in metrics]
        table = Table(title=f"step {step}", show_header=False, box=None, padding=(0, 2))
        for key, value in shown:
            table.add_row(key, f"{value:.4g}")
        self.console.print(table)


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, **clean}) + "\n")


class Tracking:
    """One call per step, to every configured logger."""

    def __init__(self, loggers: list[str], run_dir: Path):
        self.run_dir = run_dir
        makers = {"console": lambda: ConsoleLogger(), "jsonl": lambda: JsonlLogger(run_dir / "metrics.jsonl")}
        self.loggers = [makers[name]() for name in loggers]

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)
