"""``hybridflow sft [--config FILE] key=value ...``: check the config, read the data, start Ray, build the ``sft``
worker group, run the loop.

Everything a run can get wrong in what it was given (a key, a file, a row, a layout that does not split the
model, batch sizes that do not split over the ranks, a run directory of another run) is a ConfigError before
Ray starts. Also runnable as ``python -m hybridflow.trainer.commands.sft``.
"""

from __future__ import annotations

import sys

from hybridflow.data import SFTDataset
from hybridflow.trainer.commands.supervised_run import SupervisedPlan, check_supervised_config, run_supervised
from hybridflow.trainer.loop.sft_trainer import SFTTrainer
from hybridflow.trainer.setup.config import config_sections
from hybridflow.trainer.setup.config_help import config_command_args
from hybridflow.trainer.setup.sft_config import SFT_DEFAULT_CONFIG, SFTConfig, load_sft_config
from hybridflow.validation import run_command, split_debug_flag
from hybridflow.workers.sft import SFTWorker

POOL = "sft"


def check_sft_config(config: SFTConfig) -> SupervisedPlan:
    """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's
    config and builds nothing."""
    return check_supervised_config(config, POOL, "samples")


def run(config: SFTConfig) -> dict[str, float]:
    plan = check_sft_config(config)

    def make_trainer(group, train, val) -> SFTTrainer:
        val_batches = (lambda: iter(val)) if val else None
        return SFTTrainer(group, POOL, plan.layout.dp, train, val_batches, total_epochs=config.trainer.total_epochs)

    return run_supervised(
        config,
        plan,
        what="sft",
        dataset_class=SFTDataset,
        worker_class=SFTWorker,
        worker_kwargs={},
        make_trainer=make_trainer,
    )


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
