"""The checks of a run that no single section can make, run before Ray starts or any model loads.

Each section validates its own values when the config is built (``__post_init__`` of its
dataclass). What is left here needs several sections at once (batch sizes against the layouts and
the group size) or the world outside the config (files, installed packages, a visible GPU, this
machine's cores). ``check_config`` returns the run plan (run_plan.py), which it builds on the way:
what cannot be derived (a model that is not there, a placement or a layout that does not fit) fails
there, and the checks after it read the plan. A rollout backend's own checks are its descriptor's
(rollout/backend.py). The checkpoint to resume is verified once, by ``run_dir.check_run_dir``. Nothing here
builds or loads a model: a model's shape comes from its config (a built-in's from its spec or its file's header).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.algorithms.advantage import AdvantageEstimator, get_adv_estimator
from hybridflow.controller import Role
from hybridflow.engine.lora import LoraConfig
from hybridflow.models import parse_dtype
from hybridflow.models.split_sizes import expert_count
from hybridflow.reward.custom import load_custom_reward_fn
from hybridflow.rollout.backend import BackendCheck, rollout_backend, rollout_backends
from hybridflow.trainer.services.tracking import check_loggers
from hybridflow.trainer.setup.cluster import check_local_cluster
from hybridflow.trainer.setup.config import ConfigError, HybridFlowConfig
from hybridflow.trainer.setup.modes import FULLY_ASYNC, training_mode
from hybridflow.trainer.setup.run_plan import RunPlan, make_run_plan, model_config
from hybridflow.validation import InvalidSetting, UserError


def _check(condition: bool, key: str, problem: str, fix: str = "") -> None:
    if not condition:
        raise ConfigError(key, problem, fix)


def check_files(files: list[str], key: str, required: bool) -> None:
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


def _check_rollout_backend(cfg: HybridFlowConfig, plan: RunPlan) -> None:
    """The chosen backend's own checks (its descriptor's), with the key of what they name."""
    rollout = cfg.actor_rollout_ref.rollout
    backend = rollout_backend(rollout.name)
    if backend.check is None:
        return
    run = BackendCheck(
        settings=rollout.backend_settings(),
        model_name=cfg.actor_rollout_ref.model.path,
        model_config=model_config(plan.paths.actor_model),
        device=cfg.trainer.device,
        dtype=parse_dtype(rollout.dtype, torch.device(cfg.trainer.device)),
        sequence_length=cfg.data.max_prompt_length + rollout.response_length,
    )
    try:
        backend.check(run)
    except InvalidSetting as error:
        raise ConfigError(f"actor_rollout_ref.rollout.{error.field}", error.problem, error.fix) from None


def _check_multi_turn(cfg: HybridFlowConfig, plan: RunPlan) -> None:
    """Agent loops need a known tool-call format and default loop, and a tools file that loads (the backend's
    request API and generation on one rank: the rollout config and the plan)."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return
    from hybridflow.rollout.agent.loops import agent_loop_class
    from hybridflow.rollout.agent.parsers import TOOL_CALL_FORMATS
    from hybridflow.tools import load_tools

    key = "actor_rollout_ref.rollout.multi_turn"
    _check(
        multi_turn.format in TOOL_CALL_FORMATS,
        f"{key}.format",
        f"{multi_turn.format!r} is not a known tool-call format",
        f"one of {sorted(TOOL_CALL_FORMATS)}, or register one (rollout.agent.register_tool_call_format)",
    )
    try:
        agent_loop_class(plan.paths.default_agent)
    except (KeyError, TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as error:
        raise ConfigError(f"{key}.default_agent", str(error).strip("'\"")) from None
    if plan.paths.tool_config:
        try:
            load_tools(plan.paths.tool_config)
        except UserError as error:
            raise ConfigError(f"{key}.tool_config_path", str(error)) from None


def _check_async(cfg: HybridFlowConfig) -> None:
    """An asynchronous mode trains each batch after the policy that generated it changed: the loss must
    correct for that (the decoupled objective, or the rollout's log-probs as PPO's old policy)."""
    settings = cfg.trainer.async_training
    mode, rollout = settings.mode, cfg.actor_rollout_ref.rollout
    lag = training_mode(mode).lag(settings)
    _check(
        lag == 0 or cfg.algorithm.rollout_correction.enabled or rollout.old_log_prob_source == "rollout",
        "trainer.async_training.mode",
        f"{mode} trains batches up to {lag} policy version{'s' if lag > 1 else ''} after the one that generated "
        "them, and nothing corrects for that: the rollout correction is off and PPO's old log-probs are the "
        "trainer's",
        "set algorithm.rollout_correction.rollout_is=token (the decoupled objective: importance weights between "
        "the trainer's and the rollout's log-probs, truncated) or actor_rollout_ref.rollout.old_log_prob_source="
        "rollout",
    )
    if settings.partial_rollout:
        _check_partial_rollout(cfg)


def _check_partial_rollout(cfg: HybridFlowConfig) -> None:
    """Partial rollout stops a generation call mid-way and continues its samples in another: the backend must
    be able to, on one rank per generation group, with samples whose only state is their tokens."""
    rollout, key = cfg.actor_rollout_ref.rollout, "trainer.async_training.partial_rollout"
    no = "set trainer.async_training.partial_rollout=false"
    mode = cfg.trainer.async_training.mode
    _check(mode == FULLY_ASYNC, key, f"only {FULLY_ASYNC} pushes weights mid-generation, not {mode}", no)
    _check(
        rollout_backend(rollout.name).partial_rollout,
        key,
        f"rollout.name={rollout.name} cannot pause a call and continue its samples",
        f"use rollout.name=native, or {no}",
    )
    _check(
        rollout.tensor_model_parallel_size == 1 and rollout.pipeline_model_parallel_size == 1,
        key,
        "it generates on one rank per generation group",
        "set actor_rollout_ref.rollout.tensor_model_parallel_size=1 and pipeline_model_parallel_size=1, or " + no,
    )
    _check(
        not rollout.multi_turn.enable,
        key,
        "a multi-turn sample's agent loop cannot be paused between two tokens yet",
        no,
    )
    _check(
        not rollout.agent.enabled,
        key,
        "a user agent's session (rollout.agent.function) cannot be paused between two tokens",
        no,
    )
    _check(
        not cfg.algorithm.filter_groups.enable,
        key,
        "dynamic sampling scores chunks whose samples may be unfinished",
        no,
    )
    _check(
        not get_adv_estimator(cfg.algorithm.adv_estimator).needs_baseline,
        key,
        f"{cfg.algorithm.adv_estimator}'s greedy baseline is generated in the same call",
        no,
    )


def _check_router_replay(cfg: HybridFlowConfig, plan: RunPlan) -> None:
    """Routing replay needs experts and a training forward that sees every token of a micro-batch; R3 a backend that
    records the rollout's routes, R2 an old-log-prob pass of the trainer's to record them."""
    arr = cfg.actor_rollout_ref
    key, mode = "actor_rollout_ref.actor.router_replay.mode", arr.actor.router_replay.mode
    if not arr.actor.router_replay.replays:
        return
    off = "set it to disabled"
    _check(expert_count(model_config(plan.paths.actor_model)) > 0, key, f"{mode}: the policy has no experts", off)
    if mode == "R2":
        _check(
            not plan.on_policy_update and arr.rollout.old_log_prob_source == "recompute",
            key,
            "R2 replays the routes of the trainer's old-log-prob pass, and this run skips that pass (one optimizer "
            "step on each batch, whose own forward is the old policy, or the rollout's log-probs as the old policy)",
            "use R3, or compute old log-probs (actor_rollout_ref.actor.reuse_update_log_probs=false, "
            "actor_rollout_ref.rollout.old_log_prob_source=recompute)",
        )
        return
    recorders = sorted(name for name, backend in rollout_backends().items() if backend.records_routes)
    _check(
        rollout_backend(arr.rollout.name).records_routes,
        key,
        f"{mode} replays the rollout's routes, and rollout.name={arr.rollout.name} does not record them",
        f"use actor_rollout_ref.rollout.name={' or '.join(recorders)}, or {off}",
    )
    _check(
        not cfg.trainer.async_training.partial_rollout,
        key,
        f"{mode}: a response continued across weight pushes would mix two calls' routes",
        "set trainer.async_training.partial_rollout=false, or " + off,
    )


def check_lora_targets(section: str, lora: LoraConfig, model_dir: str, critic: bool = False) -> None:
    """LoRA's target modules are layers this model has, its target parameters expert weights it has (read from a
    copy built on the meta device)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from hybridflow.engine.lora import expert_weight_names, heads, linear_layer_names, target_problem

    if not lora.enabled:
        return
    with torch.device("meta"):
        model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(
            model_config(model_dir)
        )
    problem = target_problem(lora.target_modules, linear_layer_names(model) - set(heads(model)))
    _check(problem is None, f"{section}.lora.target_modules", problem or "", "name some of them, or [all-linear]")
    if not lora.target_parameters:
        return
    key, experts = f"{section}.lora.target_parameters", expert_weight_names(model)
    unknown = sorted(set(lora.target_parameters) - experts)
    _check(
        not unknown,
        key,
        f"{unknown} name no expert weight of this model; "
        + (f"its expert weights are {sorted(experts)}" if experts else "it is not a mixture of experts"),
        "name some of them, or set it to []",
    )


def _check_lora(cfg: HybridFlowConfig, plan: RunPlan) -> None:
    arr = cfg.actor_rollout_ref
    check_lora_targets(
        "actor_rollout_ref.model",
        arr.model.lora,
        plan.paths.actor_model,
    )
    if plan.needs(Role.Critic):
        check_lora_targets(
            "critic.model",
            cfg.critic.model.lora,
            plan.paths.critic_model,
            critic=True,
        )


def _check_group_size(cfg: HybridFlowConfig, estimator: AdvantageEstimator) -> None:
    """The estimator's groups matter only when its advantage is trained on: a teacher with
    ``distillation.reward_coef=0`` gives the whole advantage, and one sample per prompt is fine."""
    if cfg.teacher.enabled and cfg.algorithm.distillation.reward_coef == 0:
        return
    n = cfg.actor_rollout_ref.rollout.n
    _check(
        not estimator.needs_groups or n >= 2,
        "actor_rollout_ref.rollout.n",
        f"algorithm.adv_estimator={estimator.name} compares the samples of a prompt, and rollout.n={n} gives every "
        "advantage 0: nothing would be learned",
        "sample several responses per prompt (rollout.n=4, say), or use an estimator without groups (gae)",
    )
    reason = estimator.signal_check(cfg.algorithm, n) if estimator.signal_check else None
    _check(reason is None, "algorithm.adv_estimator", f"{estimator.name}: {reason}", "change the settings it names")


def _check_batch_shaping(cfg: HybridFlowConfig) -> None:
    """Rollout correction needs the trainer's old log-probs; dynamic sampling needs groups."""
    algorithm, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    correction = algorithm.rollout_correction
    _check(
        not correction.enabled or rollout.old_log_prob_source == "recompute",
        "algorithm.rollout_correction",
        f"rollout_is={correction.rollout_is} / rollout_rs={correction.rollout_rs} weigh the trainer's old log-probs "
        f"against the rollout's, but actor_rollout_ref.rollout.old_log_prob_source={rollout.old_log_prob_source} "
        "uses the rollout's as the old policy (bypass mode: the loss's ratio is already the correction)",
        "set actor_rollout_ref.rollout.old_log_prob_source=recompute, or rollout_is=null and rollout_rs=null",
    )
    _check(
        not algorithm.filter_groups.enable or rollout.n >= 2,
        "algorithm.filter_groups.enable",
        f"dynamic sampling keeps groups whose rewards differ, and rollout.n={rollout.n} gives one sample per group: "
        "every group would be dropped",
        "sample several responses per prompt (actor_rollout_ref.rollout.n=4, say), or filter_groups.enable=false",
    )
    _check(
        not (algorithm.filter_groups.enable and cfg.teacher.enabled and algorithm.distillation.reward_coef == 0),
        "algorithm.filter_groups.enable",
        "dynamic sampling drops the groups whose rewards are all equal, but with a teacher and "
        "algorithm.distillation.reward_coef=0 the rewards are not in the advantage: it would drop samples the teacher "
        "has something to say about",
        "filter_groups.enable=false, or mix in the task reward (algorithm.distillation.reward_coef > 0)",
    )


def check_config(cfg: HybridFlowConfig) -> RunPlan:
    """Raise ConfigError naming the first problem; returns the run's plan when the config can run."""
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    check_files(cfg.data.train_files, "data.train_files", required=True)
    check_files(cfg.data.val_files, "data.val_files", required=False)
    plan = make_run_plan(cfg)  # models, placement, layouts, batch splits: ConfigError where they do not fit
    _check_router_replay(cfg, plan)
    _check_rollout_backend(cfg, plan)
    _check_multi_turn(cfg, plan)
    _check_group_size(cfg, plan.estimator)
    _check(  # a model given and not used: the run would train without the critic it names, without a word
        plan.needs(Role.Critic) or not cfg.critic.model.path,
        "critic.model.path",
        f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains no critic, so critic.model.path="
        f"{cfg.critic.model.path} would not be used",
        "use an estimator with a critic (algorithm.adv_estimator=gae), or drop critic.model.path",
    )
    _check_async(cfg)
    _check_lora(cfg, plan)
    overlong = cfg.reward.overlong_buffer
    _check(
        not overlong.enable or overlong.len <= arr.rollout.response_length,
        "reward.overlong_buffer.len",
        f"{overlong.len} tokens is longer than the whole budget actor_rollout_ref.rollout.response_length="
        f"{arr.rollout.response_length}",
        "make the buffer a part of the budget (DAPO: 4096 of 20480)",
    )
    _check_batch_shaping(cfg)
    if cfg.custom_reward_function.path:
        _check_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    _check(
        trainer.device == "cpu" or torch.cuda.is_available(),
        "trainer.device",
        "cuda asked for but no GPU is visible",
        "trainer.device=cpu",
    )
    if not trainer.ray_address:
        check_local_cluster(trainer, plan.placement)
    try:
        check_loggers(trainer.logger)
    except ImportError as error:
        raise ConfigError("trainer.logger", str(error), "install the package or drop the logger") from None
    return plan


def _check_custom_reward(path: str, name: str) -> None:
    try:
        load_custom_reward_fn(path, name)
    except (FileNotFoundError, ImportError) as error:
        raise ConfigError("custom_reward_function.path", str(error)) from None
    except (AttributeError, TypeError) as error:
        raise ConfigError("custom_reward_function.name", str(error)) from None
