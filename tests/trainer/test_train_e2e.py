"""Whole runs through real Ray worker groups of 2 ranks on tiny-llama, on one Ray cluster that every run of the
module finds started (tests/conftest.py: local_ray) and leaves as it found it."""

import json
import math
import time

import pytest
import ray

from hybridflow.controller import kept_placement_groups
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

STAGES_GRPO = ["gen", "reward", "old_log_prob", "adv", "update_actor", "step"]
STAGES_PPO = STAGES_GRPO + ["ref", "values", "update_critic"]


def short_run(arithmetic_files, tmp_path, *extra: str) -> list[dict]:
    train, test = arithmetic_files
    config = load_config(
        [
            f"data.train_files=[{train}]",
            f"data.val_files=[{test}]",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=6",
            "trainer.total_training_steps=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path}",
            *extra,
        ]
    )
    shared = ray.is_initialized()
    run(config)
    if shared:
        assert_cluster_left_as_found()
    run_dir = tmp_path
    assert (run_dir / "config.yaml").is_file()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_cluster_left_as_found() -> None:
    """A run on a Ray cluster it did not start gives back every placement group, and with them its workers' CPUs,
    except those of the worker processes the driver keeps for its next runs (the tests' session keeps them)."""
    kept = {group.id.hex() for group in kept_placement_groups()}
    placed = {key for key, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}
    assert placed == kept, (placed, kept)
    kept_cpus = sum(bundle.get("CPU", 0.0) for group in kept_placement_groups() for bundle in group.bundle_specs)
    free = ray.cluster_resources()["CPU"] - kept_cpus
    deadline = time.monotonic() + 10  # the cluster's resource view follows the removal within moments
    while ray.available_resources().get("CPU", 0.0) != free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0.0) == free


def assert_all_finite(records: list[dict]) -> None:
    for record in records:
        for key, value in record.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (record["step"], key, value)


@pytest.mark.smoke
def test_grpo_run_every_stage_and_metric_and_overlong_penalty(local_ray, arithmetic_files, tmp_path):
    """Every stage and metric of a GRPO run; the overlong penalty shapes its training rewards, not validation's."""
    factor = 0.5
    records = short_run(
        arithmetic_files,
        tmp_path,
        "trainer.total_training_steps=3",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.old_log_prob_source=auto",
        "actor_rollout_ref.rollout.log_prob_check_every=3",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=6",  # the whole budget (response_length=6): each token costs factor / 6
        f"reward.overlong_buffer.penalty_factor={factor}",
    )
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # validation before training, then three steps
    assert "val/arithmetic/score_mean" in records[0] and "val/score/mean" in records[3]
    assert_all_finite(records)
    for stage in STAGES_GRPO:
        assert records[1][f"timing_s/{stage}"] > 0, stage
    assert "timing_s/ref" not in records[1] and "critic/vf_loss" not in records[1]
    for key in ["timing_s/weight_sync", "timing_s/release_cache", "perf/max_memory_gb"]:
        assert key in records[1], key
    # auto: step 1 measures the generator/trainer mismatch (tiny in bf16) in a separate pass, step 2
    # reuses the generator's log-probs (no pass; the update's first forward still measures the gap),
    # step 3 (a multiple of log_prob_check_every) runs the pass again
    assert [r["rollout/used_rollout_log_probs"] for r in records[1:]] == [0.0, 1.0, 0.0]
    assert ["perf/mfu_log_prob" in r for r in records[1:]] == [True, False, True]
    assert all(r["rollout/log_prob_diff_mean"] < 0.02 for r in records[1:])

    assert "reward/overlong_penalty/mean" not in records[0]  # validation before training: unshaped
    for record in records[1:]:
        penalty = record["reward/overlong_penalty/mean"]
        assert penalty == pytest.approx(-factor * record["response_length/mean"] / 6, rel=1e-5)
        assert record["critic/score/mean"] == pytest.approx(record["reward/arithmetic/mean"] + penalty, abs=1e-6)


@pytest.mark.smoke
def test_ppo_run_with_critic_and_kl(local_ray, arithmetic_files, tmp_path):
    records = short_run(
        arithmetic_files,
        tmp_path,
        "algorithm.adv_estimator=gae",
        "critic.ppo_mini_batch_size=2",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    )
    assert_all_finite(records)
    step = records[1]
    for stage in STAGES_PPO:
        assert step[f"timing_s/{stage}"] > 0, stage
    for key in [
        "critic/vf_loss",
        "critic/vf_explained_var",
        "actor/kl_loss",
        "actor/reward_kl_penalty",
        "actor/entropy_loss",
        "critic/values/mean",
    ]:
        assert key in step, key


DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    return sum(c.isdigit() for c in text) / max(1, len(text))
"""


def digits_run(arithmetic_files, tmp_path, *extra: str) -> list[dict]:
    """10 GRPO steps of 8 prompts x 8 samples rewarded for digits (DIGITS_REWARD); its records, after checking that
    the score rose from under 0.1 by more than 0.5. ``extra``: the run's own overrides (its model, its backend)."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGITS_REWARD)
    train, _ = arithmetic_files
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "trainer.total_training_steps=10",
            "trainer.total_epochs=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path}",
            f"custom_reward_function.path={reward_file}",
            *extra,
        ]
    )
    run(config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scores = [record["critic/score/mean"] for record in records]
    assert len(scores) == 10
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.1 and last > first + 0.5, scores
    return records


@pytest.mark.slow
def test_grpo_learns_to_emit_digits(local_ray, arithmetic_files, tmp_path):
    """A random tiny model rarely writes digits (about 1% of characters); rewarded for them, it learns to."""
    digits_run(arithmetic_files, tmp_path)
