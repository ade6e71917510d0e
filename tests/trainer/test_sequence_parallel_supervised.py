"""``hybridflow sft``, ``dpo`` and ``rm`` under Ulysses (engine.ulysses_sequence_parallel_size=2, one data-parallel
rank) give the metrics of the same runs with the rows over 2 data-parallel ranks, step for step (fp32, 1e-5): the
SFT loss and held-out loss, DPO's reference pass and preference metrics, the reward model's sequence scores."""

import pytest
from test_dpo_e2e import arguments as dpo_arguments
from test_dpo_e2e import pairs as preference_pairs
from test_rm_e2e import arguments as rm_arguments
from test_rm_e2e import pairs as scored_pairs
from test_sft_e2e import MEASUREMENTS, conversation_files, records
from test_sft_e2e import arguments as sft_arguments

from hybridflow.cli import main as cli
from hybridflow.data.io import write_rows

pytestmark = pytest.mark.slow


def files_of(command: str, root):
    if command == "sft":
        return conversation_files(root)
    pairs = preference_pairs if command == "dpo" else scored_pairs
    return write_rows(pairs(8, 0), root / "train.jsonl"), write_rows(pairs(4, 1), root / "val.jsonl")


ARGUMENTS = {"sft": sft_arguments, "dpo": dpo_arguments, "rm": rm_arguments}


def assert_size_2_equals_two_data_parallel_ranks(tmp_path, command: str, key: str) -> None:
    """``command`` with ``engine.<key>`` 2 against 1 (the rows over the 2 ranks), 2 steps, metric by metric."""
    files = files_of(command, tmp_path)
    runs = {}
    for size in (1, 2):
        run_dir = tmp_path / f"{key}{size}"
        extra = [f"engine.{key}={size}", "trainer.total_training_steps=2"]
        assert cli([command, *ARGUMENTS[command](files, run_dir), *extra]) == 0
        runs[size] = records(run_dir)
    assert sorted(runs[2]) == sorted(runs[1]) == [0, 1, 2]  # step 0: the held-out metrics before training
    for step, want in runs[1].items():
        want = {k: v for k, v in want.items() if not k.startswith(MEASUREMENTS)}
        have = {k: v for k, v in runs[2][step].items() if not k.startswith(MEASUREMENTS)}
        assert want.keys() == have.keys() and len(want) > 3
        for name, value in want.items():
            assert abs(have[name] - value) <= 1e-5 * max(1.0, abs(value)), (command, step, name, have[name], value)


@pytest.mark.parametrize("command", sorted(ARGUMENTS))
def test_sp_2_equals_two_data_parallel_ranks(local_ray, tmp_path, command):
    assert_size_2_equals_two_data_parallel_ranks(tmp_path, command, "ulysses_sequence_parallel_size")
