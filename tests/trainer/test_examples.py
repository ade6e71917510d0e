"""Every example config loads: its keys exist and its values pass their sections' checks (SFT's, DPO's and the
reward model's with their trainers' configs, the others with RL's)."""

from pathlib import Path

import pytest

from hybridflow.trainer.setup.config import HybridFlowConfig, load_config
from hybridflow.trainer.setup.dpo_config import DPOConfig, load_dpo_config
from hybridflow.trainer.setup.rm_config import RMConfig, load_rm_config
from hybridflow.trainer.setup.sft_config import SFTConfig, load_sft_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_example_config_loads(path):
    if path.name.startswith("sft_"):
        assert isinstance(load_sft_config(config_file=path), SFTConfig)
    elif path.name.startswith("dpo_"):
        assert isinstance(load_dpo_config(config_file=path), DPOConfig)
    elif path.name.startswith("rm_"):
        assert isinstance(load_rm_config(config_file=path), RMConfig)
    else:
        assert isinstance(load_config(config_file=path), HybridFlowConfig)


def test_there_are_examples_of_both_trainers():
    names = [p.name for p in EXAMPLES]
    assert any(n.startswith("sft_") for n in names) and any(n.startswith("grpo_") for n in names)
