"""``hybridflow sft``, ``dpo`` and ``rm`` with the model in 2 pipeline stages (engine.pipeline_model_parallel_size=2,
one data-parallel rank) give the metrics of the same runs with the rows over 2 data-parallel ranks, step for step
(fp32, 1e-5): the SFT loss and held-out loss, DPO's reference pass (a frozen copy in stages too) and preference
metrics, the reward model's Bradley-Terry loss and held-out accuracy (its sequence scores read on the last stage)."""

import pytest
from test_sequence_parallel_supervised import assert_size_2_equals_two_data_parallel_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", ["dpo", "rm", "sft"])
def test_pp_2_equals_two_data_parallel_ranks(local_ray, tmp_path, command):
    assert_size_2_equals_two_data_parallel_ranks(tmp_path, command, "pipeline_model_parallel_size")
