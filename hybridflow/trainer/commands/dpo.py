"""``hybridflow dpo [--config FILE] key=value ...``: check the config, read the pairs, start Ray, build the ``dpo``
worker group, run the loop (commands/supervised_run.py: what every supervised command shares).

Everything a run can get wrong in what it was given (a key, a file, a row, a layout that does not split the model,
batch sizes that do not split over the ranks, a run directory of another run) is a ConfigError before Ray starts.
Also runnable as ``python -m hybridflow.trainer.commands.dpo``.
"""

from __future__ import annotations

import sys

from hybridflow.data import PreferenceDataset
from hybridflow.trainer.commands.supervised_run import SupervisedCommand
from hybridflow.trainer.setup.config_help import run_as_module
from hybridflow.trainer.setup.dpo_config import DPO_DEFAULT_CONFIG, DPOConfig

ABOUT = """Direct preference optimisation: the model learns to prefer each pair's chosen answer over its rejected one,
relative to the reference (the starting model; under LoRA the model with its adapters off). Rows hold a "prompt"
and "chosen" and "rejected" answers, or two conversations sharing their first messages. Every key has its default
in {defaults}; a --config file holds only the keys it changes, and key=value overrides any key:
  hybridflow dpo data.train_files=[pairs.parquet] model.path=smollm2-135m-instruct algorithm.beta=0.1
The run directory's checkpoints export (hybridflow export) to a model directory.
"""


DPO = SupervisedCommand(
    name="dpo",
    config_class=DPOConfig,
    default_config=DPO_DEFAULT_CONFIG,
    about=ABOUT,
    dataset_class=PreferenceDataset,
    objective="dpo",
    settings=lambda config: config.algorithm,
    describe=lambda config: f"dpo ({config.algorithm.loss_type}, beta {config.algorithm.beta})",
)
check_dpo_config, run, main = DPO.check, DPO.run, DPO.main

if __name__ == "__main__":  # python -m hybridflow.trainer.commands.dpo: the same command as hybridflow dpo
    sys.exit(run_as_module(main))
