"""``hybridflow sft`` and ``dpo`` with the model in 2 pipeline stages (engine.pipeline_model_parallel_size=2, one
data-parallel rank) give the metrics of the same runs with the rows over 2 data-parallel ranks, step for step (fp32,
1e-5): the SFT loss and held-out loss, DPO's reference pass (a frozen copy in stages too) and preference metrics. The
reward model's sequence score does not run through stages yet: ``hybridflow rm`` refuses it before anything starts."""

import pytest
from test_sequence_parallel_supervised import ARGUMENTS, files_of
from test_sft_e2e import MEASUREMENTS, records

from hybridflow.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", ["dpo", "sft"])
def test_pp_2_equals_two_data_parallel_ranks(local_ray, tmp_path, command):
    files = files_of(command, tmp_path)
    runs = {}
    for pp in (1, 2):
        run_dir = tmp_path / f"pp{pp}"
        extra = [f"engine.pipeline_model_parallel_size={pp}", "trainer.total_training_steps=2"]
        assert cli([command, *ARGUMENTS[command](files, run_dir), *extra]) == 0
        runs[pp] = records(run_dir)
    assert sorted(runs[2]) == sorted(runs[1]) == [0, 1, 2]  # step 0: the held-out metrics before training
    for step, want in runs[1].items():
        want = {k: v for k, v in want.items() if not k.startswith(MEASUREMENTS)}
        have = {k: v for k, v in runs[2][step].items() if not k.startswith(MEASUREMENTS)}
        assert want.keys() == have.keys() and len(want) > 3
        for key, value in want.items():
            assert abs(have[key] - value) <= 1e-5 * max(1.0, abs(value)), (command, step, key, have[key], value)


def test_the_reward_model_refuses_stages_before_anything_starts(tmp_path, capsys):
    files = files_of("rm", tmp_path)
    assert cli(["rm", *ARGUMENTS["rm"](files, tmp_path / "run"), "engine.pipeline_model_parallel_size=2"]) == 2
    assert "engine.pipeline_model_parallel_size" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
