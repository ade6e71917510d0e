"""``hybridflow train key=value ...``: check the config, start Ray, build the worker groups, run the loop.

Also runnable as ``python -m hybridflow.trainer.commands.train key=value ...`` (the same command, errors included).
"""

from __future__ import annotations

import dataclasses
import sys

from rich.console import Console

from hybridflow.controller import Role, RoleSpec
from hybridflow.data import PromptDataLoader, RLHFDataset
from hybridflow.data.dataset import read_prompt_rows
from hybridflow.models import load_tokenizer
from hybridflow.reward import RewardManager, check_scorable, load_custom_reward_fn
from hybridflow.reward.manager import CustomRewardFn
from hybridflow.rollout.row_checks import check_rollout_rows
from hybridflow.tools import load_tools
from hybridflow.trainer.loop.mode_parts import rl_trainer
from hybridflow.trainer.loop.step_loop import fit_run
from hybridflow.trainer.setup.check_config import check_config
from hybridflow.trainer.setup.cluster import ray_for_run
from hybridflow.trainer.setup.config import DEFAULT_CONFIG, HybridFlowConfig, load_config
from hybridflow.trainer.setup.config_help import config_command_args, run_as_module
from hybridflow.trainer.setup.placement import build_groups
from hybridflow.trainer.setup.role_parts import ROLE_PARTS
from hybridflow.trainer.setup.roles import RoleGroups
from hybridflow.trainer.setup.run_dir import check_run_dir
from hybridflow.trainer.setup.run_plan import RunPlan, total_training_steps


def role_specs(config: HybridFlowConfig, plan: RunPlan, total_steps: int) -> dict[Role, RoleSpec]:
    """Each needed role's worker class and the keyword arguments it is built with on every rank (its part's)."""
    return {role: ROLE_PARTS[role].worker(config, plan, total_steps) for role in plan.roles}


def check_role_parts(config: HybridFlowConfig, plan: RunPlan) -> None:
    """The checks of each needed role's own (its part's), once its models are built."""
    for role in plan.roles:
        check = ROLE_PARTS[role].check
        if check is not None:
            check(config, plan)


def run_tool_schemas(config: HybridFlowConfig, plan: RunPlan) -> list[dict] | None:
    """The function schemas of a multi-turn run's tools (the chat template lists them in prompts that know them)."""
    if not (config.actor_rollout_ref.rollout.multi_turn.enable and plan.paths.tool_config):
        return None
    return load_tools(plan.paths.tool_config).schemas


def build_role_groups(config: HybridFlowConfig, plan: RunPlan, total_steps: int) -> RoleGroups:
    """The worker groups of every role the run needs, placed as the plan says."""
    return build_groups(config, plan.placement, role_specs(config, plan, total_steps))


def check_rows(config: HybridFlowConfig, custom_fn: CustomRewardFn | None) -> None:
    """The data's rows, before any model is built: each rollout feature's checks of them (agent functions,
    environments, agent loops), and unless the user's agents return the rewards, a scorer for each row's data source
    (or the custom reward function scores the first)."""
    data = config.data
    rows = read_prompt_rows(data.train_files, data)[0]
    if data.val_files:
        rows += read_prompt_rows(data.val_files, data, key="data.val_files")[0]
    rollout = config.actor_rollout_ref.rollout
    check_rollout_rows(rollout, rows)
    if not rollout.agent.enabled:
        check_scorable(rows, custom_fn, multi_turn=rollout.multi_turn.enable)


def run(config: HybridFlowConfig) -> dict[str, float]:
    console = Console()
    plan = check_config(config)  # the config and the models' shapes: nothing is built or loaded yet
    run_dir = check_run_dir(config, plan)  # a checkpoint to resume verified, another run's refused
    custom = config.custom_reward_function
    custom_fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    check_rows(config, custom_fn)
    plan = plan.with_models()  # built-in models into the cache (the first time: a conversion)
    check_role_parts(config, plan)
    tokenizer = load_tokenizer(plan.paths.actor_model)
    data = config.data
    tool_schemas = run_tool_schemas(config, plan)
    train_dataset = RLHFDataset(data.train_files, tokenizer, data, tools=tool_schemas)
    train_loader = PromptDataLoader(
        train_dataset, data.train_batch_size, shuffle=data.shuffle, seed=config.trainer.seed
    )
    val_loader = None
    if data.val_files:
        val_dataset = RLHFDataset(data.val_files, tokenizer, data, tools=tool_schemas, key="data.val_files")
        val_loader = PromptDataLoader(
            val_dataset, min(data.val_batch_size, len(val_dataset)), shuffle=False, drop_last=False
        )
    reward_fn = RewardManager(tokenizer, config.reward, custom_fn)
    total_steps = total_training_steps(config.trainer, steps_per_epoch=len(train_loader))
    checkpoint = run_dir.prepare()  # every check passed: the run directory changes from here on
    placement = plan.placement
    pools = ", ".join(f"{name} {sum(nodes)}" for name, nodes in placement.pools.items())
    console.print(
        f"[bold]hybridflow[/]: {config.algorithm.adv_estimator} for {total_steps} steps on {placement.processes} "
        f"workers ({config.trainer.placement}: {pools}); run dir {plan.paths.run_dir}",
        soft_wrap=True,  # one line, the path whole, whatever the console's width
    )

    # the workers' tuning settings come with their pools (placement.build_groups), on any cluster
    with ray_for_run(config.trainer, placement):
        groups = build_role_groups(config, plan, total_steps)
        finished = False
        try:
            val_batches = (lambda: iter(val_loader)) if val_loader else None
            result = fit_run(
                rl_trainer(config, plan, groups, reward_fn, train_loader, val_batches, total_steps),
                config.trainer,
                total_steps=total_steps,
                run_dir=plan.paths.run_dir,
                record=dataclasses.asdict(config),
                has_validation=val_loader is not None,
                resume_from=checkpoint,
            )
            finished = True
            return result
        finally:  # on a Ray cluster this run did not start, its workers and their CPUs must not outlive it
            groups.release(keep_processes=finished)


ABOUT = f"""Trains with PPO/GRPO. Every key has its default in {DEFAULT_CONFIG}; a --config file
holds only the keys it changes, and key=value overrides any key, for example
  hybridflow train data.train_files=[data/arithmetic/train.parquet] trainer.total_training_steps=20
"""


def main(argv: list[str] | None = None) -> int:
    """``hybridflow train [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = config_command_args(args, "train", ABOUT, HybridFlowConfig, DEFAULT_CONFIG)
    if parsed is not None:
        run(load_config(*parsed))
    return 0


if __name__ == "__main__":  # python -m hybridflow.trainer.commands.train: the same command as hybridflow train
    sys.exit(run_as_module(main))
