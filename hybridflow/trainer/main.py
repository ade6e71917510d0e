"""``hybridflow train key=value ...``: check the config, start Ray, build the worker groups, run the loop.

Also runnable as ``python -m hybridflow.trainer.main key=value ...`` (the same command, errors included).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from rich.console import Console

from hybridflow.controller import Role, RoleSpec, ray_session
from hybridflow.controller.ray_runtime import kernel_cache_env
from hybridflow.data import PromptDataLoader, RLHFDataset
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.reward import RewardManager, load_custom_reward_fn
from hybridflow.tools import load_tools
from hybridflow.trainer import placement
from hybridflow.trainer.check_config import check_agent_names, check_cluster, check_config, local_cluster_cpus
from hybridflow.trainer.config import DEFAULT_CONFIG, ConfigError, HybridFlowConfig, config_sections, load_config
from hybridflow.trainer.ppo_trainer import RayPPOTrainer
from hybridflow.trainer.roles import RoleGroups, needed_roles
from hybridflow.trainer.run_dir import prepare_run_dir
from hybridflow.trainer.tracking import Tracking
from hybridflow.validation import run_command, split_debug_flag
from hybridflow.workers import ActorRolloutWorker, CriticWorker, RefPolicyWorker, RewardModelWorker


def resolve_models(config: HybridFlowConfig) -> None:
    """Turn built-in model names into their cached directories once, on the driver, before workers start; and
    the multi-turn files the workers read (tools, an agent loop's file) into absolute paths, which do not depend
    on a worker's working directory."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.tool_config_path:
        multi_turn.tool_config_path = str(Path(multi_turn.tool_config_path).resolve())
    file, sep, name = multi_turn.default_agent.rpartition(":")
    if sep and file.endswith(".py"):
        multi_turn.default_agent = f"{Path(file).resolve()}:{name}"
    config.actor_rollout_ref.model.path = str(resolve_model_path(config.actor_rollout_ref.model.path))
    critic_model = config.critic.model
    critic_model.path = (
        str(resolve_model_path(critic_model.path)) if critic_model.path else config.actor_rollout_ref.model.path
    )
    if config.reward_model.enable:
        config.reward_model.model.path = str(resolve_model_path(config.reward_model.model.path))


def role_specs(config: HybridFlowConfig, total_steps: int) -> dict[Role, RoleSpec]:
    """Each needed role's worker class and the keyword arguments it is built with on every rank."""
    seed, arr = config.trainer.seed, config.actor_rollout_ref
    specs = {
        Role.ActorRollout: RoleSpec(
            ActorRolloutWorker, kwargs={"config": arr, "total_training_steps": total_steps, "seed": seed}
        ),
        Role.RefPolicy: RoleSpec(RefPolicyWorker, kwargs={"config": arr, "seed": seed}),
        Role.Critic: RoleSpec(
            CriticWorker,
            kwargs={
                "config": config.critic,
                "n_samples": arr.rollout.n,
                "total_training_steps": total_steps,
                "seed": seed,
            },
        ),
        Role.RewardModel: RoleSpec(
            RewardModelWorker,
            kwargs={"config": config.reward_model, "policy_model_path": arr.model.path, "seed": seed},
        ),
    }
    return {role: specs[role] for role in needed_roles(config)}


def run_tool_schemas(config: HybridFlowConfig) -> list[dict] | None:
    """The function schemas of a multi-turn run's tools (the chat template lists them in prompts that know them)."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not (multi_turn.enable and multi_turn.tool_config_path):
        return None
    return load_tools(multi_turn.tool_config_path).schemas


def build_groups(config: HybridFlowConfig, total_steps: int) -> RoleGroups:
    """The worker groups of every role the run needs, placed as ``trainer.placement`` says."""
    return placement.build_groups(config, role_specs(config, total_steps))


def run(config: HybridFlowConfig) -> dict[str, float]:
    console = Console()
    check_config(config)
    resolve_models(config)
    tokenizer = load_tokenizer(config.actor_rollout_ref.model.path)
    data = config.data
    tool_schemas = run_tool_schemas(config)
    train_dataset = RLHFDataset(data.train_files, tokenizer, data, tools=tool_schemas)
    train_loader = PromptDataLoader(
        train_dataset, data.train_batch_size, shuffle=data.shuffle, seed=config.trainer.seed
    )
    val_loader = None
    if data.val_files:
        val_dataset = RLHFDataset(data.val_files, tokenizer, data, tools=tool_schemas)
        val_loader = PromptDataLoader(
            val_dataset, min(data.val_batch_size, len(val_dataset)), shuffle=False, drop_last=False
        )
    custom = config.custom_reward_function
    reward_fn = RewardManager(
        tokenizer, config.reward, load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    )
    all_rows = [*train_dataset.rows, *(val_loader.dataset.rows if val_loader else [])]
    reward_fn.check_scorable(all_rows, multi_turn=config.actor_rollout_ref.rollout.multi_turn.enable)
    check_agent_names(config, all_rows)
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * config.trainer.total_epochs
    if config.trainer.total_training_steps > 0:
        total_steps = min(total_steps, config.trainer.total_training_steps)
    run_dir = Path(config.trainer.default_local_dir)
    checkpoint = prepare_run_dir(config)
    plan = placement.placement_plan(config)
    pools = ", ".join(f"{name} {sum(nodes)}" for name, nodes in plan.pools.items())
    console.print(
        f"[bold]hybridflow[/]: {config.algorithm.adv_estimator} for {total_steps} steps on {plan.processes} "
        f"workers ({config.trainer.placement}: {pools}); run dir {run_dir}"
    )

    joined = config.trainer.ray_address
    with ray_session(
        joined or None,
        None if joined else local_cluster_cpus(config),
        worker_env=kernel_cache_env(config.trainer.cpu_kernel_cache_capacity),
    ):
        if joined:
            check_cluster(config)
        groups = build_groups(config, total_steps)
        tracking = Tracking(config.trainer.logger, run_dir, dataclasses.asdict(config))
        trainer = RayPPOTrainer(
            config,
            groups,
            reward_fn,
            train_loader,
            (lambda: iter(val_loader)) if val_loader else None,
            tracking,
            total_steps,
        )
        try:
            return trainer.fit(resume_from=checkpoint)
        finally:
            tracking.finish()


def train_usage() -> str:
    sections = "\n".join(f"  {name:<24} {help}" for name, help in config_sections())
    return f"""usage: hybridflow train [--config FILE] [--debug] key=value ...

Trains with PPO/GRPO. Every key has its default in {DEFAULT_CONFIG}; a --config file
holds only the keys it changes, and key=value overrides any key, for example
  hybridflow train data.train_files=[data/arithmetic/train.parquet] trainer.total_training_steps=20

config sections:
{sections}
"""


def main(argv: list[str] | None = None) -> int:
    """``hybridflow train [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(train_usage())
        return 0
    config_file = None
    if args and args[0] == "--config":
        if len(args) < 2:
            raise ConfigError("--config", "needs a file", "hybridflow train --config FILE [key=value ...]")
        config_file, args = args[1], args[2:]
        if not Path(config_file).is_file():
            raise ConfigError("--config", f"file '{config_file}' does not exist", "give an existing YAML file")
    run(load_config(args, config_file))
    return 0


if __name__ == "__main__":  # python -m hybridflow.trainer.main: the same command as hybridflow train
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
