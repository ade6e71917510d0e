"""Whole GRPO and PPO runs (fp32, one optimizer step per step) on 2 ranks: with the actor, its reference and (PPO, GAE)
the critic under Ulysses (sp = 2, one data-parallel rank) every metric of each step equals the run with the rows
split over 2 data-parallel ranks (sp = 1), up to float rounding; and the checkpoint of step 2 written at sp = 2
resumes at sp = 1 to the metrics of steps 3 and 4. The kill -9 resume at sp = 2 is
tests/trainer/test_kill_and_resume.py's "ulysses" mode."""

import pytest
from layout_runs import grpo_equals_data_parallel, ppo_equals_data_parallel_and_resumes_there

pytestmark = pytest.mark.slow

SP_KEYS = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size",
)
SP_1 = [f"{key}=1" for key in SP_KEYS]


def test_grpo_at_sp_2_equals_sp_1(local_ray, tmp_path):
    grpo_equals_data_parallel(tmp_path, "ulysses", SP_1)


def test_ppo_at_sp_2_equals_sp_1_and_its_checkpoint_resumes_at_sp_1(local_ray, tmp_path):
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "ulysses", SP_1)


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_a_mixture_s_replayed_routes_split_with_its_tokens_at_sp_2(local_ray, tmp_path, mode):
    """Tiny Qwen3-MoE with routing replay: under Ulysses each rank routes its slice of every micro-batch's tokens
    through their recorded experts, and every metric equals the data-parallel run's. R3 replays the rollout's routes,
    so the trainer's log-probs equal the rollout's as at sp = 1; R2 records the old-log-prob pass's (each rank its
    slice, gathered) and the update replays them, changing none (one optimizer step a batch: the same weights)."""
    moe = (
        "actor_rollout_ref.model.path=tiny-qwen3-moe",
        f"actor_rollout_ref.actor.router_replay.mode={mode}",
        "actor_rollout_ref.actor.router_aux_loss_coef=0",  # the balancing loss needs a micro-batch's every token
        "actor_rollout_ref.actor.reuse_update_log_probs=false",  # R2's pass; R3 replays the rollout's routes there too
    )
    runs = grpo_equals_data_parallel(tmp_path, "ulysses", SP_1, both=moe)
    for record in runs["split"].values():
        bound = 1e-6 if mode == "R2" else 0.05
        assert 0 <= record["router_replay/changed_update"] < bound
        if mode == "R3":
            assert record["rollout/log_prob_diff_max"] < 1e-4 and record["router_replay/changed_log_prob"] < 0.05
