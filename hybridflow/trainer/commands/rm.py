"""``hybridflow rm [--config FILE] key=value ...``: check the config, read the pairs, start Ray, build the ``rm``
worker group, run the loop: a reward model trained with the Bradley-Terry loss.

The model is the given backbone with a scalar head, reading each answer as an RL run's reward worker reads a
policy's (data/reward_text.py), so the exported model (``hybridflow export``) goes straight into an RL run's
``reward_model.path``. Everything a run can get wrong in what it was given is a ConfigError before Ray starts.
Also runnable as ``python -m hybridflow.trainer.commands.rm``.
"""

from __future__ import annotations

import sys

from hybridflow.data.reward_pairs import RewardPairDataset
from hybridflow.trainer.commands.supervised_run import SupervisedPlan, check_supervised_config, run_supervised
from hybridflow.trainer.loop.preference_trainer import RewardModelTrainer
from hybridflow.trainer.setup.config import ConfigError, config_sections
from hybridflow.trainer.setup.config_help import config_command_args
from hybridflow.trainer.setup.rm_config import RM_DEFAULT_CONFIG, RMConfig, load_rm_config
from hybridflow.validation import run_command, split_debug_flag
from hybridflow.workers.reward_training import RewardTrainingWorker

POOL = "rm"


def check_rm_config(config: RMConfig) -> SupervisedPlan:
    """ConfigError naming the first problem; the run's plan when the config can run. Reads the model's config and
    builds nothing."""
    if config.data.tools_key:
        raise ConfigError(
            "data.tools_key",
            "a reward model reads the conversation without tool schemas, as the RL reward worker renders it",
            "set data.tools_key='' (tool calls and results in the answers' messages are still read)",
        )
    return check_supervised_config(config, POOL, "pairs")


def run(config: RMConfig) -> dict[str, float]:
    plan = check_rm_config(config)

    def make_trainer(group, train, val) -> RewardModelTrainer:
        val_batches = (lambda: iter(val)) if val else None
        return RewardModelTrainer(
            group, POOL, plan.layout.dp, train, val_batches, total_epochs=config.trainer.total_epochs
        )

    return run_supervised(
        config,
        plan,
        what="reward model (Bradley-Terry)",
        dataset_class=RewardPairDataset,
        worker_class=RewardTrainingWorker,
        worker_kwargs={},
        make_trainer=make_trainer,
    )


def rm_usage() -> str:
    sections = "\n".join(f"  {name:<24} {help}" for name, help in config_sections(RMConfig))
    return f"""usage: hybridflow rm [--config FILE] [--debug] key=value ...
       hybridflow rm --help [SECTION]       every key of SECTION with its default and help

Reward-model training: the model (a backbone with a scalar head) learns to score each pair's chosen answer above
its rejected one (the Bradley-Terry loss, minus the pair's margin with data.margin_key). Rows are as for hybridflow
dpo: a "prompt" and "chosen" and "rejected" answers, or two conversations sharing their first messages. Every key
has its default in {RM_DEFAULT_CONFIG}; a --config file holds only the keys it changes, and key=value overrides
any key:
  hybridflow rm data.train_files=[pairs.parquet] data.val_files=[held_out.parquet] model.path=smollm2-135m-instruct
The run directory's checkpoints export (hybridflow export) to a model directory that an RL run loads as
reward_model.path.

config sections:
{sections}
"""


def main(argv: list[str] | None = None) -> int:
    """``hybridflow rm [--config FILE] key=value ...``; returns the exit code (UserError: see run_command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parsed = config_command_args(args, "rm", rm_usage, RMConfig, RM_DEFAULT_CONFIG)
    if parsed is not None:
        run(load_rm_config(*parsed))
    return 0


if __name__ == "__main__":  # python -m hybridflow.trainer.commands.rm: the same command as hybridflow rm
    debug, arguments = split_debug_flag(sys.argv[1:])
    sys.exit(run_command(lambda: main(arguments), debug))
