"""GRPO with a mixture-of-experts actor in the asynchronous modes: the actor's pool (2 ranks, experts split over both,
routing replay on) trains while the rollout's pool (2 ranks) generates, and every weight transfer gathers the split
experts and moves the bytes its plan predicts. One step off, with the rollout's experts split over its 2 ranks
(tg = 2), the run with ep = 2 equals the run with every expert on both actor ranks (ep = 1) metric for metric; fully
asynchronous, it trains batches generated one policy version earlier."""

import pytest
from layout_runs import assert_same_metrics, task_files
from test_kill_and_resume import records

from hybridflow.cli import main as cli

pytestmark = pytest.mark.slow


def run(tmp_path, name: str, mode: str, ep: int, tg: int = 1) -> dict[int, dict]:
    train, test = task_files(tmp_path)
    arguments = [
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "actor_rollout_ref.model.path=tiny-qwen3-moe",
        f"actor_rollout_ref.actor.expert_model_parallel_size={ep}",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tg}",
        f"trainer.async_training.mode={mode}",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=2",
        "trainer.total_training_steps=3",
        "trainer.total_epochs=2",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path / name}",
    ]
    assert cli(["train", *arguments]) == 0
    got = records(tmp_path / name)
    assert sorted(got) == [1, 2, 3]
    for record in got.values():
        assert record["transfer/mb"] == pytest.approx(record["transfer/predicted_mb"]) and record["transfer/mb"] > 0.1
        assert 0 <= record["router_replay/changed_update"] < 0.05
    # step 1 trains on the initial policy's samples, as generated: replayed, the trainer's log-probs are the rollout's
    # (later steps' samples come from the policy one version back, and differ by the update between)
    assert got[1]["rollout/log_prob_diff_max"] < 1e-4 < got[3]["rollout/log_prob_diff_max"]
    return got


def test_one_step_off_with_split_experts_equals_ep_1(local_ray, tmp_path):
    """The rollout's experts split too, over its 2 ranks (one generation group, tg = 2, each rank running half of
    them; the samples of one group of 2 differ from two groups' by their seeds, so both runs use it): each transfer
    sends each rollout rank its own experts, and with the rollout's routes replayed the trainer's log-probs equal the
    rollout's (``run``'s checks)."""
    split, whole = run(tmp_path, "ep2", "one_step_off", 2, tg=2), run(tmp_path, "ep1", "one_step_off", 1, tg=2)
    assert [split[step]["async/policy_version_lag"] for step in (1, 2)] == [0.0, 1.0]
    assert_same_metrics(split, whole, [1, 2, 3])


def test_fully_async_with_split_experts_trains_on_the_last_versions_samples(local_ray, tmp_path):
    got = run(tmp_path, "ep2", "fully_async", 2)
    assert got[3]["async/policy_version_lag"] >= 1.0
