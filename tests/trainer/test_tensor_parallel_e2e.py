"""GRPO with the actor trained tensor-parallel (t=2) against data-parallel (t=1): tiny-llama, fp32, 2 ranks.

Generation is tg=1 in both (every rank generates its own prompts with the full generation copy), so
the samples are the same; the update splits each layer over the 2 ranks instead of the rows."""

import pytest
from test_train_e2e import assert_all_finite, short_run

FP32 = [
    "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
    "actor_rollout_ref.rollout.dtype=fp32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.save_freq=2",
]


def test_grpo_with_a_tensor_parallel_actor_matches_data_parallel(arithmetic_files, tmp_path):
    runs = {
        t: short_run(
            arithmetic_files, tmp_path / f"t{t}", *FP32, f"actor_rollout_ref.actor.tensor_model_parallel_size={t}"
        )
        for t in (1, 2)
    }
    assert_all_finite(runs[2])
    for tensor_parallel, data_parallel in zip(runs[2], runs[1]):
        assert tensor_parallel["response_length/mean"] == data_parallel["response_length/mean"]  # same samples
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/log_prob_diff_mean"):
            # another reduction order (the layer's halves summed instead of the rows'): a small tolerance
            assert tensor_parallel[key] == pytest.approx(data_parallel[key], rel=1e-4, abs=1e-6), key
    assert (tmp_path / "t2" / "global_step_2" / "actor").is_dir()  # the 2-D sharded state saves
