"""Whole GRPO and PPO runs (fp32, one optimizer step per step) on 2 ranks: with the actor, its reference and (PPO, GAE)
the critic under Ulysses (sp = 2, one data-parallel rank) every metric of each step equals the run with the rows
split over 2 data-parallel ranks (sp = 1), up to float rounding; and the checkpoint of step 2 written at sp = 2
resumes at sp = 1 to the metrics of steps 3 and 4. The kill -9 resume at sp = 2 is
tests/trainer/test_kill_and_resume.py's "ulysses" mode."""

import pytest
from test_kill_and_resume import args, comparable, records

from hybridflow.cli import main as cli
from hybridflow.data.tasks import write_task

pytestmark = pytest.mark.slow

SP_KEYS = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size",
)
SP_1 = [f"{key}=1" for key in SP_KEYS]
# a reward every response earns some of (the arithmetic task's is 0 for an untrained tiny model, and so would be the
# critic's targets): its digits and its length
DENSE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str)) + len(solution_str) / 100
"""


def assert_same_metrics(got: dict, want: dict, steps: list[int]) -> None:
    for step in steps:
        have, expected = comparable(got[step]), comparable(want[step])
        assert have.keys() == expected.keys() and len(expected) > 30
        for key, value in expected.items():
            assert abs(have[key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, have[key], value)


def test_grpo_at_sp_2_equals_sp_1(local_ray, tmp_path):
    """GRPO (no critic; the actor and its reference at sp = 2) against sp = 1, 3 steps, the task's own reward."""
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")
    grpo = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=3",
    ]
    runs = {}
    for name, extra in (("sp1", SP_1), ("sp2", [])):
        assert cli(["train", *args(files, tmp_path / name, "ulysses"), *grpo, *extra]) == 0
        runs[name] = records(tmp_path / name)
    assert sorted(runs["sp2"]) == sorted(runs["sp1"]) == [1, 2, 3]
    assert "critic/vf_loss" not in runs["sp2"][1] and runs["sp2"][3]["actor/kl_loss"] > 0  # the policy moved
    assert_same_metrics(runs["sp2"], runs["sp1"], [1, 2, 3])


def test_ppo_at_sp_2_equals_sp_1_and_its_checkpoint_resumes_at_sp_1(local_ray, tmp_path):
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")
    reward = tmp_path / "dense_reward.py"
    reward.write_text(DENSE_REWARD)

    # one optimizer step per training step: which rows share a mini-batch depends on how they split over the
    # data-parallel ranks (engine/update.py), 2 at sp = 1 and 1 at sp = 2
    whole_batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"]

    def run(run_dir, *extra) -> int:
        scoring = f"custom_reward_function.path={reward}"
        return cli(["train", *args(files, run_dir, "ulysses"), scoring, *whole_batch, *extra])

    split_rows, split_sequence = tmp_path / "sp1", tmp_path / "sp2"
    assert run(split_rows, *SP_1) == 0
    assert run(split_sequence) == 0
    sp1, sp2 = records(split_rows), records(split_sequence)
    assert sorted(sp1) == sorted(sp2) == [1, 2, 3, 4]
    assert all(sp2[step]["critic/vf_loss"] > 0 for step in sp2)  # the critic learns something
    assert_same_metrics(sp2, sp1, [1, 2, 3, 4])

    resumed = tmp_path / "resumed"
    checkpoint = f"trainer.resume_mode={split_sequence / 'global_step_2'}"
    assert run(resumed, *SP_1, checkpoint) == 0
    got = records(resumed)
    assert sorted(got) == [3, 4]
    assert_same_metrics(got, sp2, [3, 4])
