"""Every config check that can fail, run before Ray starts or any model loads."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.algorithms import (
    AGG_MODES,
    KL_TYPES,
    AdvantageConfig,
    get_adv_estimator,
    get_policy_loss,
    make_kl_controller,
)
from hybridflow.engine.fsdp import DTYPES
from hybridflow.engine.optim import SCHEDULES
from hybridflow.models import list_builtin_models
from hybridflow.reward.custom import load_custom_reward_fn
from hybridflow.rollout.registry import ROLLOUT_BACKENDS
from hybridflow.trainer.checkpoint import CheckpointManager
from hybridflow.trainer.config import ConfigError, HybridFlowConfig
from hybridflow.trainer.tracking import KNOWN_LOGGERS, check_loggers


def _check(condition: bool, key: str, problem: str, fix: str = "") -> None:
    if not condition:
        raise ConfigError(key, problem, fix)


def _check_choice(value: str, choices, key: str) -> None:
    _check(value in choices, key, f"'{value}' is not one of {sorted(choices)}", f"set {key} to one of them")


def _check_registry(lookup, name: str, key: str) -> None:
    try:
        lookup(name)
    except (ValueError, KeyError) as error:
        raise ConfigError(key, str(error)) from None


def _check_files(files: list[str], key: str, required: bool) -> None:
    _check(
        bool(files) or not required,
        key,
        "no files given",
        f"{key}=[path/to/train.parquet]; make a built-in task with: python -m hybridflow.data.tasks arithmetic --out data/arithmetic",
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
    _check(train > 0, "data.train_batch_size", f"must be positive, got {train}")
    _check(n > 0, "actor_rollout_ref.rollout.n", f"must be positive, got {n}")
    sections = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)]
    if get_adv_estimator(cfg.algorithm.adv_estimator).needs_values:
        sections.append(("critic", cfg.critic))
    for prefix, section in sections:
        mini = section.ppo_mini_batch_size
        _check(
            mini > 0 and train % mini == 0,
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
        _check(section.ppo_micro_batch_size_per_gpu > 0, f"{prefix}.ppo_micro_batch_size_per_gpu", "must be positive")
        _check(section.ppo_epochs > 0, f"{prefix}.ppo_epochs", "must be positive")


def check_config(cfg: HybridFlowConfig) -> None:
    """Raise ConfigError naming the first problem; returns quietly when the config can run."""
    arr, algo, trainer = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    _check_files(cfg.data.train_files, "data.train_files", required=True)
    _check_files(cfg.data.val_files, "data.val_files", required=False)
    _check_model_path(arr.model.path, "actor_rollout_ref.model.path")
    _check_registry(get_adv_estimator, algo.adv_estimator, "algorithm.adv_estimator")
    _check_registry(get_policy_loss, arr.actor.policy_loss.loss_mode, "actor_rollout_ref.actor.policy_loss.loss_mode")
    for key, value in [
        ("actor_rollout_ref.actor.loss_agg_mode", arr.actor.loss_agg_mode),
        ("critic.loss_agg_mode", cfg.critic.loss_agg_mode),
    ]:
        _check_choice(value, AGG_MODES, key)
    _check_choice(arr.actor.kl_loss_type, KL_TYPES, "actor_rollout_ref.actor.kl_loss_type")
    _check_choice(algo.kl_penalty, KL_TYPES, "algorithm.kl_penalty")
    _check_choice(algo.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    make_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
    try:
        AdvantageConfig(
            algo.gamma,
            algo.lam,
            algo.norm_adv_by_std_in_grpo,
            algo.epsilon,
            algo.gae_whiten,
            algo.pass_k,
            algo.gpg_norm_by_std,
        )
    except ValueError as error:
        raise ConfigError("algorithm", str(error)) from None
    _check_choice(arr.rollout.name, ROLLOUT_BACKENDS, "actor_rollout_ref.rollout.name")
    for key, dtype in [
        ("actor_rollout_ref.rollout.dtype", arr.rollout.dtype),
        ("actor_rollout_ref.actor.fsdp.param_dtype", arr.actor.fsdp.param_dtype),
    ]:
        _check_choice(dtype, DTYPES, key)
    for key, optim in [("actor_rollout_ref.actor.optim", arr.actor.optim), ("critic.optim", cfg.critic.optim)]:
        _check_choice(optim.lr_scheduler, SCHEDULES, f"{key}.lr_scheduler")
        _check(optim.lr >= 0, f"{key}.lr", f"must be >= 0, got {optim.lr}")
    _check_choice(
        arr.rollout.old_log_prob_source,
        ("recompute", "rollout", "auto"),
        "actor_rollout_ref.rollout.old_log_prob_source",
    )
    _check(arr.rollout.response_length > 0, "actor_rollout_ref.rollout.response_length", "must be positive")
    _check_batch_sizes(cfg)
    for key, limit in [
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.actor.log_prob_max_token_len_per_gpu", arr.actor.log_prob_max_token_len_per_gpu),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_max_token_len_per_gpu),
        ("critic.ppo_max_token_len_per_gpu", cfg.critic.ppo_max_token_len_per_gpu),
        ("critic.forward_max_token_len_per_gpu", cfg.critic.forward_max_token_len_per_gpu),
    ]:
        _check(limit > 0, key, f"must be positive, got {limit}")
    if get_adv_estimator(algo.adv_estimator).needs_values and cfg.critic.model.path:
        _check_model_path(cfg.critic.model.path, "critic.model.path")
    if cfg.reward_model.enable:
        _check(
            bool(cfg.reward_model.model.path),
            "reward_model.model.path",
            "reward_model.enable is true but no model is given",
        )
        _check_model_path(cfg.reward_model.model.path, "reward_model.model.path")
    if cfg.custom_reward_function.path:
        _check_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    _check_choice(trainer.device, ("cpu", "cuda"), "trainer.device")
    _check(
        trainer.device == "cpu" or torch.cuda.is_available(),
        "trainer.device",
        "cuda asked for but no GPU is visible",
        "trainer.device=cpu",
    )
    _check(
        trainer.nnodes > 0 and trainer.n_workers_per_node > 0,
        "trainer.n_workers_per_node",
        "nnodes and n_workers_per_node must be positive",
    )
    for name in trainer.logger:
        _check_choice(name, KNOWN_LOGGERS, "trainer.logger")
    try:
        check_loggers(trainer.logger)
    except ImportError as error:
        raise ConfigError("trainer.logger", str(error), "install the package or drop the logger") from None
    _check(trainer.total_epochs > 0, "trainer.total_epochs", "must be positive")
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
