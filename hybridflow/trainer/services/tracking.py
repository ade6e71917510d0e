"""Where step metrics go: one ``Tracking.log(metrics, step)`` per step, fanned out to each logger.

    trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]

- console:     a compact table of the metrics people watch (rich)
- jsonl:       ``<run_dir>/metrics.jsonl``, one JSON object per step with a ``step`` key (run_files.py)
               (``hybridflow report`` reads it)
- tensorboard: event files under ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``)
- wandb:       a wandb run in ``<run_dir>/wandb``; offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` later)
- mlflow:      a local SQLite store ``<run_dir>/mlruns/mlflow.db`` (MLflow 3 retired the plain-file store), artifacts
               beside it (``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlruns/mlflow.db``)

tensorboard, wandb and mlflow are optional packages: asking for one that is not installed fails at once
(``check_loggers``, called by config validation, and again in ``Tracking``) with the pip command to run.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from rich import get_console
from rich.console import Console
from rich.table import Table

from hybridflow.run_files import METRICS_FILE, append_metrics

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# logger name -> (the modules it can use, any one is enough; the pip command that installs one)
OPTIONAL_PACKAGES = {
    "tensorboard": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": (("wandb",), "pip install wandb"),
    "mlflow": (("mlflow",), "pip install mlflow"),
}

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
    "distill/reverse_kl_mean",
    "sft/loss",
    "sft/grad_norm",
    "val/loss",
    "val/perplexity",
    "timing_s/step",
    "perf/tokens_per_second",
)


class LoggerNotInstalledError(ImportError):
    """A logger in ``trainer.logger`` needs a package that is not installed."""


def _missing(name: str) -> LoggerNotInstalledError:
    modules, command = OPTIONAL_PACKAGES[name]
    return LoggerNotInstalledError(
        f"trainer.logger asks for '{name}', but the {modules[0]} package is not installed. "
        f"Install it with `{command}`, or remove '{name}' from trainer.logger."
    )


def check_loggers(names: list[str]) -> None:
    """Fail fast (without importing anything heavy): unknown names -> ValueError, missing packages ->
    LoggerNotInstalledError."""
    for name in names:
        if name not in KNOWN_LOGGERS:
            raise ValueError(f"trainer.logger: unknown logger '{name}' (choose from {', '.join(KNOWN_LOGGERS)})")
        if name in OPTIONAL_PACKAGES and not any(importlib.util.find_spec(m) for m in OPTIONAL_PACKAGES[name][0]):
            raise _missing(name)


def _import_for(name: str) -> Any:
    """The first importable module that serves logger ``name``, or LoggerNotInstalledError."""
    for module in OPTIONAL_PACKAGES[name][0]:
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise _missing(name)


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics as floats (strings, NaN and inf are left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are kept as values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


class ConsoleLogger:
    def __init__(self, console: Console | None = None):
        self.console = console or get_console()  # shared with the progress bars, which then stay below the tables

    def log(self, metrics: dict[str, Any], step: int) -> None:
        shown = [(k, v) for k in CONSOLE_KEYS if isinstance(v := metrics.get(k), (int, float))]
        table = Table(title=f"step {step}", show_header=False, box=None, padding=(0, 2))
        for key, value in shown:
            table.add_row(key, f"{value:.4g}")
        self.console.print(table)

    def finish(self) -> None:
        pass


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        append_metrics(self.path, step, clean)

    def finish(self) -> None:
        pass


class TensorboardLogger:
    """Scalars via torch.utils.tensorboard (or tensorboardX), flushed every step so a crashed run keeps its curves."""

    def __init__(self, log_dir: Path, config: dict[str, Any] | None):
        module = _import_for("tensorboard")
        if module.__name__ == "tensorboardX":
            writer_class = module.SummaryWriter
        else:
            from torch.utils.tensorboard import SummaryWriter as writer_class
        self.writer = writer_class(log_dir=str(log_dir))
        if config:
            text = "\n".join(f"    {k} = {v!r}" for k, v in flatten(config).items())  # indented: markdown code block
            self.writer.add_text("config", text, 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict[str, Any] | None):
        wandb = _import_for("wandb")
        mode = os.environ.get("WANDB_MODE", "offline")  # no network by default; WANDB_MODE=online to sync live
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config or {}, mode=mode)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(numeric(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-. /]")


class MlflowLogger:
    """A local MLflow store (one SQLite file); names mlflow refuses ('@' in pass@k) get '_' for the bad characters."""

    def __init__(self, store: Path, project: str, name: str, config: dict[str, Any] | None):
        mlflow = _import_for("mlflow")
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        store = store.resolve()
        store.mkdir(parents=True, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(project, artifact_location=(store / "artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(self.key(k), str(v)[:500]) for k, v in flatten(config or {}).items()]
        for start in range(0, len(params), 100):  # mlflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    @staticmethod
    def key(name: str) -> str:
        return _MLFLOW_BAD_CHARS.sub("_", name)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self.Metric(self.key(k), v, now, step) for k, v in numeric(metrics).items()]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class Tracking:
    """One call per step, to every configured logger.

    ``config``: the run's config as a plain dict (e.g. ``dataclasses.asdict(config)``), recorded by
    tensorboard/wandb/mlflow; its ``trainer.project_name`` / ``trainer.experiment_name`` name the run
    (else the run dir's parent and own name). Call ``finish()`` (or use ``with``) at the end.
    """

    def __init__(
        self, loggers: list[str], run_dir: Path, config: dict[str, Any] | None = None, console: Console | None = None
    ):
        check_loggers(list(loggers))
        self.run_dir = Path(run_dir)
        trainer = (config or {}).get("trainer", {})
        project = str(trainer.get("project_name") or self.run_dir.parent.name or "hybridflow")
        name = str(trainer.get("experiment_name") or self.run_dir.name or "run")
        makers = {
            "console": lambda: ConsoleLogger(console),
            "jsonl": lambda: JsonlLogger(self.run_dir / METRICS_FILE),
            "tensorboard": lambda: TensorboardLogger(self.run_dir / "tensorboard", config),
            "wandb": lambda: WandbLogger(self.run_dir, project, name, config),
            "mlflow": lambda: MlflowLogger(self.run_dir / "mlruns", project, name, config),
        }
        self.loggers: list[Logger] = []
        try:
            for logger_name in dict.fromkeys(loggers):  # each once, in the given order
                self.loggers.append(makers[logger_name]())
        except BaseException:
            self.finish()
            raise

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def finish(self) -> None:
        """Close every logger (flushes tensorboard, ends the wandb/mlflow run). Safe to call twice."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.finish()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
