"""The estimator and policy-loss registries: names, extension, duplicates, unknowns, required inputs."""

import numpy as np
import pytest
import torch
from algo_configs import advantage_config, policy_loss_config

from hybridflow.algorithms import (
    LossAggregation,
    get_adv_estimator,
    get_policy_loss,
    list_adv_estimators,
    list_policy_losses,
    register_adv_estimator,
    register_policy_loss,
)

ESTIMATORS = [
    "gae",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "pass_at_k",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
LOSSES = ["cispo", "clip_cov", "gpg", "gspo", "kl_cov", "vanilla"]


def test_builtin_names():
    assert set(ESTIMATORS) <= set(list_adv_estimators())
    assert set(LOSSES) <= set(list_policy_losses())
    assert list_adv_estimators() == sorted(list_adv_estimators())


def test_unknown_names_list_the_known_ones_sorted():
    with pytest.raises(ValueError) as err:
        get_adv_estimator("ppo")
    assert ", ".join(list_adv_estimators()) in str(err.value)
    with pytest.raises(ValueError) as err:
        get_policy_loss("clip")
    assert ", ".join(list_policy_losses()) in str(err.value)


def test_duplicates_are_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda *args: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *args: None)


def test_requirements_are_exposed():
    assert get_adv_estimator("gae").needs_values and not get_adv_estimator("gae").needs_baseline
    assert get_adv_estimator("remax").needs_baseline and not get_adv_estimator("remax").needs_values
    assert not get_adv_estimator("grpo").needs_values


def test_missing_required_inputs_raise():
    rewards, mask, index = torch.zeros(2, 3), torch.ones(2, 3), np.array(["a", "a"], dtype=object)
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(rewards, mask, index, advantage_config())
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(rewards, mask, index, advantage_config())
    with pytest.raises(ValueError, match="index"):
        get_adv_estimator("grpo")(rewards, mask, index[:1], advantage_config())


def test_user_estimator_is_called_through_the_registry():
    @register_adv_estimator("test_constant_one")
    def constant_one(token_level_rewards, response_mask, index, config, values=None, reward_baselines=None):
        """Advantage 1 on every response token."""
        return response_mask.clone(), response_mask.clone()

    est = get_adv_estimator("test_constant_one")
    assert est is constant_one and "test_constant_one" in list_adv_estimators()
    assert est.__doc__ == "Advantage 1 on every response token."
    mask = torch.tensor([[1.0, 0.0]])
    adv, _ = est(torch.zeros(1, 2), mask, np.array([0]), advantage_config())
    assert torch.equal(adv, mask)


def test_user_policy_loss_is_called_through_the_registry():
    @register_policy_loss("test_zero_loss")
    def zero_loss(old_log_prob, log_prob, advantages, response_mask, config, loss_agg):
        return (log_prob * 0).sum(), {}

    loss, _ = get_policy_loss("test_zero_loss")(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        policy_loss_config(),
        LossAggregation(),
    )
    assert loss.item() == 0.0


def test_estimators_do_not_track_gradients():
    values = torch.zeros(1, 2, requires_grad=True)
    adv, ret = get_adv_estimator("gae")(
        torch.ones(1, 2), torch.ones(1, 2), np.array([0]), advantage_config(), values=values
    )
    assert not adv.requires_grad and not ret.requires_grad


def test_config_validation():
    with pytest.raises(ValueError):
        advantage_config(pass_k=0)
    with pytest.raises(ValueError):
        advantage_config(lam=1.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss_config(clip_ratio_c=1.0)
    assert policy_loss_config(clip_ratio=0.1, clip_ratio_high=0.28).clip_bounds() == (0.1, 0.28)


def test_group_ids_may_be_strings_ints_or_a_tensor():
    rewards = torch.tensor([[1.0], [0.0], [5.0]])
    mask = torch.ones(3, 1)
    grpo = get_adv_estimator("grpo")
    cfg = advantage_config(norm_adv_by_std_in_grpo=False)
    # samples 0 and 1 share a group (mean 0.5); sample 2 is alone (advantage 0)
    expected = torch.tensor([[0.5], [-0.5], [0.0]])
    for index in [np.array(["u", "u", "v"], dtype=object), np.array([7, 7, 8]), torch.tensor([7, 7, 8])]:
        adv, _ = grpo(rewards, mask, index, cfg)
        torch.testing.assert_close(adv, expected)
