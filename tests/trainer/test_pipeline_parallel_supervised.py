"""``hybridflow sft`` and ``dpo`` with the model in 2 pipeline stages (engine.pipeline_model_parallel_size=2, one
data-parallel rank) give the metrics of the same runs with the rows over 2 data-parallel ranks, step for step (fp32,
1e-5): the SFT loss and held-out loss, DPO's reference pass (a frozen copy in stages too) and preference metrics. The
reward model's sequence score does not run through stages yet: ``hybridflow rm`` refuses it before anything starts."""

import pytest
from test_sequence_parallel_supervised import ARGUMENTS, assert_size_2_equals_two_data_parallel_ranks, files_of

from hybridflow.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", ["dpo", "sft"])
def test_pp_2_equals_two_data_parallel_ranks(local_ray, tmp_path, command):
    assert_size_2_equals_two_data_parallel_ranks(tmp_path, command, "pipeline_model_parallel_size")


def test_the_reward_model_refuses_stages_before_anything_starts(tmp_path, capsys):
    files = files_of("rm", tmp_path)
    assert cli(["rm", *ARGUMENTS["rm"](files, tmp_path / "run"), "engine.pipeline_model_parallel_size=2"]) == 2
    assert "engine.pipeline_model_parallel_size" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
