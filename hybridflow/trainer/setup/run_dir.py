"""The run directory before a run starts: writable, free of interrupted saves, compatible with what it
already holds, and with metrics that will not repeat steps.

Everything here happens before Ray starts, and nothing in the directory is written or deleted until the
checks pass (the checkpoint to resume verified, the saved config compatible): a run directory written by
another model or data refuses to resume, with its old ``config.yaml`` and interrupted saves untouched. The
checks (``check_run_dir``) come before a run builds its models; the changes (``CheckedRunDir.prepare``)
once every other check has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.controller import Role
from hybridflow.run_files import (
    CONFIG_FILE,
    CRITIC_STATE,
    METRICS_FILE,
    TIMELINE_FILE,
    TRAINED_PROMPTS_FILE,
    keep_records_up_to,
)
from hybridflow.trainer.services.checkpoint import CheckpointError, CheckpointManager, CheckpointNotFound
from hybridflow.trainer.services.checkpoint_check import read_trainer_state
from hybridflow.trainer.setup.config import ConfigError, HybridFlowConfig, RunConfig, to_yaml
from hybridflow.trainer.setup.run_plan import RunPlan

# metrics.jsonl and timeline.jsonl hold one record per step (or span): on resume the steps after the
# checkpoint are dropped (the run redoes them); a fresh run in a used directory sets the old ones aside

# Keys whose change makes a directory's checkpoints mean something else: the models (the shapes of the
# state), and what the data loader's saved position counts (the files, the batch size, the order).
STATE_KEYS = (
    "actor_rollout_ref.model.path",
    "data.train_files",
    "data.train_batch_size",
    "data.shuffle",
    "trainer.seed",
)


def changed_keys(saved: Path, config_yaml: str, keys: tuple[str, ...]) -> list[str]:
    """``key: old -> new`` for each of ``keys`` on which the saved config differs from ``config_yaml``."""
    try:
        old = OmegaConf.load(saved)
        if not isinstance(old, DictConfig):
            raise ValueError(f"a YAML {type(old).__name__}, not a mapping")
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(
            "trainer.default_local_dir",
            f"{saved} cannot be read ({type(error).__name__}: {' '.join(str(error).split())}), so whether its "
            "checkpoints fit this config is unknown",
            "restore the file, change trainer.experiment_name (a new run directory), or set "
            "trainer.resume_mode=disable to start over here",
        ) from None
    new = OmegaConf.create(config_yaml)
    return [
        f"{key}: {OmegaConf.select(old, key)!r} -> {OmegaConf.select(new, key)!r}"
        for key in keys
        if OmegaConf.select(old, key) != OmegaConf.select(new, key)
    ]


def incompatible_keys(saved: Path, checkpoint: Path, config: HybridFlowConfig, plan: RunPlan) -> list[str]:
    """``key: old -> new`` for each state key on which the run directory's config differs from ``config``,
    and the estimator when the checkpoint holds a critic the plan has none for (or lacks the one it needs)."""
    differences = changed_keys(saved, to_yaml(config), STATE_KEYS)
    uses_critic = plan.needs(Role.Critic)
    old = OmegaConf.load(saved)
    if (checkpoint / CRITIC_STATE).is_dir() != uses_critic:
        estimator = config.algorithm.adv_estimator
        differences.append(f"algorithm.adv_estimator: {old.algorithm.adv_estimator} -> {estimator}")
    elif uses_critic and OmegaConf.select(old, "critic.model.path") != config.critic.model.path:
        differences.append(
            f"critic.model.path: {OmegaConf.select(old, 'critic.model.path')!r} -> {config.critic.model.path!r}"
        )
    return differences


def _check_writable(run_dir: Path) -> None:
    """Refuse a run directory this user cannot make or write, without making it: a refused run leaves nothing
    behind. The probe goes into the directory if it exists, else into its nearest existing parent."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "not a directory", str(existing))
        probe = existing / f".write-test-{time.time_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            "trainer.default_local_dir",
            f"cannot write to {run_dir}: {error.strerror or error}" + (f" ({existing})" if existing != run_dir else ""),
            "give a directory this user can write to",
        ) from None


@dataclass(frozen=True)
class CheckedRunDir:
    """A run directory that passed its checks (``check_run_directory``), not yet changed."""

    run_dir: Path
    checkpoints: CheckpointManager
    checkpoint: Path | None  # the verified checkpoint to resume, or None: a fresh run
    config_yaml: str  # what the run writes as its config.yaml

    def prepare(self) -> Path | None:
        """Tidy the directory and write the config; returns the checkpoint to resume from (or None). Call it once
        the run's other checks have passed too: from here on the directory changes."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _tidy(self.run_dir, self.checkpoints, self.checkpoint)
            (self.run_dir / CONFIG_FILE).write_text(self.config_yaml)
        except OSError as error:
            where = error.filename or self.run_dir
            raise ConfigError(
                "trainer.default_local_dir", f"cannot update {where}: {error.strerror or error}"
            ) from None
        return self.checkpoint


def check_run_dir(config: HybridFlowConfig, plan: RunPlan) -> CheckedRunDir:
    """An RL run's ``check_run_directory``: its checkpoints fit if the state keys and the critic match."""
    return check_run_directory(
        plan.paths.run_dir,
        config.trainer,
        to_yaml(config),
        lambda saved, checkpoint: incompatible_keys(saved, checkpoint, config, plan),
    )


def prepare_run_dir(config: HybridFlowConfig, plan: RunPlan) -> Path | None:
    """``check_run_dir``, then ``prepare``: the checkpoint to resume from (or None)."""
    return check_run_dir(config, plan).prepare()


def check_run_directory(
    run_dir: Path,
    trainer: RunConfig,
    config_yaml: str,
    incompatible: Callable[[Path, Path], list[str]],
) -> CheckedRunDir:
    """Check the run directory without changing it (no model needed: a run does this before it builds one).
    ``incompatible(saved config, checkpoint)``: what makes the directory's checkpoints unfit for this config.

    ConfigError (naming ``trainer.resume_mode`` or ``trainer.default_local_dir``) when the checkpoint to
    resume is damaged, or the directory holds a run whose checkpoints do not fit this config, or it cannot
    be written."""
    checkpoints = CheckpointManager(run_dir, trainer.max_ckpt_to_keep)
    try:
        checkpoint = checkpoints.resume_from(trainer.resume_mode)  # verified once, here, before any worker
    except (CheckpointNotFound, CheckpointError) as error:
        raise ConfigError("trainer.resume_mode", str(error)) from None
    saved_config = run_dir / CONFIG_FILE
    if checkpoint is not None and saved_config.is_file():
        differences = incompatible(saved_config, checkpoint)
        if differences:
            raise ConfigError(
                "trainer.default_local_dir",
                f"{run_dir} holds checkpoints of another run ({'; '.join(differences)}), which this config "
                "cannot continue",
                "change trainer.experiment_name (a new run directory), or set trainer.resume_mode=disable to "
                "start over here",
            )
    _check_writable(run_dir)
    return CheckedRunDir(run_dir=run_dir, checkpoints=checkpoints, checkpoint=checkpoint, config_yaml=config_yaml)


def _tidy(run_dir: Path, checkpoints: CheckpointManager, checkpoint: Path | None) -> None:
    """Remove interrupted saves; drop the records the resumed run redoes, or set a fresh run's aside."""
    for stale in checkpoints.remove_unfinished():
        print(f"removed {stale.name}, left by an interrupted checkpoint save")
    for name in (METRICS_FILE, TIMELINE_FILE, TRAINED_PROMPTS_FILE):
        log = run_dir / name
        if checkpoint is not None and log.is_file():
            step = read_trainer_state(checkpoint)["global_step"]
            if dropped := keep_records_up_to(log, step):
                print(f"{name}: dropped {dropped} record(s) after step {step}, which the resumed run redoes")
        elif log.is_file() and log.stat().st_size:
            kept = log.with_name(f"{log.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            log.rename(kept)
            print(f"{run_dir} held {name} of an earlier run without a checkpoint to resume: kept it as {kept.name}")
