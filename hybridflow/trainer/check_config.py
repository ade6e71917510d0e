"""The checks of a run that no single section can make, run before Ray starts or any model loads.

Each section validates its own values when the config is built (``__post_init__`` of its
dataclass). What is left here needs several sections at once (batch sizes against the world
size and the group size, which roles the algorithm needs) or the world outside the config
(files, model directories, installed packages, a visible GPU, the checkpoint to resume).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.controller import Role
from hybridflow.models import list_builtin_models
from hybridflow.reward.custom import load_custom_reward_fn
from hybridflow.trainer.checkpoint import CheckpointManager
from hybridflow.trainer.config import ConfigError, HybridFlowConfig
from hybridflow.trainer.roles import needed_roles
from hybridflow.trainer.tracking import check_loggers


def _check(condition: bool, key: str, problem: str, fix: str = "") -> None:
    if not condition:
        raise ConfigError(key, problem, fix)


def _check_files(files: list[str], key: str, required: bool) -> None:
    _check(
        bool(files) or not required,
        key,
        "no files given",
        f"{key}=[path/to/train.parquet]; make a built-in task with: "
        "python -m hybridflow.data.tasks arithmetic --out data/arithmetic",
    )
    for file in files:
        path = Path(file).expanduser()
        _check(path.is_file(), key, f"file '{file}' does not exist", "give existing parquet or jsonl files")
        _check(path.suffix in (".parquet", ".jsonl", ".json"), key, f"'{file}' is not .parquet or .jsonl")


def _check_model_path(path: str, key: str) -> None:
    builtins = list_builtin_models()
    if path in builtins:
        return
    directory = Path(path).expanduser()
    _check(
        directory.is_dir() and (directory / "config.json").is_file(),
        key,
        f"'{path}' is neither a built-in model nor a Hugging Face model directory (with config.json)",
        f"use one of {sorted(builtins)} or a local directory; nothing is downloaded at run time",
    )


def _check_batch_sizes(cfg: HybridFlowConfig) -> None:
    world = cfg.world_size
    n = cfg.actor_rollout_ref.rollout.n
    train = cfg.data.train_batch_size
    sections = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)]
    if Role.Critic in needed_roles(cfg):
        sections.append(("critic", cfg.critic))
    for prefix, section in sections:
        mini = section.ppo_mini_batch_size
        _check(
            train % mini == 0,
            f"{prefix}.ppo_mini_batch_size",
            f"{mini} does not divide data.train_batch_size={train}",
            "choose a divisor of the train batch size",
        )
        _check(
            (mini * n) % world == 0,
            f"{prefix}.ppo_mini_batch_size",
            f"{mini} prompts x rollout.n={n} = {mini * n} samples do not split over {world} ranks",
            "make ppo_mini_batch_size * rollout.n a multiple of nnodes * n_workers_per_node",
        )


def check_config(cfg: HybridFlowConfig) -> None:
    """Raise ConfigError naming the first problem; returns quietly when the config can run."""
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    _check_files(cfg.data.train_files, "data.train_files", required=True)
    _check_files(cfg.data.val_files, "data.val_files", required=False)
    _check_model_path(arr.model.path, "actor_rollout_ref.model.path")
    if Role.Critic in needed_roles(cfg) and cfg.critic.model.path:
        _check_model_path(cfg.critic.model.path, "critic.model.path")
    if cfg.reward_model.enable:
        _check_model_path(cfg.reward_model.model.path, "reward_model.model.path")
    _check_batch_sizes(cfg)
    if cfg.custom_reward_function.path:
        _check_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    _check(
        trainer.device == "cpu" or torch.cuda.is_available(),
        "trainer.device",
        "cuda asked for but no GPU is visible",
        "trainer.device=cpu",
    )
    try:
        check_loggers(trainer.logger)
    except ImportError as error:
        raise ConfigError("trainer.logger", str(error), "install the package or drop the logger") from None
    if trainer.resume_mode not in ("auto", "disable"):
        try:
            CheckpointManager(Path(trainer.default_local_dir)).resume_from(trainer.resume_mode)
        except FileNotFoundError as error:
            raise ConfigError("trainer.resume_mode", str(error)) from None


def _check_custom_reward(path: str, name: str) -> None:
    try:
        load_custom_reward_fn(path, name)
    except (FileNotFoundError, ImportError) as error:
        raise ConfigError("custom_reward_function.path", str(error)) from None
    except (AttributeError, TypeError) as error:
        raise ConfigError("custom_reward_function.name", str(error)) from None
