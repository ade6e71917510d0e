"""A whole PPO run whose critic is a mixture of experts split over 2 ranks (ep = 2), its balancing loss on, equals
the same run with every expert on both ranks (ep = 1) for 4 steps, and its checkpoint of step 2 resumes at ep = 1
to the same steps 3 and 4 (tests/trainer/layout_runs.py)."""

import pytest
from layout_runs import ppo_equals_data_parallel_and_resumes_there

pytestmark = pytest.mark.slow


def test_ppo_with_an_expert_parallel_critic_equals_ep_1_and_resumes_there(local_ray, tmp_path):
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "experts", ["critic.expert_model_parallel_size=1"])
