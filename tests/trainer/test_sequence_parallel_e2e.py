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
