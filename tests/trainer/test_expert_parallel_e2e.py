"""A whole PPO run whose actor (routing replay on) and critic (balancing loss on) are mixtures of experts split over 2
ranks, by expert parallelism (ep = 2) or by tensor parallelism (t = 2, generating in groups of 2 that split the experts
too), equals the same run with every expert on both ranks (data parallelism) for 4 steps, and its checkpoint of step 2
resumes there to the same steps 3 and 4 (tests/trainer/layout_runs.py). The actor's experts are gathered for
generation at every step, so the samples themselves would differ if the switch got them wrong."""

import pytest
from layout_runs import ppo_equals_data_parallel_and_resumes_there

pytestmark = pytest.mark.slow


def test_ppo_with_expert_parallel_actor_and_critic_equals_ep_1_and_resumes_there(local_ray, tmp_path):
    baseline = ["critic.expert_model_parallel_size=1", "actor_rollout_ref.actor.expert_model_parallel_size=1"]
    ppo_equals_data_parallel_and_resumes_there(tmp_path, "experts", baseline)


@pytest.mark.parametrize("tg", [1, 2])
def test_ppo_with_tensor_parallel_actor_and_critic_equals_data_parallel_and_resumes_there(local_ray, tmp_path, tg):
    """t = 2: each rank holds half of every MoE layer's experts, and both train on every row. At tg = 1 each rank
    generates half of the rows (the switch gathers the experts whole on it, the bytes predicted), as 2 data-parallel
    ranks do; the balancing loss is off, since which rows share a micro-batch is the layout's. At tg = 2 the 2 ranks
    generate as one group, each with its half of the experts, and train as one process does, the balancing loss on."""
    tensor_parallel = [
        "actor_rollout_ref.actor.expert_model_parallel_size=1",
        "critic.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.tensor_model_parallel_size=2",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tg}",
        "critic.tensor_model_parallel_size=2",
    ]
    baseline = [
        "actor_rollout_ref.actor.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "critic.tensor_model_parallel_size=1",
    ]
    if tg == 1:
        tensor_parallel += ["actor_rollout_ref.actor.router_aux_loss_coef=0", "critic.router_aux_loss_coef=0"]
    else:
        baseline.append("trainer.n_workers_per_node=1")
    switch = ("switch/received_mb", "switch/predicted_mb", "switch/generation_weights_mb", "switch/training_params_mb")
    split = ppo_equals_data_parallel_and_resumes_there(tmp_path, "experts", baseline, tuple(tensor_parallel), switch)
    for step in split.values():
        assert step["switch/received_mb"] == pytest.approx(step["switch/predicted_mb"], rel=1e-9)
        assert (step["switch/received_mb"] > 0) == (tg == 1)
        assert (step.get("actor/router_aux_loss", 0) > 0) == (tg == 2)
