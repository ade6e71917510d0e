"""``hybridflow dpo [--config FILE] key=value ...``: check the config, read the pairs, start Ray, build the ``dpo``
worker group, run the loop.

Everything a run can get wrong in what it was given (a key, a file, a row, a layout that does not split the model,
batch sizes that do not split over the ranks, a run directory of another run) is a ConfigError before Ray starts.
Also runnable as ``python -m hybridflow.trainer.commands.dpo``.
"""

from __future__ import annotations

import sys

from hybridflow.data import PreferenceDataset
from hybridflow.trainer.commands.supervised_run import SupervisedPlan, check_supervised_config, run_supervised
from hybridflow.trainer.loop.preference_trainer import DPOTrainer
from hybridflow.trainer.setup.config import config_sections
from hybridflow.trainer.setup.config_help import config_command_args
from hybridflow.trainer.setup.dpo_config import DPO_DEFAULT_CONFIG, DPOConfig, load_dpo_config
from hybridflow.validation import run_command, split_debug_flag
from hybridflow.workers.preference import PreferenceWorker

POOL = "dpo"


def check_dpo_config(config: DPOConfig) -> SupervisedPlan:
    """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's config and
    builds nothing."""
    return check_supervised_config(config, POOL, "pairs")


def run(config: DPOConfig) -> dict[str, float]:
    plan = check_dpo_config(config)

    def make_trainer(group, train, val) -> DPOTrainer:
        val_batches = (lambda: iter(val)) if val else None
        return DPOTrainer(
            group, POOL, plan.layout.dp, train, val_batches, config.algorithm, total_epochs=config.trainer.total_epochs
        )

    return run_supervised(
        config,
        plan,
        what=f"dpo ({config.algorithm.loss_type}, beta {config.algorithm.beta})",
        dataset_class=PreferenceDataset,
        worker_class=PreferenceWorker,
        worker_kwargs={"preference": config.algorithm},
        make_trainer=make_trainer,
    )


def dpo_usage() -> str:
    sections = "\n".join(f"  {name:<24} {help}" for name, help in config_sections(DPOConfig))
    return f"""usage: hybridflow dpo [--config FILE] [--debug] key=value ...
       hybridflow dpo --help [SECTION]      every key of SECTION with its default and help

Direct preference optimisation: the model learns to prefer each pair's chosen answer over its rejected one,
relative to the reference (the starting model; under LoRA the model with its adapters off). Rows hold a "prompt"
and "chosen" and "rejected" answers, or two conversations sharing their first messages. Every key has its default
in {DPO_DEFAULT_CONFIG}; a --config file holds only the keys it changes, and key=value overrides any key:
  hybridflow dpo data.train_files=[pairs.parquet] model.path=smollm2-135m-instruct algorithm.beta=0.1
The run directory's checkpoints export (hybridflow export) to a model directory.

config sections:
{sections}
"""


def main(argv: list[str] | None = None) -> int:
    """``hybridflow dpo [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = config_command_args(args, "dpo", dpo_usage, DPOConfig, DPO_DEFAULT_CONFIG)
    if parsed is not None:
        run(load_dpo_config(*parsed))
    return 0


if __name__ == "__main__":  # python -m hybridflow.trainer.commands.dpo: the same command as hybridflow dpo
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
