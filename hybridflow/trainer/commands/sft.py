"""``hybridflow sft [--config FILE] key=value ...``: check the config, read the data, start Ray, build the ``sft``
worker group, run the loop.

Everything a run can get wrong in what it was given (a key, a file, a row, a layout that does not split the
model, batch sizes that do not split over the ranks, a run directory of another run) is a ConfigError before
Ray starts. Also runnable as ``python -m hybridflow.trainer.commands.sft``.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from hybridflow.controller import RayResourcePool, RayWorkerGroup, RoleSpec, ray_session
from hybridflow.controller.ray_runtime import tuning_env
from hybridflow.data import PromptDataLoader, SFTDataset
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.models import load_tokenizer
from hybridflow.trainer.loop.sft_trainer import SFTTrainer
from hybridflow.trainer.loop.step_loop import StepLoop, run_schedule
from hybridflow.trainer.services.tracking import Tracking, check_loggers
from hybridflow.trainer.setup.check_config import (
    check_cluster,
    check_files,
    check_local_cluster,
    check_lora_targets,
    local_cluster_cpus,
)
from hybridflow.trainer.setup.config import ConfigError, config_sections, to_yaml
from hybridflow.trainer.setup.config_help import config_command_args
from hybridflow.trainer.setup.placement import Placement
from hybridflow.trainer.setup.run_dir import changed_keys, check_run_directory
from hybridflow.trainer.setup.run_plan import (
    check_splits_evenly,
    model_dir_or_name,
    resolve_model_dir,
    total_training_steps,
)
from hybridflow.trainer.setup.sft_config import SFT_DEFAULT_CONFIG, SFTConfig, load_sft_config
from hybridflow.validation import run_command, split_debug_flag
from hybridflow.workers.sft import SFTWorker

POOL = "sft"
# keys whose change makes a run directory's checkpoints mean something else: the model (the state's shapes) and
# what the loader's saved position counts
STATE_KEYS = (
    "model.path",
    "model.lora.rank",
    "data.train_files",
    "data.train_batch_size",
    "data.shuffle",
    "trainer.seed",
)


@dataclass(frozen=True)
class SFTPlan:
    """What an SFT run derives from its config, once: the model, the layout, the pool."""

    model_path: str  # a built-in name until with_model() builds it, or an absolute local directory
    layout: LayoutShape
    placement: Placement
    run_dir: Path

    def with_model(self) -> SFTPlan:
        """The plan with a built-in model built into its cached directory: after every check has passed."""
        return dataclasses.replace(self, model_path=resolve_model_dir(self.model_path, "model.path"))


def check_sft_config(config: SFTConfig) -> SFTPlan:
    """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's
    config and builds nothing."""
    data, engine, trainer = config.data, config.engine, config.trainer
    check_files(data.train_files, "data.train_files", required=True)
    check_files(data.val_files, "data.val_files", required=False)
    model_path = model_dir_or_name(config.model.path, "model.path")
    world, t = trainer.world_size, engine.tensor_model_parallel_size
    if world % t:
        raise ConfigError(
            "engine.tensor_model_parallel_size",
            f"{world} ranks (trainer.nnodes x trainer.n_workers_per_node) do not split into groups of {t}",
            "use a divisor of the ranks",
        )
    check_splits_evenly(model_path, t, "engine.tensor_model_parallel_size")
    layout = LayoutShape.over(world, t)
    if data.train_batch_size % layout.dp:
        raise ConfigError(
            "data.train_batch_size",
            f"{data.train_batch_size} samples do not split evenly over {layout.dp} data-parallel ranks",
            f"use a multiple of {layout.dp}",
        )
    check_lora_targets("model", config.model.lora, model_path)
    placement = Placement({POOL: [trainer.n_workers_per_node] * trainer.nnodes}, {})
    if trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "cuda asked for but no GPU is visible", "trainer.device=cpu")
    if not trainer.ray_address:
        check_local_cluster(trainer, placement)
    try:
        check_loggers(trainer.logger)
    except ImportError as error:
        raise ConfigError("trainer.logger", str(error), "install the package or drop the logger") from None
    return SFTPlan(model_path, layout, placement, Path(trainer.default_local_dir))


def generation_eos(model_path: str) -> int | list[int] | None:
    """The model's generation EOS (a stop token of generation, so an end of an assistant turn)."""
    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        return None


def run(config: SFTConfig) -> dict[str, float]:
    plan = check_sft_config(config)
    data, trainer = config.data, config.trainer
    config_yaml = to_yaml(config)
    run_dir = check_run_directory(
        plan.run_dir, trainer, config_yaml, lambda saved, _: changed_keys(saved, config_yaml, STATE_KEYS)
    )
    plan = plan.with_model()  # the model into the cache (the first time: a conversion) once the checks passed
    tokenizer = load_tokenizer(plan.model_path)
    eos = generation_eos(plan.model_path)
    train_dataset = SFTDataset(data.train_files, tokenizer, data, generation_eos=eos)
    train_loader = PromptDataLoader(train_dataset, data.train_batch_size, shuffle=data.shuffle, seed=trainer.seed)
    val_loader = None
    if data.val_files:
        val_dataset = SFTDataset(data.val_files, tokenizer, data, generation_eos=eos, key="data.val_files")
        val_loader = PromptDataLoader(
            val_dataset, min(data.val_batch_size, len(val_dataset)), shuffle=False, drop_last=False
        )
    total_steps = total_training_steps(trainer, steps_per_epoch=len(train_loader))
    checkpoint = run_dir.prepare()
    print(
        f"hybridflow: sft for {total_steps} steps ({len(train_dataset)} samples, {train_dataset.trained_tokens()} "
        f"trained tokens) on {trainer.world_size} workers; run dir {plan.run_dir}"
    )
    joined = trainer.ray_address
    # the workers' tuning settings come with their pool (below), on any cluster
    with ray_session(joined or None, None if joined else local_cluster_cpus(trainer, plan.placement)):
        if joined:
            check_cluster(trainer, plan.placement)
        pool = RayResourcePool(
            plan.placement.pools[POOL],
            use_gpu=trainer.device == "cuda",
            cpus_per_worker=trainer.cpus_per_worker,
            threads_per_worker=trainer.threads_per_worker or None,
            ready_timeout_s=trainer.placement_timeout_s,
            name=POOL,
            worker_env=tuning_env(trainer.cpu_kernel_cache_capacity),
        )
        spec = RoleSpec(
            SFTWorker,
            kwargs=dict(
                model=config.model,
                engine=config.engine,
                optim=config.optim,
                model_path=plan.model_path,
                layout=plan.layout,
                total_training_steps=total_steps,
                seed=trainer.seed,
            ),
        )
        finished = False
        try:  # on a Ray cluster this run did not start, its workers and their CPUs must not outlive it
            group = RayWorkerGroup(pool, spec, name=POOL)
            tracking = Tracking(trainer.logger, plan.run_dir, dataclasses.asdict(config))
            val_batches = (lambda: iter(val_loader)) if val_loader else None
            sft = SFTTrainer(group, POOL, plan.layout.dp, train_loader, val_batches, total_epochs=trainer.total_epochs)
            loop = StepLoop(
                sft,
                schedule=run_schedule(trainer, total_steps, has_validation=val_loader is not None),
                run_dir=plan.run_dir,
                tracking=tracking,
                max_ckpt_to_keep=trainer.max_ckpt_to_keep,
            )
            try:
                result = loop.fit(resume_from=checkpoint)
                finished = True
                return result
            finally:
                tracking.finish()
        finally:
            pool.release(keep_processes=finished)


def sft_usage() -> str:
    sections = "\n".join(f"  {name:<24} {help}" for name, help in config_sections(SFTConfig))
    return f"""usage: hybridflow sft [--config FILE] [--debug] key=value ...
       hybridflow sft --help [SECTION]      every key of SECTION with its default and help

Supervised fine-tuning: the loss on the assistant turns of conversations (a "messages" column), or on the
answers of prompt/response pairs. Every key has its default in {SFT_DEFAULT_CONFIG}; a --config file holds
only the keys it changes, and key=value overrides any key, for example
  hybridflow sft data.train_files=[data/calculator_sft/train.parquet] model.path=smollm2-135m-instruct
The run directory's checkpoints export (hybridflow export) to a model directory that hybridflow train
starts from (actor_rollout_ref.model.path=...).

config sections:
{sections}
"""


def main(argv: list[str] | None = None) -> int:
    """``hybridflow sft [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = config_command_args(args, "sft", sft_usage, SFTConfig, SFT_DEFAULT_CONFIG)
    if parsed is not None:
        run(load_sft_config(*parsed))
    return 0


if __name__ == "__main__":  # python -m hybridflow.trainer.commands.sft: the same command as hybridflow sft
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
