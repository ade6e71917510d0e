"""The preference losses against hand computations: DPO (with label smoothing), IPO, hinge, the Bradley-Terry
loss, their gradients, and the limits the issue names (β → 0, identical answers)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.preference import (
    PREFERENCE_LOSSES,
    PairOutput,
    PreferenceConfig,
    answer_log_probs,
    bradley_terry_loss,
    pair_halves,
    pair_metrics,
    preference_loss,
)
from hybridflow.validation import InvalidSetting


def config(loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0) -> PreferenceConfig:
    return PreferenceConfig(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# two pairs; h = (policy_chosen − reference_chosen) − (policy_rejected − reference_rejected) is 1.5 for both
POLICY_CHOSEN, POLICY_REJECTED = [-3.0, -10.0], [-5.0, -9.0]
REFERENCE_CHOSEN, REFERENCE_REJECTED = [-4.0, -10.5], [-4.5, -8.0]


def losses_of(cfg: PreferenceConfig, policy_chosen=POLICY_CHOSEN, policy_rejected=POLICY_REJECTED) -> PairOutput:
    return preference_loss(
        torch.tensor(policy_chosen, dtype=torch.float64),
        torch.tensor(policy_rejected, dtype=torch.float64),
        torch.tensor(REFERENCE_CHOSEN, dtype=torch.float64),
        torch.tensor(REFERENCE_REJECTED, dtype=torch.float64),
        cfg,
    )


def test_dpo_sigmoid_loss_and_rewards_by_hand():
    out = losses_of(config(beta=0.1), policy_chosen=[-3.0, -10.0], policy_rejected=[-5.0, -7.0])
    # pair 0: h = (−3 + 4) − (−5 + 4.5) = 1.5; pair 1: h = (−10 + 10.5) − (−7 + 8) = −0.5
    expected = [-log_sigmoid(0.1 * 1.5), -log_sigmoid(0.1 * -0.5)]
    assert out.losses.tolist() == pytest.approx(expected, abs=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, 0.05], abs=1e-12)
    assert out.rejected_rewards.tolist() == pytest.approx([-0.05, 0.1], abs=1e-12)
    metrics = pair_metrics(out)
    assert metrics["dpo/loss"] == pytest.approx(sum(expected) / 2, abs=1e-12)
    assert metrics["dpo/reward_accuracy"] == 0.5  # pair 1 prefers the rejected answer
    assert metrics["dpo/reward_margin"] == pytest.approx((0.15 + -0.05) / 2, abs=1e-12)
    assert metrics["dpo/chosen_reward"] == pytest.approx(0.075, abs=1e-12)
    assert metrics["dpo/rejected_reward"] == pytest.approx(0.025, abs=1e-12)


def test_label_smoothing_mixes_in_the_flipped_label():
    out = losses_of(config(beta=0.5, label_smoothing=0.2))
    h = 1.5  # pair 0
    assert float(out.losses[0]) == pytest.approx(-0.8 * log_sigmoid(0.5 * h) - 0.2 * log_sigmoid(-0.5 * h), abs=1e-12)


def test_ipo_and_hinge_by_hand():
    assert float(losses_of(config("ipo", beta=0.25)).losses[0]) == pytest.approx((1.5 - 2.0) ** 2, abs=1e-12)
    assert float(losses_of(config("hinge", beta=0.5)).losses[0]) == pytest.approx(1 - 0.5 * 1.5, abs=1e-12)
    assert float(losses_of(config("hinge", beta=1.0)).losses[0]) == 0.0  # margin past 1: nothing to learn
    assert PREFERENCE_LOSSES.get("ipo").length_normalized and not PREFERENCE_LOSSES.get("sigmoid").length_normalized


def test_the_gradient_of_dpo_is_beta_sigma_of_minus_beta_h():
    """d loss / d log π(y_w) = −β σ(−β h), d loss / d log π(y_l) = +β σ(−β h); the reference gets none."""
    beta = 0.3
    chosen = torch.tensor([-3.0, -10.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-5.0, -7.0], dtype=torch.float64, requires_grad=True)
    reference_chosen = torch.tensor(REFERENCE_CHOSEN, dtype=torch.float64, requires_grad=True)
    out = preference_loss(chosen, rejected, reference_chosen, torch.tensor(REFERENCE_REJECTED), config(beta=beta))
    out.losses.sum().backward()
    h = torch.tensor([1.5, -0.5], dtype=torch.float64)
    weight = beta * torch.sigmoid(-beta * h)
    assert torch.allclose(chosen.grad, -weight, atol=1e-12)
    assert torch.allclose(rejected.grad, weight, atol=1e-12)
    assert reference_chosen.grad is None


def test_beta_to_zero_gives_log_2_and_a_vanishing_gradient():
    chosen = torch.tensor([-3.0, -10.0], dtype=torch.float64, requires_grad=True)
    out = preference_loss(
        chosen,
        torch.tensor(POLICY_REJECTED, dtype=torch.float64),
        torch.tensor(REFERENCE_CHOSEN, dtype=torch.float64),
        torch.tensor(REFERENCE_REJECTED, dtype=torch.float64),
        config(beta=1e-8),
    )
    out.losses.sum().backward()
    assert out.losses.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-7)
    assert chosen.grad.abs().max() < 1e-8  # −β/2 per pair


def test_identical_answers_give_log_2_and_no_gradient_whatever_beta():
    for beta in (0.01, 0.1, 5.0):
        answer = torch.tensor([-4.0, -6.0], dtype=torch.float64, requires_grad=True)
        reference = torch.tensor([-3.0, -9.0], dtype=torch.float64)
        out = preference_loss(answer, answer, reference, reference, config(beta=beta))
        out.losses.sum().backward()
        assert out.losses.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-12)
        assert answer.grad.abs().max() == 0.0
        assert pair_metrics(out)["dpo/reward_accuracy"] == 0.0  # a tie is not a preferred answer


def test_answer_log_probs_sum_or_mean_over_the_mask():
    token_log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, float("nan"), -1.5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert answer_log_probs(token_log_probs, mask, False).tolist() == [-3.0, -2.0]
    assert answer_log_probs(token_log_probs, mask, True).tolist() == [-1.5, -1.0]


def test_pair_halves_take_alternate_rows_and_refuse_an_odd_batch():
    chosen, rejected = pair_halves(torch.arange(6))
    assert chosen.tolist() == [0, 2, 4] and rejected.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="come in pairs"):
        pair_halves(torch.arange(5))


def test_bradley_terry_loss_by_hand_with_and_without_margin():
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(
        [-log_sigmoid(1.5), -log_sigmoid(-2.0)], abs=1e-6
    )
    margin = torch.tensor([1.0, 0.0])
    assert bradley_terry_loss(chosen, rejected, margin).tolist() == pytest.approx(
        [-log_sigmoid(0.5), -log_sigmoid(-2.0)], abs=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"loss_type": "dpo"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
    ],
)
def test_bad_settings_name_their_field(kwargs, field):
    with pytest.raises(InvalidSetting) as caught:
        config(**kwargs)
    assert caught.value.field == field
