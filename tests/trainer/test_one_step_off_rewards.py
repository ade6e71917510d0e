"""One step off with the rewards that are computed while the next batch is generated: dynamic sampling (its
extra generation rounds run in the background, drawing prompts from the loader) and a reward model on a pool
of its own (tiny-llama, one rank per pool)."""

import json

import pytest
from test_batch_shaping_e2e import HALF_INFORMATIVE_REWARD
from test_one_step_off_e2e import overrides, records
from test_train_e2e import assert_all_finite

from hybridflow.trainer.commands import train as train_main
from hybridflow.trainer.loop.generate_ahead import PENDING_BATCH
from hybridflow.trainer.services.checkpoint_check import read_trainer_state
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

ONE_STEP_OFF = ["trainer.async_training.mode=one_step_off", "trainer.placement=group_colocate"]
ZERO_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


def run_three_steps(arithmetic_files, tmp_path, reward_source: str, *extra: str) -> dict[int, dict]:
    """A one-step-off run of 3 steps with the reward ``reward_source`` defines; its records by step."""
    reward = tmp_path / "reward_fn.py"
    reward.write_text(reward_source)
    settings = [f"custom_reward_function.path={reward}", "trainer.total_training_steps=3", *extra]
    train_main.run(load_config(overrides(arithmetic_files, tmp_path, *ONE_STEP_OFF, *settings)))
    return records(tmp_path)


def test_dynamic_sampling_generates_its_rounds_ahead_and_the_checkpoint_counts_them(
    local_ray, arithmetic_files, tmp_path
):
    steps = run_three_steps(
        arithmetic_files,
        tmp_path,
        HALF_INFORMATIVE_REWARD,
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=3",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
    )
    assert sorted(steps) == [1, 2, 3]
    assert_all_finite(steps.values())
    groups = 4  # data.train_batch_size
    for record in steps.values():
        rounds, informative = record["dynamic_sampling/gen_rounds"], record["dynamic_sampling/informative_groups"]
        assert 1 <= rounds <= 3
        assert informative + record["dynamic_sampling/dropped_groups"] == rounds * groups
        assert rounds == 3 or informative >= groups  # it stops early only once the batch is full
    assert any(r["dynamic_sampling/gen_rounds"] > 1 for r in steps.values())
    assert [r["async/policy_version_lag"] for r in steps.values()] == [0, 1, 1]
    # the checkpoint after step 2 holds the batch of step 3, generated with all its rounds: the loader's
    # position counts the prompts of steps 1, 2 and 3, so a resumed run draws none of them again
    checkpoint = tmp_path / "run" / "global_step_2"
    assert (checkpoint / PENDING_BATCH).is_file()
    rounds = [steps[k]["dynamic_sampling/gen_rounds"] for k in (1, 2, 3)]
    assert read_trainer_state(checkpoint)["data_loader"]["position"] == sum(rounds)


def test_a_reward_model_on_its_own_pool_gives_the_rewards(local_ray, arithmetic_files, tmp_path, reward_model_dir):
    steps = run_three_steps(
        arithmetic_files,
        tmp_path,
        ZERO_REWARD,  # 0 for every sample: the rewards are the reward model's
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model_dir}",
        "trainer.val_before_train=false",
    )
    assert_all_finite(steps.values())
    for record in steps.values():
        assert record["critic/score/max"] > record["critic/score/min"]  # the reward model's scores differ
    spans = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    scored = {s["step"] for s in spans if (s["lane"], s["stage"]) == ("critic", "rm")}  # its pool: "critic"
    assert scored >= {1, 2, 3}
