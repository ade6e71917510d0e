"""Which roles a config needs, and when the actor update supplies its own old log-probs."""

import pytest

from hybridflow.controller import Role
from hybridflow.trainer.setup.config import load_config
from hybridflow.trainer.setup.run_plan import make_run_plan, on_policy_update


@pytest.mark.parametrize(
    "overrides, roles",
    [
        ([], [Role.ActorRollout]),
        (["algorithm.adv_estimator=gae"], [Role.ActorRollout, Role.Critic]),
        (["actor_rollout_ref.actor.use_kl_loss=true"], [Role.ActorRollout, Role.RefPolicy]),
        (["algorithm.use_kl_in_reward=true"], [Role.ActorRollout, Role.RefPolicy]),
        (["teacher.model.path=tiny-llama"], [Role.ActorRollout, Role.Teacher]),
        (
            ["reward_model.enable=true", "reward_model.model.path=tiny-llama", "algorithm.adv_estimator=gae"],
            [Role.ActorRollout, Role.Critic, Role.RewardModel],
        ),
        (
            [
                "trainer.async_training.mode=one_step_off",
                "trainer.placement=group_colocate",
                "algorithm.rollout_correction.rollout_is=token",
            ],
            [Role.ActorRollout, Role.Rollout],
        ),
    ],
)
def test_needed_roles(overrides, roles):
    assert list(make_run_plan(load_config(overrides)).roles) == roles


def test_role_names_are_the_group_names():
    assert [str(role) for role in Role] == ["actor_rollout", "ref", "critic", "reward_model", "rollout", "teacher"]


@pytest.mark.parametrize(
    "overrides, on_policy",
    [
        ([], True),  # the defaults: one epoch, mini-batch = train batch (8 prompts), no KL in the reward
        (["actor_rollout_ref.actor.ppo_epochs=2"], False),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], False),
        (["algorithm.use_kl_in_reward=true"], False),  # the KL penalty needs old log-probs before the update
        (["actor_rollout_ref.actor.reuse_update_log_probs=false"], False),
    ],
)
def test_on_policy_update(overrides, on_policy):
    assert on_policy_update(load_config(overrides)) is on_policy
