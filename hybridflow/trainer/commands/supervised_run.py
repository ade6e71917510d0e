"""What the supervised commands share (``hybridflow sft``, ``dpo``, ``rm``): the command itself (its usage, its
arguments, its checks), the checks of a one-pool run, the run directory, the model built once the checks passed, one
worker group on one pool, and the step loop.

Each command is a ``SupervisedCommand``: its config (the sections ``data``, ``model``, ``engine``, ``optim`` and
``trainer`` in the same shapes), its data set and its objective (algorithms/objectives/) with the objective's config
section; the worker (workers/supervised.py), the trainer (loop/supervised_trainer.py) and everything else are
written here once.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from hybridflow.algorithms.objectives import OBJECTIVES, SEQUENCE_SCORES
from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec
from hybridflow.controller.ray_runtime import tuning_env
from hybridflow.data import PromptDataLoader
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_tokenizer
from hybridflow.trainer.loop.step_loop import fit_run
from hybridflow.trainer.loop.supervised_trainer import SupervisedTrainer
from hybridflow.trainer.services.tracking import check_loggers
from hybridflow.trainer.setup.check_config import (
    check_files,
    check_lora_targets,
)
from hybridflow.trainer.setup.cluster import check_local_cluster, ray_for_run
from hybridflow.trainer.setup.config import ConfigError, load_config, to_yaml
from hybridflow.trainer.setup.config_help import config_command_args
from hybridflow.trainer.setup.placement import Placement
from hybridflow.trainer.setup.role_parts import PARALLEL_SIZES
from hybridflow.trainer.setup.run_dir import changed_keys, check_run_directory
from hybridflow.trainer.setup.run_plan import (
    check_micro_batches_fill_stages,
    check_scores_in_stages,
    model_dir_or_name,
    parallel_shape,
    resolve_model_dir,
    total_training_steps,
)
from hybridflow.workers.supervised import SupervisedWorker

# keys whose change makes a run directory's checkpoints mean something else: the model (the state's shapes; DPO's
# reference) and what the loader's saved position counts
SUPERVISED_STATE_KEYS = (
    "model.path",
    "model.lora.rank",
    "data.train_files",
    "data.train_batch_size",
    "data.shuffle",
    "trainer.seed",
)


@dataclass(frozen=True)
class SupervisedPlan:
    """What a one-pool run derives from its config, once: the model, the layout, the pool."""

    pool: str  # the pool's name: the worker group's, and its lane in the timeline
    model_path: str  # a built-in name until with_model() builds it, or an absolute local directory
    layout: LayoutShape
    placement: Placement
    run_dir: Path

    def with_model(self) -> SupervisedPlan:
        """The plan with a built-in model built into its cached directory: after every check has passed."""
        return dataclasses.replace(self, model_path=resolve_model_dir(self.model_path, "model.path"))


def check_supervised_config(config: Any, pool: str, objective: Any) -> SupervisedPlan:
    """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's config and
    builds nothing. ``objective``: the objective's class (whether rows come in pairs, what its forward gives)."""
    batch_what = "pairs" if objective.paired else "samples"  # what data.train_batch_size counts
    data, engine, trainer = config.data, config.engine, config.trainer
    check_files(data.train_files, "data.train_files", required=True)
    check_files(data.val_files, "data.val_files", required=False)
    model_path = model_dir_or_name(config.model.path, "model.path")
    layout = parallel_shape(
        trainer.world_size,
        "trainer.nnodes x trainer.n_workers_per_node",
        model_path,
        t=engine.tensor_model_parallel_size,
        sp=engine.ulysses_sequence_parallel_size,
        pp=engine.pipeline_model_parallel_size,
        vpp=engine.virtual_pipeline_model_parallel_size,
        keys=tuple(f"engine.{name}" for name in PARALLEL_SIZES),
        packed=(engine.use_remove_padding, "engine.use_remove_padding"),
    )
    if data.train_batch_size % layout.dp:
        raise ConfigError(
            "data.train_batch_size",
            f"{data.train_batch_size} {batch_what} do not split evenly over {layout.dp} data-parallel ranks",
            f"use a multiple of {layout.dp}",
        )
    if layout.pp > 1:
        check_supervised_stages(config, objective, layout)
        check_scores_in_stages(layout, objective.output == SEQUENCE_SCORES, "engine.ulysses_sequence_parallel_size")
    check_lora_targets("model", config.model.lora, model_path)
    placement = Placement({pool: [trainer.n_workers_per_node] * trainer.nnodes}, {})
    if trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "cuda asked for but no GPU is visible", "trainer.device=cpu")
    if not trainer.ray_address:
        check_local_cluster(trainer, placement)
    try:
        check_loggers(trainer.logger)
    except ImportError as error:
        raise ConfigError("trainer.logger", str(error), "install the package or drop the logger") from None
    return SupervisedPlan(pool, model_path, layout, placement, Path(trainer.default_local_dir))


def generation_eos(model_path: str) -> int | list[int] | None:
    """The model's generation EOS (a stop token of generation, so an end of an assistant turn)."""
    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        return None


def data_loaders(
    config: Any, make_dataset: Callable[[list[str], str], Any]
) -> tuple[PromptDataLoader, PromptDataLoader | None]:
    """The training loader (shuffled by ``data.shuffle``, seeded by ``trainer.seed``) and the held-out one (None
    without ``data.val_files``); ``make_dataset(files, key)`` reads one data set."""
    data = config.data
    train = PromptDataLoader(
        make_dataset(data.train_files, "data.train_files"),
        data.train_batch_size,
        shuffle=data.shuffle,
        seed=config.trainer.seed,
    )
    if not data.val_files:
        return train, None
    val_dataset = make_dataset(data.val_files, "data.val_files")
    val = PromptDataLoader(val_dataset, min(data.val_batch_size, len(val_dataset)), shuffle=False, drop_last=False)
    return train, val


def run_supervised(
    config: Any,
    plan: SupervisedPlan,
    *,
    what: str,
    dataset_class: Callable[..., Any],
    objective: str,
    settings: Any = None,
) -> dict[str, float]:
    """The run: its directory checked (``SUPERVISED_STATE_KEYS``: a change refused), the model built, the data read
    (``dataset_class(files, tokenizer, config.data, generation_eos=, key=)``), then the worker group on its pool and
    the step loop. ``objective``: the registered objective's name, ``settings`` its config section (None where it
    has none); ``what`` names the run in the line printed before Ray starts."""
    objective_part = OBJECTIVES.get(objective)(settings)
    trainer_config = config.trainer
    config_yaml = to_yaml(config)
    run_dir = check_run_directory(
        plan.run_dir,
        trainer_config,
        config_yaml,
        lambda saved, _: changed_keys(saved, config_yaml, SUPERVISED_STATE_KEYS),
    )
    plan = plan.with_model()  # the model into the cache (the first time: a conversion) once the checks passed
    tokenizer, eos = load_tokenizer(plan.model_path), generation_eos(plan.model_path)
    train_loader, val_loader = data_loaders(
        config, lambda files, key: dataset_class(files, tokenizer, config.data, generation_eos=eos, key=key)
    )
    steps = total_training_steps(trainer_config, steps_per_epoch=len(train_loader))
    checkpoint = run_dir.prepare()
    dataset = train_loader.dataset
    print(
        f"hybridflow: {what} for {steps} steps ({len(dataset)} {dataset.unit}, {dataset.trained_tokens()} trained "
        f"tokens) on {trainer_config.world_size} workers; run dir {plan.run_dir}"
    )
    worker = supervised_worker(config, plan, objective_part, steps)
    # the workers' tuning settings come with their pool, on any cluster
    with ray_for_run(trainer_config, plan.placement):
        pool = one_pool(trainer_config, plan.placement.pools[plan.pool], plan.pool)
        finished = False
        try:  # on a Ray cluster this run did not start, its workers and their CPUs must not outlive it
            group = RayWorkerGroup(pool, worker, name=plan.pool)
            val_batches = (lambda: iter(val_loader)) if val_loader is not None else None
            trainer = SupervisedTrainer(
                objective_part, group, plan.pool, plan.layout.dp, train_loader, val_batches,
                total_epochs=trainer_config.total_epochs,
            )  # fmt: skip
            result = fit_run(
                trainer,
                trainer_config,
                total_steps=steps,
                run_dir=plan.run_dir,
                record=dataclasses.asdict(config),
                has_validation=val_loader is not None,
                resume_from=checkpoint,
            )
            finished = True
            return result
        finally:
            pool.release(keep_processes=finished)


def check_supervised_stages(config: Any, objective: Any, layout: LayoutShape) -> None:
    """At least one micro-batch per pipeline stage in a step."""
    key = "engine.pipeline_model_parallel_size"
    engine = config.engine
    if not engine.use_dynamic_bsz:
        rows = config.data.train_batch_size * (2 if objective.paired else 1) // layout.dp
        check_micro_batches_fill_stages(
            rows, engine.micro_batch_size_per_gpu, layout.pp, key="engine.micro_batch_size_per_gpu", pp_key=key
        )


def supervised_worker(config: Any, plan: SupervisedPlan, objective: Any, steps: int) -> RoleSpec:
    """The worker of a supervised run (workers/supervised.py) and its arguments, the same on every rank."""
    settings = dict(model=config.model, engine=config.engine, optim=config.optim, model_path=plan.model_path)
    settings.update(layout=plan.layout, total_training_steps=steps, seed=config.trainer.seed, objective=objective)
    return RoleSpec(SupervisedWorker, kwargs=settings)


def one_pool(trainer: Any, nodes: list[int], name: str) -> RayResourcePool:
    """A pool of ``nodes`` processes per node with the ``trainer`` section's resources and tuning."""
    return RayResourcePool(
        nodes,
        use_gpu=trainer.device == "cuda",
        cpus_per_worker=trainer.cpus_per_worker,
        threads_per_worker=trainer.threads_per_worker or None,
        ready_timeout_s=trainer.placement_timeout_s,
        name=name,
        worker_env=tuning_env(trainer.cpu_kernel_cache_capacity),
    )


@dataclass(frozen=True, kw_only=True)
class SupervisedCommand:
    """One supervised command: what differs between ``hybridflow sft``, ``dpo`` and ``rm``."""

    name: str  # the command's name, and its pool's
    config_class: type  # the config's dataclass
    default_config: Path  # the YAML of every key's default
    about: str  # the usage's paragraph: what it trains, on which rows, an example; "{defaults}": the default file
    dataset_class: type
    objective: str  # the registered objective (algorithms/objectives/)
    settings: Callable[[Any], Any] = lambda config: None  # (config) -> the objective's config section, or None
    describe: Callable[[Any], str] | None = None  # the run's first line names it (None: the command's name)
    check_own: Callable[[Any], None] = lambda config: None  # checks of its own, before the shared ones

    def check(self, config: Any) -> SupervisedPlan:
        """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's config
        and builds nothing."""
        self.check_own(config)
        return check_supervised_config(config, self.name, OBJECTIVES.get(self.objective))

    def run(self, config: Any) -> dict[str, float]:
        plan = self.check(config)
        return run_supervised(
            config,
            plan,
            what=self.describe(config) if self.describe else self.name,
            dataset_class=self.dataset_class,
            objective=self.objective,
            settings=self.settings(config),
        )

    def main(self, argv: list[str] | None = None) -> int:
        """``hybridflow <name> [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
        args = list(sys.argv[1:] if argv is None else argv)
        about = self.about.format(defaults=self.default_config)
        parsed = config_command_args(args, self.name, about, self.config_class, self.default_config)
        if parsed is not None:
            self.run(load_config(*parsed, root=self.config_class, defaults=self.default_config))
        return 0
