"""The run plan: what a run derives from its config, derived once and read by everything after.

The loaded config is what the user wrote and is never changed. What follows from it (the files it
names as absolute paths, the advantage estimator, the roles the run needs, their pools, each role's
parallel layout and samples per rank and optimizer step, whether the actor update supplies its own old
log-probs) is computed here, once, by
``make_run_plan``, into a frozen ``RunPlan``: ``check_config`` builds it while checking (a placement or
layout that cannot work is a ConfigError naming its key), and the driver, the placement, the run directory
and the worker groups read it instead of deriving anything again. Making the plan reads the models'
configs (a built-in's from its spec or its file's header) and builds nothing: ``RunPlan.with_models()``
builds the built-in models into their cached directories, once the run has passed every check.
The number of steps is the one thing that also depends on the data: ``total_training_steps``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from transformers import PretrainedConfig

from hybridflow.algorithms import get_adv_estimator
from hybridflow.algorithms.advantage import AdvantageEstimator
from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import list_builtin_models, resolve_model_path
from hybridflow.models import model_config as read_model_config
from hybridflow.models.split_sizes import (
    check_expert_parallel_size,
    check_sequence_parallel_size,
    check_tensor_parallel_size,
)
from hybridflow.rollout.backend import rollout_backend
from hybridflow.trainer.setup.config import ConfigError, HybridFlowConfig, TrainerConfig
from hybridflow.trainer.setup.placement import Placement, place_roles
from hybridflow.trainer.setup.role_parts import (
    EXPERT_PARALLEL,
    PARALLEL_SIZES,
    PIPELINE_PARALLEL,
    ROLE_PARTS,
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
    VIRTUAL_PIPELINE,
)
from hybridflow.trainer.setup.roles import needed_roles

TG_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
PG_KEY = "actor_rollout_ref.rollout.pipeline_model_parallel_size"


def _missing_model(path: str, key: str, error: FileNotFoundError) -> ConfigError:
    if path in list_builtin_models():  # a built-in whose source is not installed: the error says how to
        return ConfigError(key, str(error))
    if (Path(path).expanduser() / "adapter_config.json").is_file():
        return ConfigError(
            key,
            f"'{path}' holds LoRA adapters (peft's adapter directory), not a whole model",
            "export the run with its adapters merged: hybridflow export RUN_DIR OUT_DIR --merged",
        )
    return ConfigError(
        key,
        f"'{path}' is neither a built-in model nor a Hugging Face model directory (with config.json)",
        f"use one of {sorted(list_builtin_models())} or a local directory; nothing is downloaded at run time",
    )


def model_dir_or_name(path: str, key: str) -> str:
    """A built-in name as it is, a local Hugging Face directory as an absolute path (workers may run elsewhere);
    ConfigError naming ``key`` when it is neither. Nothing is built or loaded: the model's config is read."""
    try:
        read_model_config(path)
    except FileNotFoundError as error:
        raise _missing_model(path, key, error) from None
    return path if path in list_builtin_models() else str(Path(path).expanduser().resolve())


def resolve_model_dir(path: str, key: str) -> str:
    """The model directory of a built-in name (built on first use) or a local Hugging Face directory."""
    try:
        return str(resolve_model_path(path))
    except FileNotFoundError as error:
        raise _missing_model(path, key, error) from None


@dataclass(frozen=True, kw_only=True)
class RunPaths:
    """The files a run reads, as its workers must see them (absolute, whatever their working directory). A
    built-in model is named until ``with_models()`` builds it: then it is its cached directory."""

    actor_model: str  # the policy's model
    critic_model: str  # the critic's: critic.model.path, or the policy's when that is ""
    reward_model: str  # the reward model's ("" without one)
    teacher_model: str  # on-policy distillation's teacher ("" without one)
    tool_config: str  # the multi-turn tools file ("" without one)
    default_agent: str  # the default agent loop: a registered name, or file.py:Name with the file made absolute
    run_dir: Path  # trainer.default_local_dir

    @classmethod
    def resolve(cls, config: HybridFlowConfig, roles: tuple[Role, ...]) -> RunPaths:
        """The paths of ``config`` for a run of ``roles``; ConfigError for a model that is not there."""
        arr, multi_turn = config.actor_rollout_ref, config.actor_rollout_ref.rollout.multi_turn
        actor = model_dir_or_name(arr.model.path, "actor_rollout_ref.model.path")
        critic = config.critic.model.path if Role.Critic in roles else ""
        file, sep, name = multi_turn.default_agent.rpartition(":")
        return cls(
            actor_model=actor,
            critic_model=model_dir_or_name(critic, "critic.model.path") if critic else actor,
            reward_model=model_dir_or_name(config.reward_model.model.path, "reward_model.model.path")
            if Role.RewardModel in roles
            else "",
            teacher_model=model_dir_or_name(config.teacher.model.path, "teacher.model.path")
            if Role.Teacher in roles
            else "",
            tool_config=str(Path(multi_turn.tool_config_path).resolve()) if multi_turn.tool_config_path else "",
            default_agent=(
                f"{Path(file).resolve()}:{name}" if sep and file.endswith(".py") else multi_turn.default_agent
            ),
            run_dir=Path(config.trainer.default_local_dir),
        )

    def with_models(self) -> RunPaths:
        """The same paths with each built-in model built into its cached directory (the first time: a
        conversion, seconds to minutes)."""
        keys = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path", "teacher.model.path")
        built = {
            field: resolve_model_dir(getattr(self, field), key) if getattr(self, field) else ""
            for field, key in zip(("actor_model", "critic_model", "reward_model", "teacher_model"), keys)
        }
        return dataclasses.replace(self, **built)


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    paths: RunPaths
    estimator: AdvantageEstimator  # algorithm.adv_estimator, looked up once
    roles: tuple[Role, ...]  # the roles this run needs, the actor first
    placement: Placement  # the pools and the pool of each role
    layouts: Mapping[Role, LayoutShape]  # each role's (dp, t, tg) over its pool's ranks
    on_policy_update: bool  # the actor update supplies the old log-probs (no separate pass)
    # the samples each data-parallel rank trains per optimizer step, for each trained role (actor, critic):
    # ppo_mini_batch_size prompts x rollout.n over the role's dp ranks; the workers are given it
    mini_batch_per_rank: Mapping[Role, int]

    def needs(self, role: Role) -> bool:
        return role in self.roles

    def with_models(self) -> RunPlan:
        """The plan with its built-in models built (``RunPaths.with_models``): after every check has passed."""
        return dataclasses.replace(self, paths=self.paths.with_models())

    @property
    def actor_layout(self) -> LayoutShape:
        return self.layouts[Role.ActorRollout]

    @property
    def generation_layout(self) -> LayoutShape:
        """The layout of the ranks that generate: the rollout role's where it runs apart, else the actor's."""
        return self.layouts.get(Role.Rollout, self.actor_layout)


def on_policy_update(config: HybridFlowConfig) -> bool:
    """Whether the actor update is one optimizer step on this very batch, with nothing needing old
    log-probs before it (KL in the reward, the rollout correction and a teacher's advantage do): its own
    pre-step log-probs then are the old ones."""
    actor = config.actor_rollout_ref.actor
    return (
        actor.reuse_update_log_probs
        and actor.single_update_step(actor.ppo_mini_batch_size, config.data.train_batch_size)
        and not config.algorithm.use_kl_in_reward
        and not config.algorithm.rollout_correction.enabled
        and not config.teacher.enabled
    )


def model_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of the model ``path`` (a built-in name or a directory), nothing built."""
    return read_model_config(path)


def parallel_shape(
    world: int,
    pool: str,
    model_path: str,
    *,
    t: int,
    sp: int,
    keys: tuple[str, ...],
    packed: tuple[bool, str],
    pp: int = 1,
    vpp: int = 1,
) -> LayoutShape:
    """The layout (tg = 1) of ``world`` ranks of ``pool`` for a model whose layers split over t ranks, whose
    micro-batches' tokens split over sp, and whose decoder layers split into pp x vpp pipeline stages over pp ranks,
    the rest data-parallel; ConfigError naming the key (``keys``: t's, sp's, and pp's and vpp's where the section has
    them) when the sizes do not fit the ranks or the model, or when sp or pp > 1 without packed rows (``packed``:
    whether the role packs, and its key)."""
    tp_key, sp_key = keys[:2]
    pp_key, vpp_key = keys[2:] if len(keys) == 4 else ("", "")
    if world % (t * sp * pp):
        sizes = [(key, size) for key, size in ((sp_key, sp), (pp_key, pp)) if size > 1]
        key, size = (sizes[0][0], f"{sizes[0][1]} (x {tp_key}={t})") if sizes else (tp_key, str(t))
        raise ConfigError(
            key, f"{size} does not divide the {world} ranks of {pool}", "choose a divisor of the pool's ranks"
        )
    check_splits_evenly(model_path, t, tp_key)
    if sp > 1:
        if not packed[0]:
            raise ConfigError(sp_key, f"{sp}: sequence parallelism splits packed rows", f"set {packed[1]}=true")
        try:
            check_sequence_parallel_size(model_config(model_path), sp, sp_key, tensor_parallel=t)
        except ValueError as error:
            raise ConfigError(sp_key, str(error)) from None
    check_pipeline_stages(model_path, pp, vpp, (pp_key, vpp_key), packed)
    return LayoutShape(dp=world // (t * sp * pp), t=t, tg=1, sp=sp, pp=pp)


def check_pipeline_stages(model_path: str, pp: int, vpp: int, keys: tuple[str, str], packed: tuple[bool, str]) -> None:
    """pp x vpp stages of equal size on packed rows, interleaved only over 2 ranks or more; ConfigError naming
    ``keys`` (pp's, vpp's) otherwise."""
    pp_key, vpp_key = keys
    if vpp > 1 and pp == 1:
        raise ConfigError(
            vpp_key, f"{vpp}: stages interleave over pipeline ranks, and {pp_key}=1", f"set {pp_key} to 2 or more"
        )
    if pp == 1:
        return
    if not packed[0]:
        raise ConfigError(pp_key, f"{pp}: pipeline stages run on packed rows", f"set {packed[1]}=true")
    layers = model_config(model_path).get_text_config().num_hidden_layers
    if layers % (pp * vpp):
        key, stages = (vpp_key, f"{pp} x {vpp_key}={vpp}") if vpp > 1 else (pp_key, str(pp))
        raise ConfigError(
            key,
            f"{stages} stages do not split the model's {layers} decoder layers evenly",
            f"choose sizes whose product divides {layers}",
        )


def check_micro_batches_fill_stages(rows_per_step: int, micro_batch: int, pp: int, *, key: str, pp_key: str) -> None:
    """ConfigError naming ``key`` (the micro-batch size) when an optimizer step's micro-batches (``rows_per_step`` rows
    per rank, ``micro_batch`` rows each) are fewer than the ``pp`` pipeline ranks: a stage would idle through every
    step. Token-count micro-batches (use_dynamic_bsz) are not checked: a pass with too few gets empty ones
    (engine/pipeline.py)."""
    count = -(-rows_per_step // micro_batch)
    if count < pp:
        raise ConfigError(
            key,
            f"{micro_batch} makes {count} micro-batch(es) of the {rows_per_step} rows of an optimizer step, fewer than "
            f"the {pp} pipeline stages ({pp_key})",
            f"use at most {max(rows_per_step // pp, 1)} rows per micro-batch",
        )


def check_splits_evenly(model_path: str, size: int, key: str) -> None:
    """Whole heads and equal MLP slices (a mixture's: whole experts) per rank when ``size`` ranks split the model's
    layers."""
    if size == 1:
        return
    try:
        check_tensor_parallel_size(model_config(model_path), size, key)
    except ValueError as error:
        raise ConfigError(key, str(error)) from None


def _generation_size(config: HybridFlowConfig) -> int:
    """tg, the ranks that generate together (rollout.tensor_model_parallel_size): every rule on tg but how it
    fits the ranks is here."""
    rollout = config.actor_rollout_ref.rollout
    tg, key = rollout.tensor_model_parallel_size, TG_KEY
    if tg > 1 and not rollout_backend(rollout.name).tensor_parallel:
        raise ConfigError(
            key,
            f"{tg} needs a tensor-parallel backend; rollout.name={rollout.name} generates on one rank",
            "use rollout.name=native, or tensor_model_parallel_size=1",
        )
    if tg > 1 and rollout.multi_turn.enable:
        raise ConfigError(
            key,
            "multi-turn rollout generates on one rank (the ranks of a group would wait on different tools)",
            "set it to 1 (the actor may still train tensor-parallel)",
        )
    return tg


def _generation_stages(config: HybridFlowConfig, training: LayoutShape) -> int:
    """pg, the generation pipeline stages (rollout.pipeline_model_parallel_size), checked against the backend, the
    run's modes and the actor's training stages."""
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    pg = rollout.pipeline_model_parallel_size
    if pg == 1:
        return pg
    refusals = [
        (
            not rollout_backend(rollout.name).pipeline_stages,
            f"{pg} needs a backend that generates in pipeline stages; rollout.name={rollout.name} does not",
            "use rollout.name=native, or set it to 1",
        ),
        (
            config.trainer.async_training.rollout_apart,
            f"{pg}: generation stages are the hybrid actor's (they regroup its training stages); a rollout pool of "
            "its own generates with every layer on each rank",
            "set it to 1 with trainer.async_training's modes that place the rollout apart",
        ),
        (
            rollout.multi_turn.enable,
            "multi-turn rollout generates on one rank (the ranks of a group would wait on different tools)",
            "set it to 1",
        ),
        (
            training.pp % pg != 0,
            f"{pg} does not divide actor.pipeline_model_parallel_size={training.pp}: each generation stage is made "
            "of whole training stages (the 3D-HybridEngine's regrouping over p)",
            f"choose a divisor of {training.pp}",
        ),
        (
            actor.virtual_pipeline_model_parallel_size > 1,
            f"{pg} with actor.virtual_pipeline_model_parallel_size="
            f"{actor.virtual_pipeline_model_parallel_size}: an interleaved rank's stages are not consecutive layers, "
            "which a generation stage is",
            "set one of them to 1",
        ),
    ]
    for refused, problem, fix in refusals:
        if refused:
            raise ConfigError(PG_KEY, problem, fix)
    return pg


def _actor_layout(config: HybridFlowConfig, training: LayoutShape) -> LayoutShape:
    """The hybrid actor's training layout with generation groups of pg x tg ranks (tg dividing t is checked in
    LayoutShape itself, as the regrouping needs). With the rollout role apart, the actor only trains."""
    t = training.t
    pg = _generation_stages(config, training)
    if config.trainer.async_training.rollout_apart:
        return training
    tg = _generation_size(config)
    try:
        return dataclasses.replace(training, tg=tg, pg=pg)
    except ValueError as error:
        raise ConfigError(
            TG_KEY,
            f"{tg} does not divide actor.tensor_model_parallel_size={t}: every generation shard must be made of "
            f"whole training shards (the 3D-HybridEngine's regrouping: {error})",
            f"choose a divisor of {t}",
        ) from None


def _rollout_layout(config: HybridFlowConfig, world: int, pool: str) -> LayoutShape:
    """The rollout role's layout: its pool's ranks in generation groups of tg (each group one replica)."""
    tg = _generation_size(config)
    if world % tg:
        raise ConfigError(
            TG_KEY,
            f"{tg} does not divide the {world} ranks of pool '{pool}' (rollout)",
            "choose a divisor of the rollout pool's ranks",
        )
    return LayoutShape(dp=world // tg, t=tg, tg=tg)


def role_layouts(
    config: HybridFlowConfig, roles: tuple[Role, ...], placement: Placement, paths: RunPaths
) -> dict[Role, LayoutShape]:
    """Each role's layout over its pool: tensor parallelism over t ranks and Ulysses over sp (its section's keys),
    data parallelism over the rest, FSDP2 over dp x sp, and for the actor generation groups of tg; ConfigError when a
    size does not fit the pool or the model."""
    layouts = {}
    for role in roles:
        world, part = placement.world_size(role), ROLE_PARTS[role]
        if role is Role.Rollout:
            check_splits_evenly(paths.actor_model, _generation_size(config), TG_KEY)
            layouts[role] = _rollout_layout(config, world, placement.role_pool[role])
            continue
        shape = LayoutShape(dp=world, t=1, tg=1)
        if part.section:  # the model's split is checked over t here, and over tg (which divides t) with it
            shape = parallel_shape(
                world,
                f"pool '{placement.role_pool[role]}' ({role.value})",
                part.model(config, paths)[1],
                t=part.parallel_size(config, TENSOR_PARALLEL),
                sp=part.parallel_size(config, SEQUENCE_PARALLEL),
                pp=part.parallel_size(config, PIPELINE_PARALLEL),
                vpp=part.parallel_size(config, VIRTUAL_PIPELINE),
                keys=tuple(part.key(name) for name in PARALLEL_SIZES),
                packed=(part.packs(config), part.key("use_remove_padding")),
            )
            shape = _with_experts(config, role, shape, part.model(config, paths)[1])
            check_scores_in_stages(shape, role is Role.RewardModel, part.key(SEQUENCE_PARALLEL))
        layouts[role] = _actor_layout(config, shape) if role is Role.ActorRollout else shape
    return layouts


def check_scores_in_stages(shape: LayoutShape, scores: bool, sp_key: str) -> None:
    """A model that gives sequence scores (a reward model) runs its stages without Ulysses: ConfigError naming
    ``sp_key`` otherwise (the response tokens' passes take both)."""
    if scores and shape.pp > 1 and shape.sp > 1:
        raise ConfigError(
            sp_key,
            f"{shape.sp} with pipeline stages: a sequence score's pass in stages runs each row whole on a rank",
            "set it to 1, or the pipeline size to 1",
        )


def _with_experts(config: HybridFlowConfig, role: Role, shape: LayoutShape, model_path: str) -> LayoutShape:
    """``shape`` with its role's expert-parallel size, checked against the model and the data-parallel ranks."""
    part = ROLE_PARTS[role]
    ep, key = part.parallel_size(config, EXPERT_PARALLEL), part.key(EXPERT_PARALLEL)
    if ep == 1:
        return shape
    try:
        check_expert_parallel_size(model_config(model_path), ep, shape.dp)
    except ValueError as error:
        raise ConfigError(key, str(error), "choose a divisor of both, or 1") from None
    return dataclasses.replace(shape, ep=ep)


def make_run_plan(config: HybridFlowConfig) -> RunPlan:
    """The run's plan; ConfigError (naming the key) when a model is not there, or the placement or a layout
    cannot work. Reads the models' configs and builds nothing (``RunPlan.with_models``)."""
    estimator = get_adv_estimator(config.algorithm.adv_estimator)
    roles = tuple(needed_roles(config, estimator))
    paths = RunPaths.resolve(config, roles)
    placement = place_roles(config, roles)
    layouts = role_layouts(config, roles, placement, paths)
    return RunPlan(
        paths=paths,
        estimator=estimator,
        roles=roles,
        placement=placement,
        layouts=MappingProxyType(layouts),
        on_policy_update=on_policy_update(config),
        mini_batch_per_rank=MappingProxyType(mini_batches_per_rank(config, roles, placement, layouts)),
    )


def mini_batches_per_rank(
    config: HybridFlowConfig, roles: tuple[Role, ...], placement: Placement, layouts: Mapping[Role, LayoutShape]
) -> dict[Role, int]:
    """Each trained role's samples per rank and optimizer step; ConfigError when a mini-batch does not divide
    the train batch or does not split evenly over the role's data-parallel ranks."""
    n = config.actor_rollout_ref.rollout.n
    train = config.data.train_batch_size
    sections = {Role.ActorRollout: ("actor_rollout_ref.actor", config.actor_rollout_ref.actor)}
    if Role.Critic in roles:
        sections[Role.Critic] = ("critic", config.critic)
    per_rank = {}
    for role, (prefix, section) in sections.items():
        mini, world = section.ppo_mini_batch_size, layouts[role].dp
        if train % mini:
            raise ConfigError(
                f"{prefix}.ppo_mini_batch_size",
                f"{mini} does not divide data.train_batch_size={train}",
                "choose a divisor of the train batch size",
            )
        if (mini * n) % world:
            raise ConfigError(
                f"{prefix}.ppo_mini_batch_size",
                f"{mini} prompts x rollout.n={n} = {mini * n} samples do not split over the {world} data-parallel "
                f"ranks of pool '{placement.role_pool[role]}' ({role.value})",
                "make ppo_mini_batch_size * rollout.n a multiple of the pool's ranks (trainer.n_workers_per_node, "
                "or its trainer.resource_pool_spec entry)",
            )
        per_rank[role] = mini * n // world
        if layouts[role].pp > 1 and not section.use_dynamic_bsz:
            check_micro_batches_fill_stages(
                per_rank[role],
                section.ppo_micro_batch_size_per_gpu,
                layouts[role].pp,
                key=f"{prefix}.ppo_micro_batch_size_per_gpu",
                pp_key=f"{prefix}.pipeline_model_parallel_size",
            )
    return per_rank


def total_training_steps(trainer: TrainerConfig, steps_per_epoch: int) -> int:
    """The run's length: total_epochs over the data, or trainer.total_training_steps if that is fewer."""
    total = steps_per_epoch * trainer.total_epochs
    return min(total, trainer.total_training_steps) if trainer.total_training_steps > 0 else total
