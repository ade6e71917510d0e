"""Advantage estimators against hand-worked examples, called through the registry."""

import math

import numpy as np
import pytest
import torch
from algo_configs import advantage_config

from hybridflow.algorithms import get_adv_estimator

EPS = 1e-6  # AdvantageConfig.epsilon


def estimate(name, rewards, mask, index, values=None, baselines=None, **cfg):
    fn = get_adv_estimator(name)
    return fn(rewards, mask, np.array(index, dtype=object), advantage_config(**cfg), values, baselines)


def outcome_rewards(scores, lengths, length):
    """Outcome reward on each sequence's last response token; (B, T) rewards and mask."""
    rewards = torch.zeros(len(scores), length)
    mask = torch.zeros(len(scores), length)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1.0
        rewards[i, n - 1] = s
    return rewards, mask


# ---- gae --------------------------------------------------------------------------------


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = estimate("gae", rewards, mask, ["a", "b"], values=values, gamma=0.9, lam=0.8, gae_whiten=False)
    # row 0: δ2 = 1 - 0.7 = 0.3; δ1 = 0.9·0.7 - 0.6 = 0.03; δ0 = 0.9·0.6 - 0.5 = 0.04; γλ = 0.72
    # A2 = 0.3; A1 = 0.03 + 0.72·0.3 = 0.246; A0 = 0.04 + 0.72·0.246 = 0.21712
    # row 1: δ1 = 1 - 0.4 = 0.6; δ0 = 0.9·0.4 - 0.2 = 0.16; A0 = 0.16 + 0.72·0.6 = 0.592
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3], [0.592, 0.6, 0.0]])
    torch.testing.assert_close(adv, expected_adv)
    # returns = A + V on the mask
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0], [0.792, 1.0, 0.0]]))


def test_gae_whitening():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, _ = estimate("gae", rewards, mask, ["a", "b"], values=values, gamma=0.9, lam=0.8)
    raw = torch.tensor([0.21712, 0.246, 0.3, 0.592, 0.6])  # the five response tokens, from above
    expected = (raw - raw.mean()) / raw.std()  # torch.std is unbiased
    torch.testing.assert_close(adv[mask.bool()], expected, atol=1e-4, rtol=1e-4)
    assert adv[1, 2] == 0.0


def test_gae_skips_masked_tokens_inside_the_response():
    # token 1 is, e.g., a tool's output: not the policy's action, so it is skipped
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = estimate("gae", rewards, mask, ["a"], values=values, gae_whiten=False)
    # γ = λ = 1: δ2 = 1 - 0.7 = 0.3; δ0 = 0 + V2 - V0 = 0.2; A0 = 0.2 + 0.3 = 0.5 = return 1 - V0
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0]]))


# ---- outcome-reward estimators ----------------------------------------------------------


def test_grpo_by_hand():
    # groups: a = (1, 0, 2), b = (3) alone, c = (0.5, 0.5) equal
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 3.0, 0.5, 0.5], [2, 3, 1, 2, 3, 1], 3)
    adv, ret = estimate("grpo", rewards, mask, ["a", "a", "a", "b", "c", "c"])
    # group a: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 → (0, -1, 1) / (1 + ε)
    seq = torch.tensor([0.0, -1.0, 1.0, 0.0, 0.0, 0.0]) / (1.0 + EPS)
    torch.testing.assert_close(adv, seq[:, None] * mask)
    torch.testing.assert_close(ret, adv)


def test_grpo_std_and_dr_grpo():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], 1)
    index = ["q"] * 4
    # mean 0.25; unbiased std sqrt((0.75² + 3·0.25²) / 3) = sqrt(0.25) = 0.5
    adv, _ = estimate("grpo", rewards, mask, index)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS))
    # norm_adv_by_std_in_grpo=False (Dr.GRPO): only the mean is removed
    adv, _ = estimate("grpo", rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_score_is_the_reward_sum_over_the_mask():
    rewards = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 0.0]])  # 9.0 on a padding token
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, _ = estimate("grpo", rewards, mask, ["a", "a"], norm_adv_by_std_in_grpo=False)
    # scores 1 and 0, mean 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]))


def test_rloo_by_hand():
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 3.0], [1, 2, 2, 2], 2)
    adv, _ = estimate("rloo", rewards, mask, [0, 0, 0, 1])
    # A_i = s_i - mean of the others: 1 - (0+2)/2 = 0; 0 - (1+2)/2 = -1.5; 2 - (1+0)/2 = 1.5; alone: 0
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 0.0])[:, None] * mask)


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = estimate("reinforce_plus_plus", rewards, mask, ["a", "b"], gamma=0.5)
    # discounted returns: row 0 (0.25, 0.5, 1); row 1 (1, 0)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]]))
    # whitened over the 5 tokens: mean 2.75/5 = 0.55; squared deviations
    # 0.09 + 0.0025 + 0.2025 + 0.2025 + 0.3025 = 0.8; unbiased var 0.8/4 = 0.2
    expected = (torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 0.55]]) - 0.55) / math.sqrt(0.2)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 3.0], [2, 2, 1, 1], 2)
    adv, _ = estimate("reinforce_plus_plus_baseline", rewards, mask, ["a", "a", "a", "b"])
    # centred scores (0, -1, 1) and 0 (alone); on tokens: 0, 0, -1, -1, 1, 0
    # mean -1/6; Σx² - n·mean² = 3 - 6/36 = 17/6; unbiased var 17/30
    tokens = torch.tensor([[0.0, 0.0], [-1.0, -1.0], [1.0, 0.0], [0.0, 0.0]])
    expected = (tokens + 1 / 6) / math.sqrt(17 / 30) * mask
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    baselines = torch.tensor([0.7, 2.0])  # scores of the greedy responses
    adv, ret = estimate("remax", rewards, mask, ["a", "b"], baselines=baselines)
    # returns-to-go (1.5, 1.5, 1.0) and (2, 2); minus the baseline
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.8, 0.3], [0.0, 0.0, 0.0]]))


def test_opo_by_hand():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], [1, 2, 3], 3)
    adv, _ = estimate("opo", rewards, mask, ["a"] * 3)
    # baseline = Σ L·s / Σ L = (1·1 + 2·0 + 3·0) / 6 = 1/6
    torch.testing.assert_close(adv, torch.tensor([5 / 6, -1 / 6, -1 / 6])[:, None] * mask)


def test_gpg_by_hand():
    # group a = (1, 0) informative; b = (1, 1) and c = (0, 0) all-equal: M = 4 of B = 6
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1] * 6, 1)
    index = ["a", "a", "b", "b", "c", "c"]
    adv, _ = estimate("gpg", rewards, mask, index)
    # α = 6 / (6 - 4) = 3; group a: 3 · (±0.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.5, -1.5, 0.0, 0.0, 0.0, 0.0]))
    adv, _ = estimate("gpg", rewards, mask, index, gpg_norm_by_std=True)
    # F_norm = unbiased std of (1, 0) = sqrt(0.5)
    torch.testing.assert_close(adv[:2, 0], torch.tensor([1.5, -1.5]) / (math.sqrt(0.5) + EPS))


def test_pass_at_k_binary_closed_form():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 0.0], [1] * 4, 1)
    adv, _ = estimate("pass_at_k", rewards, mask, ["q"] * 4, pass_k=2)
    # N = 4, N_neg = 3, k = 2: R̄ = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; σ = sqrt(0.5·0.5) = 0.5
    # A_pos = (1 - 0.5) / 0.5 = 1; A_neg = (1 - 0.5 - C(2,1)/C(3,1)) / 0.5 = (0.5 - 2/3) / 0.5 = -1/3
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]), atol=1e-5, rtol=1e-5)


def test_pass_at_k_continuous_scores():
    rewards, mask = outcome_rewards([0.0, 1.0, 3.0], [1] * 3, 1)
    adv, _ = estimate("pass_at_k", rewards, mask, ["q"] * 3, pass_k=2)
    # pairs {0,1}→1, {0,3}→3, {1,3}→3: E[max] = 7/3, E[max²] = 19/3, var = 19/3 - 49/9 = 8/9
    # pairs containing 0: max 1, 3 → 2; containing 1: 1, 3 → 2; containing 3: 3, 3 → 3
    sigma = math.sqrt(8 / 9)
    expected = torch.tensor([2 - 7 / 3, 2 - 7 / 3, 3 - 7 / 3]) / sigma
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=1e-5)
    adv, _ = estimate("pass_at_k", rewards, mask, ["q"] * 3, pass_k=2, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1 / 3, -1 / 3, 2 / 3]), atol=1e-6, rtol=1e-6)


def test_pass_at_k_with_k_equal_group_size_is_zero():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], [1] * 3, 1)
    adv, _ = estimate("pass_at_k", rewards, mask, ["q"] * 3, pass_k=8)  # k clamped to 3
    # every 3-subset is the whole group: every sample sees the same max, advantage 0
    assert torch.equal(adv, torch.zeros_like(adv))


def test_grpo_passk_pushes_only_the_best_sample():
    rewards, mask = outcome_rewards([0.2, 1.0, 0.5, 0.0, 3.0, 3.0], [1] * 6, 1)
    adv, ret = estimate("grpo_passk", rewards, mask, ["a", "a", "a", "a", "b", "b"])
    # group a: best 1.0, second 0.5: gap 0.5; mean 0.425, squared deviations 0.050625 + 0.330625
    # + 0.005625 + 0.180625 = 0.5675, unbiased std = sqrt(0.5675 / 3). Group b: two equal bests: gap 0
    expected = torch.tensor([0.0, 0.5 / (math.sqrt(0.5675 / 3) + EPS), 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(adv, ret)
    adv, _ = estimate("grpo_passk", rewards, mask, ["a", "a", "a", "a", "b", "b"], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "opo", "gpg", "grpo_passk", "pass_at_k", "reinforce_plus_plus_baseline"]
)
def test_single_sample_and_equal_groups_give_zero(name):
    rewards, mask = outcome_rewards([0.3, 0.1, 0.1, 0.1], [2, 1, 2, 3], 3)
    adv, ret = estimate(name, rewards, mask, ["alone", "same", "same", "same"])
    assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.isfinite(ret).all()
