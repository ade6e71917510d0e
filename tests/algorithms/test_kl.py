"""KL estimators, straight-through gradients, controllers, and the two uses of KL."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import (
    KL_CONTROLLERS,
    KL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.validation import InvalidSetting

LN2 = math.log(2.0)
# δ = log π - log π_ref = (-ln 2, +ln 2)
LOG_PROB = torch.tensor([[0.0, LN2]], dtype=torch.float64)
REF = torch.tensor([[LN2, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "names, expected",
    [
        (["kl", "k1"], [-LN2, LN2]),
        (["abs"], [LN2, LN2]),
        (["mse", "k2"], [0.5 * LN2**2, 0.5 * LN2**2]),
        # e^{-δ} - 1 + δ: 2 - 1 - ln 2 and 0.5 - 1 + ln 2
        (["low_var_kl", "k3"], [1 - LN2, -0.5 + LN2]),
    ],
)
def test_estimators_by_hand(names, expected):
    for name in names:
        for suffix in ["", "+"]:  # the straight-through value is the named estimator's
            value = kl_penalty(LOG_PROB, REF, name + suffix)
            torch.testing.assert_close(value, torch.tensor([expected], dtype=torch.float64))


def test_k3_is_clamped():
    log_prob = torch.tensor([[-100.0, 100.0, -1e4]])
    value = kl_penalty(log_prob, torch.zeros_like(log_prob), "low_var_kl")
    # δ = -100: e^{100} clamped via δ → -20, then the result to 10; δ = 100: e^{-20} + 19 → 10
    torch.testing.assert_close(value, torch.tensor([[10.0, 10.0, 10.0]]))


@settings(derandomize=True, max_examples=20, deadline=None)
@given(deltas=st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=6), base=st.sampled_from(["k1", "abs", "k3"]))
def test_straight_through_variants_have_the_k2_gradient(deltas, base):
    delta = torch.tensor([deltas], dtype=torch.float64)
    log_prob = delta.clone().requires_grad_(True)
    kl_penalty(log_prob, torch.zeros_like(delta), base + "+").sum().backward()
    # d(½δ²)/d log π = δ, whatever the estimator's own value
    torch.testing.assert_close(log_prob.grad, delta)


def test_plain_estimators_keep_their_own_gradient():
    log_prob = LOG_PROB.clone().requires_grad_(True)
    kl_penalty(log_prob, REF, "k1").sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.ones_like(LOG_PROB))  # dδ/dlog π = 1


def test_unknown_type_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        kl_penalty(LOG_PROB, REF, "k4")
    for name in ["k1", "k3+", "low_var_kl", "mse"]:
        assert name in str(err.value) and name in KL_TYPES


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 9/6 - 1 = 0.5, clipped to 0.2
    assert math.isclose(ctrl.value, 0.1 * (1 + 0.2 * 256 / 10000))
    ctrl.update(current_kl=6.6, n_steps=100)  # error 0.1, inside the clip
    assert math.isclose(ctrl.value, 0.1 * (1 + 0.2 * 256 / 10000) * (1 + 0.1 * 100 / 10000))
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=256)
    assert fixed.value == 0.05


def test_make_kl_controller():
    fixed = KLControlConfig(type="fixed", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(make_kl_controller(fixed), FixedKLController)
    ctrl = make_kl_controller(dataclasses.replace(fixed, type="adaptive"))
    assert isinstance(ctrl, AdaptiveKLController) and (ctrl.value, ctrl.target, ctrl.horizon) == (0.1, 6.0, 10000)
    assert sorted(KL_CONTROLLERS) == ["adaptive", "fixed"]


@pytest.mark.parametrize(
    "changes, field", [({"type": "linear"}, "type"), ({"target_kl": 0.0}, "target_kl"), ({"horizon": 0}, "horizon")]
)
def test_kl_control_config_names_the_bad_field(changes, field):
    values = {"type": "adaptive", "kl_coef": 0.1, "target_kl": 6.0, "horizon": 10000} | changes
    with pytest.raises(InvalidSetting) as caught:
        KLControlConfig(**values)
    assert caught.value.field == field


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    log_prob = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.4, 5.0]])  # 5.0 sits on padding
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.05, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, log_prob, ref, mask, ctrl, "k1")
    # β = 0.5: r = score - 0.5·δ on the mask
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 2.2, 0.0]]))
    # mean token KL per sequence: 0.2 and 0.0 → batch mean 0.1
    assert math.isclose(metrics["actor/reward_kl_penalty"], 0.1, rel_tol=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # controller: error 0.1/0.05 - 1 = 1 → 0.2; β = 0.5·(1 + 0.2·2/100)
    assert math.isclose(ctrl.value, 0.5 * (1 + 0.2 * 2 / 100), rel_tol=1e-6)


def test_kl_loss_by_hand():
    log_prob = LOG_PROB.clone().requires_grad_(True)
    loss = compute_kl_loss(log_prob, REF, torch.ones_like(REF), "low_var_kl", "token-mean")
    # mean of (1 - ln 2, -0.5 + ln 2) = 0.25
    assert math.isclose(loss.item(), 0.25, rel_tol=1e-9)
    loss.backward()
    # d/dδ (e^{-δ} - 1 + δ) = 1 - e^{-δ}: δ = -ln 2 → -1; δ = ln 2 → 0.5; over 2 tokens
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.5, 0.25]], dtype=torch.float64))
