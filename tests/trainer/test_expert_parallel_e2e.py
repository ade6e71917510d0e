"""A whole PPO run whose actor (routing replay on) and critic (balancing loss on) are mixtures of experts split over 2
ranks (ep = 2) equals the same run with every expert on both ranks (ep = 1) for 4 steps, and its checkpoint of step 2
resumes at ep = 1 to the same steps 3 and 4 (tests/trainer/layout_runs.py). The actor's experts are gathered for
generation at every step, so the samples themselves would differ if the switch got them wrong."""

import pytest
from layout_runs import ppo_equals_data_parallel_and_resumes_there

pytestmark = pytest.mark.slow


def test_ppo_with_expert_parallel_actor_and_critic_equals_ep_1_and_resumes_there(local_ray, tmp_path):
    baseline = ["critic.expert_model_parallel_size=1", "actor_rollout_ref.actor.expert_model_parallel_size=1"]
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "experts", baseline)
