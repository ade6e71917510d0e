"""``hybridflow sft [--config FILE] key=value ...``: check the config, read the data, start Ray, build the ``sft``
worker group, run the loop (commands/supervised_run.py: what every supervised command shares).

Everything a run can get wrong in what it was given (a key, a file, a row, a layout that does not split the
model, batch sizes that do not split over the ranks, a run directory of another run) is a ConfigError before
Ray starts. Also runnable as ``python -m hybridflow.trainer.commands.sft``.
"""

from __future__ import annotations

import sys

from hybridflow.data import SFTDataset
from hybridflow.trainer.commands.supervised_run import SupervisedCommand
from hybridflow.trainer.setup.config_help import run_as_module
from hybridflow.trainer.setup.sft_config import SFT_DEFAULT_CONFIG, SFTConfig

ABOUT = """Supervised fine-tuning: the loss on the assistant turns of conversations (a "messages" column), or on the
answers of prompt/response pairs. Every key has its default in {defaults}; a --config file holds
only the keys it changes, and key=value overrides any key, for example
  hybridflow sft data.train_files=[data/calculator_sft/train.parquet] model.path=smollm2-135m-instruct
The run directory's checkpoints export (hybridflow export) to a model directory that hybridflow train
starts from (actor_rollout_ref.model.path=...).
"""


SFT = SupervisedCommand(
    name="sft",
    config_class=SFTConfig,
    default_config=SFT_DEFAULT_CONFIG,
    about=ABOUT,
    dataset_class=SFTDataset,
    objective="sft",
)
check_sft_config, run, main = SFT.check, SFT.run, SFT.main

if __name__ == "__main__":  # python -m hybridflow.trainer.commands.sft: the same command as hybridflow sft
    sys.exit(run_as_module(main))
