"""The run directory before a run starts: writable, free of interrupted saves, compatible with what it
already holds, and with metrics that will not repeat steps.

Everything here happens before Ray starts, and nothing the directory held is overwritten until the
checks pass: a run directory written by another model or data refuses to resume, with its old
``config.yaml`` untouched.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from hybridflow.algorithms import get_adv_estimator
from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager, CheckpointNotFound, read_trainer_state
from hybridflow.trainer.config import ConfigError, HybridFlowConfig, to_yaml
from hybridflow.trainer.timeline import TIMELINE_FILE

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
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


def _uses_critic(values) -> bool | None:
    try:
        return get_adv_estimator(str(OmegaConf.select(values, "algorithm.adv_estimator"))).needs_values
    except ValueError:
        return None


def incompatible_keys(saved: Path, config: HybridFlowConfig) -> list[str]:
    """``key: old -> new`` for each state key on which the run directory's config differs from ``config``."""
    old, new = OmegaConf.load(saved), OmegaConf.create(to_yaml(config))
    differences = [
        f"{key}: {OmegaConf.select(old, key)!r} -> {OmegaConf.select(new, key)!r}"
        for key in STATE_KEYS
        if OmegaConf.select(old, key) != OmegaConf.select(new, key)
    ]
    if _uses_critic(old) != _uses_critic(new):
        differences.append(f"algorithm.adv_estimator: {old.algorithm.adv_estimator} -> {new.algorithm.adv_estimator}")
    elif _uses_critic(new) and OmegaConf.select(old, "critic.model.path") != config.critic.model.path:
        differences.append(
            f"critic.model.path: {OmegaConf.select(old, 'critic.model.path')!r} -> {config.critic.model.path!r}"
        )
    return differences


def _keep_records_up_to(path: Path, step: int) -> int:
    """Drop the records of steps after ``step`` (logged after the checkpoint, and about to be redone)."""
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def prepare_run_dir(config: HybridFlowConfig) -> Path | None:
    """Check and tidy the run directory, write the config; returns the checkpoint to resume from (or None).

    ConfigError (naming ``trainer.default_local_dir``) when it cannot be written or holds a run whose
    checkpoints do not fit this config."""
    trainer = config.trainer
    run_dir = Path(trainer.default_local_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{time.time_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            "trainer.default_local_dir",
            f"cannot write to {run_dir}: {error.strerror or error}",
            "give a directory this user can write to",
        ) from None
    checkpoints = CheckpointManager(run_dir, trainer.max_ckpt_to_keep)
    for stale in checkpoints.remove_unfinished():
        print(f"removed {stale.name}, left by an interrupted checkpoint save")
    try:
        checkpoint = checkpoints.resume_from(trainer.resume_mode)  # verified once, here, before any worker
    except (CheckpointNotFound, CheckpointError) as error:
        raise ConfigError("trainer.resume_mode", str(error)) from None
    saved_config = run_dir / CONFIG_FILE
    if checkpoint is not None and saved_config.is_file():
        differences = incompatible_keys(saved_config, config)
        if differences:
            raise ConfigError(
                "trainer.default_local_dir",
                f"{run_dir} holds checkpoints of another run ({'; '.join(differences)}), which this config "
                "cannot continue",
                "change trainer.experiment_name (a new run directory), or set trainer.resume_mode=disable to "
                "start over here",
            )
    for name in (METRICS_FILE, TIMELINE_FILE):
        log = run_dir / name
        if checkpoint is not None and log.is_file():
            step = read_trainer_state(checkpoint)["global_step"]
            if dropped := _keep_records_up_to(log, step):
                print(f"{name}: dropped {dropped} record(s) after step {step}, which the resumed run redoes")
        elif log.is_file() and log.stat().st_size:
            kept = log.with_name(f"{log.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            log.rename(kept)
            print(f"{run_dir} held {name} of an earlier run without a checkpoint to resume: kept it as {kept.name}")
    saved_config.write_text(to_yaml(config))
    return checkpoint
