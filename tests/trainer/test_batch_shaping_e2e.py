"""Whole runs (2 ranks, tiny-llama) of what the driver does to a batch before the updates: DAPO's
dynamic sampling, the rollout correction (trainer's old log-probs, and the bypass mode), and
masking truncated responses out of the loss."""

import json

import pytest
from test_train_e2e import assert_all_finite, short_run

from hybridflow.trainer.services.checkpoint_check import read_trainer_state

pytestmark = pytest.mark.slow

# informative for prompts with an even answer (two different responses score differently), and
# equal (0) for the rest: those groups are dropped by dynamic sampling
HALF_INFORMATIVE_REWARD = """
import zlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        return 0.0
    return zlib.crc32(solution_str.encode()) % 1000 / 1000
"""

FP32 = ["actor_rollout_ref.actor.fsdp.param_dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"]


def test_dynamic_sampling_refills_the_batch_with_informative_groups(local_ray, arithmetic_files, tmp_path):
    reward_file = tmp_path / "half.py"
    reward_file.write_text(HALF_INFORMATIVE_REWARD)
    records = short_run(
        arithmetic_files,
        tmp_path / "run",
        f"custom_reward_function.path={reward_file}",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=3",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
    )
    assert_all_finite(records)
    batch_groups = 4  # data.train_batch_size in short_run
    total_rounds = 0
    for record in records:
        rounds = record["dynamic_sampling/gen_rounds"]
        informative = record["dynamic_sampling/informative_groups"]
        assert 1 <= rounds <= 3
        assert informative + record["dynamic_sampling/dropped_groups"] == rounds * batch_groups
        assert record["dynamic_sampling/filler_groups"] == max(0, batch_groups - informative)
        assert rounds == 3 or informative >= batch_groups  # it stops early only once the batch is full
        total_rounds += rounds
    assert any(r["dynamic_sampling/gen_rounds"] > 1 for r in records)  # about half the groups are dropped
    # every round drew its own prompts from the loader: the checkpoint's position counts them all
    state = read_trainer_state(tmp_path / "run" / "global_step_2")
    assert state["data_loader"]["position"] == total_rounds


def test_rollout_correction_weights_and_rejection_reach_the_loss(local_ray, arithmetic_files, tmp_path):
    """fp32 trainer and generator agree (ρ ≈ 1): nothing leaves the band [0.5, 2], and masked importance
    weights with a cap of 0.5 zero every token's weight, so the policy loss and its gradient are 0."""
    records = short_run(
        arithmetic_files,
        tmp_path,
        *FP32,
        "actor_rollout_ref.rollout.name=native",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_mode=mask",
        "algorithm.rollout_correction.rollout_is_threshold=0.5",
        "algorithm.rollout_correction.rollout_rs=geometric",
        "trainer.val_before_train=false",
    )
    assert_all_finite(records)
    for record in records:
        assert "perf/mfu_log_prob" in record  # the correction needs the old log-probs before the update
        assert record["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-3)
        assert record["rollout_corr/ess_token"] == pytest.approx(1.0, abs=1e-3)
        assert record["rollout_corr/rejected_token_fraction"] == 0.0
        assert record["rollout_corr/is_clipped_fraction"] == 1.0
        assert record["rollout_corr/is_weight_max"] == 0.0
        assert record["actor/pg_loss"] == 0.0
        assert record["actor/grad_norm"] == 0.0


def test_bypass_mode_reports_the_mismatch_and_masks_truncated_responses(local_ray, arithmetic_files, tmp_path):
    """old_log_prob_source=rollout: no separate old-log-prob pass; the update's first forward is the
    trainer's view for the rollout_corr diagnostics. Truncated responses leave the loss."""
    records = short_run(
        arithmetic_files,
        tmp_path,
        *FP32,
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.old_log_prob_source=rollout",
        "algorithm.mask_truncated_responses=true",
        "trainer.val_before_train=false",
    )
    assert_all_finite(records)
    for record in records:
        assert "perf/mfu_log_prob" not in record and record["rollout/used_rollout_log_probs"] == 1.0
        assert record["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-3)
        assert record["rollout_corr/training_ppl"] == pytest.approx(record["rollout_corr/rollout_ppl"], rel=1e-3)
        assert record["rollout/log_prob_diff_mean"] < 1e-3
        # a random tiny model rarely stops within 6 tokens: the truncated share is the clipped share
        assert record["response/masked_truncated_ratio"] == pytest.approx(record["response_length/clip_ratio"])
        if record["response/masked_truncated_ratio"] == 1.0:
            assert record["actor/pg_loss"] == 0.0 and record["actor/grad_norm"] == 0.0
    (tmp_path / "metrics.jsonl").read_text()  # the run's log is complete
    assert len([json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]) == 2
