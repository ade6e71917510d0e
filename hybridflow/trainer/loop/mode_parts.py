"""The built-in training modes' parts (trainer/setup/modes.py names these functions), and the RL trainer made
of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridflow.controller import Role
from hybridflow.data import PromptDataLoader
from hybridflow.protocol import DataProto
from hybridflow.trainer.asynchronous.partial_rollout import PartialRollout
from hybridflow.trainer.asynchronous.rollouter import Rollouter
from hybridflow.trainer.loop.async_queue import AsyncQueue, ChunkGenerator, informative
from hybridflow.trainer.loop.batch_source import BatchSource, GenerateNow, train_batches
from hybridflow.trainer.loop.generate_ahead import GenerateAhead
from hybridflow.trainer.loop.generation import Generation, RewardFn, Scorer
from hybridflow.trainer.loop.rl_trainer import RLTrainer
from hybridflow.trainer.loop.weight_link import link_actor_to_rollout
from hybridflow.trainer.loop.weight_sync import PushEvery, SameWeights, TransferEachStep, WeightSync
from hybridflow.trainer.setup.config import HybridFlowConfig
from hybridflow.trainer.setup.modes import FULLY_ASYNC, ONE_STEP_OFF, SYNC, mode_names, training_mode
from hybridflow.trainer.setup.roles import RoleGroups
from hybridflow.trainer.setup.run_plan import RunPlan


@dataclass(frozen=True, kw_only=True)
class ModeInputs:
    """What a mode's parts are built from."""

    config: HybridFlowConfig
    plan: RunPlan
    groups: RoleGroups
    generation: Generation
    loader: PromptDataLoader
    total_steps: int


ModeParts = Callable[[ModeInputs], tuple[BatchSource, WeightSync]]
PARTS: dict[str, ModeParts] = {}  # mode name -> the builder of its parts


def register_mode_parts(name: str) -> Callable[[ModeParts], ModeParts]:
    """Register the builder of mode ``name``'s parts (the mode itself: trainer/setup/modes.py)."""
    training_mode(name)  # the mode must be registered first: its facts are read before any part is built

    def register(build: ModeParts) -> ModeParts:
        if name in PARTS:
            raise ValueError(f"the parts of training mode '{name}' are already registered")
        PARTS[name] = build
        return build

    return register


def mode_parts(name: str) -> ModeParts:
    """The builder of mode ``name``'s (BatchSource, WeightSync)."""
    if name not in PARTS:
        raise ValueError(f"training mode '{name}' has no parts registered (register_mode_parts); with parts: "
                         f"{', '.join(m for m in mode_names() if m in PARTS)}")  # fmt: skip
    return PARTS[name]


@register_mode_parts(SYNC)
def sync_parts(inputs: ModeInputs) -> tuple[BatchSource, WeightSync]:
    total_epochs = inputs.config.trainer.total_epochs
    return GenerateNow(inputs.generation, inputs.groups, inputs.loader, total_epochs), SameWeights()


@register_mode_parts(ONE_STEP_OFF)
def one_step_off_parts(inputs: ModeInputs) -> tuple[BatchSource, WeightSync]:
    config = inputs.config
    source = GenerateAhead(
        inputs.generation,
        inputs.groups,
        inputs.loader,
        total_epochs=config.trainer.total_epochs,
        total_steps=inputs.total_steps,
    )
    return source, TransferEachStep(link_actor_to_rollout(inputs.groups, inputs.plan, config.trainer.async_training))


@register_mode_parts(FULLY_ASYNC)
def fully_async_parts(inputs: ModeInputs) -> tuple[BatchSource, WeightSync]:
    config, groups, generation = inputs.config, inputs.groups, inputs.generation
    settings = config.trainer.async_training
    link = link_actor_to_rollout(groups, inputs.plan, settings)
    rollout_pool = groups.pool_of[Role.Rollout]
    chunks = ChunkGenerator(generation, groups, rollout_pool, settings)
    batch = config.data.train_batch_size
    rollouter = Rollouter(
        generate_chunk=chunks.generate_chunk,
        keep_groups=informative if config.algorithm.filter_groups.enable else None,
        loader_batches=train_batches(inputs.loader, config.trainer.total_epochs),
        batch_groups=batch,
        chunk_prompts=settings.chunk_prompts or batch,
        max_staleness=settings.max_staleness,
        staleness_policy=settings.staleness_policy,
        pad_token_id=generation.pad_token_id,
        partial=PartialRollout(interrupt=link.interrupt, continue_rows=chunks.continue_rows)
        if settings.partial_rollout
        else None,
    )
    push = PushEvery(link, rollouter, groups, rollout_pool, settings.weight_push_every)
    source = AsyncQueue(rollouter, push, generation, groups, inputs.loader, inputs.plan.paths.run_dir)
    return source, push


def rl_trainer(
    config: HybridFlowConfig,
    plan: RunPlan,
    groups: RoleGroups,
    reward_fn: RewardFn,
    loader: PromptDataLoader,
    val_batches: Callable[[], Iterator[DataProto]] | None,
    total_steps: int,
) -> RLTrainer:
    """The RL trainer of the config's mode: its generation, and the mode's batch source and weight sync."""
    generation = Generation(
        config,
        groups.generator,
        Scorer(config, reward_fn, groups.reward_model),
        plan.estimator,
        pad_token_id=loader.dataset.tokenizer.pad_token_id,
        actor_ranks=plan.actor_layout.dp,
    )
    inputs = ModeInputs(
        config=config, plan=plan, groups=groups, generation=generation, loader=loader, total_steps=total_steps
    )
    source, weights = mode_parts(config.trainer.async_training.mode)(inputs)
    return RLTrainer(config, plan, groups, generation, source, weights, loader, val_batches)
