"""Whole GRPO and PPO runs (fp32) on 2 ranks: with the actor, its reference and (PPO, GAE) the critic split into 2
pipeline stages (1F1B, one data-parallel rank) every metric of each step equals the run with the rows split over 2
data-parallel ranks (pp = 1), up to float rounding; and the checkpoint of step 2 written at pp = 2 resumes at pp = 1 to
the metrics of steps 3 and 4. The kill -9 resume at pp = 2 is tests/trainer/test_kill_and_resume.py's "pipeline"
mode."""

import pytest
from test_kill_and_resume import MODES, args, records
from test_sequence_parallel_e2e import DENSE_REWARD, assert_same_metrics

from hybridflow.cli import main as cli
from hybridflow.data.tasks import write_task

pytestmark = pytest.mark.slow

PP_KEYS = (
    "actor_rollout_ref.actor.pipeline_model_parallel_size",
    "actor_rollout_ref.ref.pipeline_model_parallel_size",
    "critic.pipeline_model_parallel_size",
)
PP_1 = [f"{key}=1" for key in PP_KEYS]


def test_grpo_at_pp_2_equals_pp_1(local_ray, tmp_path):
    """GRPO (no critic; the actor and its reference at pp = 2) against pp = 1, 3 steps, the task's own reward."""
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")
    grpo = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=3",
    ]
    runs = {}
    for name, extra in (("pp1", PP_1), ("pp2", [])):
        assert cli(["train", *args(files, tmp_path / name, "pipeline"), *grpo, *extra]) == 0
        runs[name] = records(tmp_path / name)
    assert sorted(runs["pp2"]) == sorted(runs["pp1"]) == [1, 2, 3]
    assert "critic/vf_loss" not in runs["pp2"][1] and runs["pp2"][3]["actor/kl_loss"] > 0  # the policy moved
    assert_same_metrics(runs["pp2"], runs["pp1"], [1, 2, 3])


def test_ppo_at_pp_2_equals_pp_1_and_its_checkpoint_resumes_at_pp_1(local_ray, tmp_path):
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")
    reward = tmp_path / "dense_reward.py"
    reward.write_text(DENSE_REWARD)
    # one optimizer step per training step: which rows share a mini-batch depends on how they split over the
    # data-parallel ranks (engine/update.py), 2 at pp = 1 and 1 at pp = 2
    whole_batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"]

    def run(run_dir, *extra) -> int:
        scoring = f"custom_reward_function.path={reward}"
        return cli(["train", *args(files, run_dir, "pipeline"), scoring, *whole_batch, *extra])

    split_rows, split_layers = tmp_path / "pp1", tmp_path / "pp2"
    assert run(split_rows, *PP_1) == 0
    assert run(split_layers) == 0
    pp1, pp2 = records(split_rows), records(split_layers)
    assert sorted(pp1) == sorted(pp2) == [1, 2, 3, 4]
    assert all(pp2[step]["critic/vf_loss"] > 0 for step in pp2)  # the critic learns something
    assert_same_metrics(pp2, pp1, [1, 2, 3, 4])

    resumed = tmp_path / "resumed"
    checkpoint = f"trainer.resume_mode={split_layers / 'global_step_2'}"
    assert run(resumed, *PP_1, checkpoint) == 0
    after = records(resumed)
    assert sorted(after) == [3, 4]
    assert_same_metrics(after, pp1, [3, 4])


def test_the_pipeline_mode_splits_every_trained_and_scoring_role():
    assert set(PP_KEYS) <= {entry.partition("=")[0] for entry in MODES["pipeline"]}
