"""``hybridflow rm [--config FILE] key=value ...``: check the config, read the pairs, start Ray, build the ``rm``
worker group, run the loop: a reward model trained with the Bradley-Terry loss (commands/supervised_run.py: what
every supervised command shares).

The model is the given backbone with a scalar head, reading each answer as an RL run's reward worker reads a
policy's (data/reward_text.py), so the exported model (``hybridflow export``) goes straight into an RL run's
``reward_model.model.path``. Everything a run can get wrong in what it was given is a ConfigError before Ray starts.
Also runnable as ``python -m hybridflow.trainer.commands.rm``.
"""

from __future__ import annotations

import sys

from hybridflow.data.reward_pairs import RewardPairDataset
from hybridflow.trainer.commands.supervised_run import SupervisedCommand
from hybridflow.trainer.setup.config import ConfigError
from hybridflow.trainer.setup.config_help import run_as_module
from hybridflow.trainer.setup.rm_config import RM_DEFAULT_CONFIG, RMConfig

ABOUT = """Reward-model training: the model (a backbone with a scalar head) learns to score each pair's chosen
answer above its rejected one (the Bradley-Terry loss, minus the pair's margin with data.margin_key). Rows are as for
hybridflow dpo: a "prompt" and "chosen" and "rejected" answers, or two conversations sharing their first messages.
Every key has its default in {defaults}; a --config file holds only the keys it changes, and key=value
overrides any key:
  hybridflow rm data.train_files=[pairs.parquet] data.val_files=[held_out.parquet] model.path=smollm2-135m-instruct
The run directory's checkpoints export (hybridflow export) to a model directory that an RL run loads with
reward_model.enable=true reward_model.model.path=DIR.
"""


def check_rm_rows(config: RMConfig) -> None:
    if config.data.tools_key:
        raise ConfigError(
            "data.tools_key",
            "a reward model reads the conversation without tool schemas, as the RL reward worker renders it",
            "set data.tools_key='' (tool calls and results in the answers' messages are still read)",
        )


RM = SupervisedCommand(
    name="rm",
    config_class=RMConfig,
    default_config=RM_DEFAULT_CONFIG,
    about=ABOUT,
    dataset_class=RewardPairDataset,
    objective="rm",
    describe=lambda config: "reward model (Bradley-Terry)",
    check_own=check_rm_rows,
)
check_rm_config, run, main = RM.check, RM.run, RM.main

if __name__ == "__main__":  # python -m hybridflow.trainer.commands.rm: the same command as hybridflow rm
    sys.exit(run_as_module(main))
