"""Each role of an RL run, declared once: when a run needs it, its pool, its worker and the arguments it is built
with, the model it loads and the config section of its parallel sizes, the pass its group runs on every batch after
generation, its stages in the planner's cost model, and checks of its own.

The run plan (needed roles, placement, layouts), the driver (its worker groups, the scoring passes of a step), the
checks and the planner read these parts; none of them names a role's particulars. A new role is a module with a
``RolePart`` and one ``register_role_part`` call, with its config section if it needs one
(tests/trainer/test_role_parts.py adds one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.algorithms.advantage import AdvantageEstimator
from hybridflow.controller import Role, RoleSpec
from hybridflow.models.tokenizer_match import tokenizer_differences
from hybridflow.trainer.setup.config import ConfigError, HybridFlowConfig, register_section
from hybridflow.workers import (
    ActorRolloutWorker,
    ActorWorker,
    CriticWorker,
    RefPolicyWorker,
    RewardModelWorker,
    RolloutWorker,
    TeacherWorker,
)

Plan = Any  # the run plan (run_plan.py RunPlan, which reads these parts)


@dataclass(frozen=True, kw_only=True)
class RolePart:
    """One role. ``worker(config, plan, total_steps)``: its worker class and keyword arguments, the same on every rank;
    ``model(config, paths)``: the model it loads, as the config names it and as a directory (None: none);
    ``section``: the config section of its training or scoring settings, where its parallel sizes are
    (``TENSOR_PARALLEL``, ``SEQUENCE_PARALLEL``; "": one rank per layer and per sequence); ``config``: the dataclass
    of a section of its own, which registering the part adds to the run's config as the top-level ``section``
    (None: ``section`` is one the config already has); ``scores``: the method its
    group runs on each batch after generation, whose columns join the batch ("": none); ``stages``: its passes in the
    planner's cost model; ``check(config, plan)``: checks once its models are built, before Ray."""

    role: Role
    needed: Callable[[HybridFlowConfig, AdvantageEstimator], bool]
    pool: str  # its pool under trainer.placement=group_colocate
    worker: Callable[[HybridFlowConfig, Plan, int], RoleSpec]
    model: Callable[[HybridFlowConfig, Any], tuple[str, str]] | None = None
    section: str = ""
    config: type | None = None
    scores: str = ""
    stages: tuple[str, ...] = ()
    check: Callable[[HybridFlowConfig, Plan], None] | None = None

    def key(self, name: str) -> str:
        """The full config key of its section's setting ``name`` ("" without a section)."""
        return f"{self.section}.{name}" if self.section else ""

    def settings(self, config: HybridFlowConfig) -> Any:
        """Its config section (None without one)."""
        return functools.reduce(getattr, self.section.split("."), config) if self.section else None

    def packs(self, config: HybridFlowConfig) -> bool:
        """Whether its passes run on packed rows: its section's ``use_remove_padding`` (a section without the setting,
        the reward model's, always packs)."""
        return bool(getattr(self.settings(config), "use_remove_padding", True))

    def parallel_size(self, config: HybridFlowConfig, name: str) -> int:
        """One of its ``PARALLEL_SIZES`` (1 without a section, or a section without it)."""
        return int(getattr(self.settings(config), name, 1)) if self.section else 1


TENSOR_PARALLEL = "tensor_model_parallel_size"  # a section's ranks that split each decoder layer
SEQUENCE_PARALLEL = "ulysses_sequence_parallel_size"  # a section's ranks that split each micro-batch's tokens
PIPELINE_PARALLEL = "pipeline_model_parallel_size"  # a section's ranks that split the decoder layers into stages
VIRTUAL_PIPELINE = "virtual_pipeline_model_parallel_size"  # a section's stages per pipeline rank
PARALLEL_SIZES = (TENSOR_PARALLEL, SEQUENCE_PARALLEL, PIPELINE_PARALLEL, VIRTUAL_PIPELINE)
EXPERT_PARALLEL = "expert_model_parallel_size"  # a section's data-parallel ranks that split each MoE layer's experts

ROLE_PARTS: dict[Role, RolePart] = {}


def register_role_part(part: RolePart) -> None:
    """Add a role's part; a role has one."""
    if part.role in ROLE_PARTS:
        raise ValueError(f"role {part.role} already has a part")
    if part.config is not None:
        register_section(part.section, part.config)
    ROLE_PARTS[part.role] = part


def needs_reference(config: HybridFlowConfig) -> bool:
    """Whether a KL term needs the reference policy's log-probs."""
    return config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss


def _actor(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    paths = plan.paths
    kwargs = dict(config=config.actor_rollout_ref, model_path=paths.actor_model, layout=plan.actor_layout)
    kwargs.update(mini_batch_per_rank=plan.mini_batch_per_rank[Role.ActorRollout])
    kwargs.update(total_training_steps=total_steps, seed=config.trainer.seed)
    if plan.needs(Role.Rollout):  # generation apart: the actor only trains
        return RoleSpec(ActorWorker, kwargs=kwargs)
    return RoleSpec(ActorRolloutWorker, kwargs=kwargs | _rollout_files(plan))


def _rollout_files(plan: Plan) -> dict:
    return dict(tool_config=plan.paths.tool_config, default_agent=plan.paths.default_agent)


def _rollout(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    kwargs = dict(config=config.actor_rollout_ref, model_path=plan.paths.actor_model, layout=plan.layouts[Role.Rollout])
    return RoleSpec(RolloutWorker, kwargs=kwargs | _rollout_files(plan))


def _reference(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    layout, seed = plan.layouts[Role.RefPolicy], config.trainer.seed
    kwargs = dict(config=config.actor_rollout_ref, model_path=plan.paths.actor_model, layout=layout, seed=seed)
    return RoleSpec(RefPolicyWorker, kwargs=kwargs)


def _critic(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    kwargs = dict(config=config.critic, model_path=plan.paths.critic_model, layout=plan.layouts[Role.Critic])
    kwargs.update(mini_batch_per_rank=plan.mini_batch_per_rank[Role.Critic])
    return RoleSpec(CriticWorker, kwargs=kwargs | dict(total_training_steps=total_steps, seed=config.trainer.seed))


def _reward_model(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    paths = plan.paths
    kwargs = dict(config=config.reward_model, model_path=paths.reward_model, policy_model_path=paths.actor_model)
    layout = plan.layouts[Role.RewardModel]
    return RoleSpec(RewardModelWorker, kwargs=kwargs | dict(layout=layout, seed=config.trainer.seed))


def _teacher(config: HybridFlowConfig, plan: Plan, total_steps: int) -> RoleSpec:
    kwargs = dict(config=config.teacher, model_path=plan.paths.teacher_model, layout=plan.layouts[Role.Teacher])
    kwargs.update(temperature=config.actor_rollout_ref.rollout.temperature, seed=config.trainer.seed)
    return RoleSpec(TeacherWorker, kwargs=kwargs)


def check_teacher_tokenizer(config: HybridFlowConfig, plan: Plan) -> None:
    """A teacher shares the student's tokenizer (vocabulary, special tokens, chat template): it scores the student's
    token ids. Read from the models' directories, so after ``plan.with_models()`` (before Ray starts)."""
    differences = tokenizer_differences(plan.paths.actor_model, plan.paths.teacher_model)
    if differences:
        raise ConfigError(
            "teacher.model.path",
            f"the teacher {config.teacher.model.path} does not share the tokenizer of the student "
            f"{config.actor_rollout_ref.model.path}, and it scores the student's token ids: " + "; ".join(differences),
            "distil from a teacher of the student's family (the same tokenizer and chat template); off-policy "
            "distillation (hybridflow distill-data, then hybridflow sft) works across tokenizers",
        )


def _policy_model(config: HybridFlowConfig, paths: Any) -> tuple[str, str]:
    return config.actor_rollout_ref.model.path, paths.actor_model


def _critic_model(config: HybridFlowConfig, paths: Any) -> tuple[str, str]:
    return config.critic.model.path or config.actor_rollout_ref.model.path, paths.critic_model


for _part in (
    RolePart(
        role=Role.ActorRollout,
        needed=lambda config, estimator: True,
        pool="actor",
        worker=_actor,
        model=_policy_model,
        section="actor_rollout_ref.actor",
        stages=("gen", "old_log_prob", "update_actor"),
    ),
    RolePart(  # the reference for a KL term; a LoRA actor with its adapters off is its own reference
        role=Role.RefPolicy,
        needed=lambda config, estimator: needs_reference(config) and not config.actor_rollout_ref.model.lora.enabled,
        pool="actor",
        worker=_reference,
        model=_policy_model,
        section="actor_rollout_ref.ref",
        scores="compute_ref_log_prob",
        stages=("ref",),
    ),
    RolePart(
        role=Role.Critic,
        needed=lambda config, estimator: estimator.needs_values,
        pool="critic",
        worker=_critic,
        model=_critic_model,
        section="critic",
        scores="compute_values",
        stages=("values", "update_critic"),
    ),
    RolePart(  # its scores join the rule-based ones in the step's scorer (loop/generation.py)
        role=Role.RewardModel,
        needed=lambda config, estimator: config.reward_model.enable,
        pool="critic",
        worker=_reward_model,
        model=lambda config, paths: (config.reward_model.model.path, paths.reward_model),
        section="reward_model",  # its sequence-parallel size (it packs its rows always, and splits no layer)
        stages=("rm",),
    ),
    RolePart(  # generation on a pool of its own (asynchronous modes): the actor then only trains
        role=Role.Rollout,
        needed=lambda config, estimator: config.trainer.async_training.rollout_apart,
        pool="rollout",
        worker=_rollout,
        model=_policy_model,
        stages=("gen", "weight_transfer"),
    ),
    RolePart(  # on-policy distillation: scores the samples while the actor computes its old log-probs
        role=Role.Teacher,
        needed=lambda config, estimator: config.teacher.enabled,
        pool="critic",
        worker=_teacher,
        model=lambda config, paths: (config.teacher.model.path, paths.teacher_model),
        section="teacher",
        scores="compute_teacher_log_prob",
        stages=("teacher",),
        check=check_teacher_tokenizer,
    ),
):
    register_role_part(_part)
