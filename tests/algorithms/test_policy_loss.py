"""Policy losses against hand-computed values and gradients; the clipped region is flat."""

import math

import torch
from algo_configs import policy_loss_config
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import LossAggregation, get_policy_loss

TOKEN_MEAN = LossAggregation("token-mean")


def run(name, ratios, advantages, mask=None, **cfg):
    """Loss with old log-prob 0, so the ratio is exp(log_prob); returns (loss, metrics, grad)."""
    log_prob = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([advantages], dtype=torch.float64)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = get_policy_loss(name)(
        torch.zeros_like(adv), log_prob, adv, mask, policy_loss_config(**cfg), TOKEN_MEAN
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.item(), metrics, grad[0]


def test_vanilla_by_hand():
    ratios = [1.5, 0.5, 1.1, 0.7, 5.0]
    advantages = [1.0, -1.0, 1.0, -1.0, -1.0]
    loss, metrics, grad = run("vanilla", ratios, advantages, clip_ratio=0.2, clip_ratio_c=3.0)
    # token 0: A>0, r=1.5 > 1.2 → -1.2 (clipped high)
    # token 1: A<0, r=0.5 < 0.8 → max(0.5, 0.8) = 0.8 (clipped low)
    # token 2: r=1.1 inside → -1.1
    # token 3: A<0, r=0.7 < 0.8 → 0.8 (clipped low)
    # token 4: A<0, r=5: max(5, 1.2) = 5, dual clip min(5, 3) = 3
    assert math.isclose(loss, (-1.2 + 0.8 - 1.1 + 0.8 + 3.0) / 5, rel_tol=1e-9)
    assert math.isclose(metrics["pg_clipfrac_high"].item(), 1 / 5, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_low"].item(), 2 / 5, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac"].item(), 3 / 5, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_lower"].item(), 1 / 5, rel_tol=1e-6)
    # ppo_kl = mean(log π_old - log π) = -log(1.5·0.5·1.1·0.7·5) / 5
    assert math.isclose(metrics["ppo_kl"].item(), -math.log(1.5 * 0.5 * 1.1 * 0.7 * 5.0) / 5, rel_tol=1e-6)
    # only token 2 has a gradient: d(-A·r)/d log π = -A·r = -1.1, over 5 tokens
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -1.1 / 5, 0.0, 0.0], dtype=torch.float64))


def test_vanilla_clip_higher_is_asymmetric():
    # DAPO: ε_low = 0.2, ε_high = 0.28
    loss, metrics, grad = run("vanilla", [1.25, 1.5, 0.75], [1.0, 1.0, -1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    # 1.25 < 1.28: unclipped, -1.25; 1.5 → -1.28; 0.75 < 0.8 with A<0 → 0.8
    assert math.isclose(loss, (-1.25 - 1.28 + 0.8) / 3, rel_tol=1e-9)
    assert math.isclose(metrics["pg_clipfrac_high"].item(), 1 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["pg_clipfrac_low"].item(), 1 / 3, rel_tol=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.25 / 3, 0.0, 0.0], dtype=torch.float64))


def test_vanilla_respects_the_mask():
    loss, _, grad = run("vanilla", [1.0, 1.0], [2.0, 100.0], mask=[1.0, 0.0])
    assert math.isclose(loss, -2.0)  # -A·r on the one real token
    torch.testing.assert_close(grad, torch.tensor([-2.0, 0.0], dtype=torch.float64))


def test_gspo_by_hand():
    # log-ratios (log 2, log 0.5): sequence mean 0, s = 1 → inside the clip range
    loss, _, grad = run("gspo", [2.0, 0.5], [1.0, 1.0])
    assert math.isclose(loss, -1.0, rel_tol=1e-9)
    # ∂/∂log π_t of -A·s_t = -A·s = -1 per token, over 2 tokens
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.5], dtype=torch.float64))
    # log-ratios (0.3, 0.5): s = e^0.4 ≈ 1.49 > 1.2 with A > 0 → clipped: -1.2, no gradient
    ratios = [math.exp(0.3), math.exp(0.5)]
    loss, metrics, grad = run("gspo", ratios, [1.0, 1.0])
    assert math.isclose(loss, -1.2, rel_tol=1e-9)
    assert torch.equal(grad, torch.zeros(2, dtype=torch.float64))
    assert metrics["pg_clipfrac_high"].item() == 1.0
    # with ε_high = 0.5 it is inside: loss -e^0.4, gradient -e^0.4 / 2 on each token
    loss, _, grad = run("gspo", ratios, [1.0, 1.0], clip_ratio_high=0.5)
    assert math.isclose(loss, -math.exp(0.4), rel_tol=1e-9)
    torch.testing.assert_close(grad, torch.full((2,), -math.exp(0.4) / 2, dtype=torch.float64))


def test_gpg_by_hand():
    loss, metrics, grad = run("gpg", [math.exp(-1.0), math.exp(-2.0)], [2.0, 1.0])
    # -A·log π = -(2)(-1) and -(1)(-2): (2 + 2) / 2 = 2; gradient -A / 2
    assert math.isclose(loss, 2.0, rel_tol=1e-9)
    torch.testing.assert_close(grad, torch.tensor([-1.0, -0.5], dtype=torch.float64))
    assert metrics["pg_clipfrac"].item() == 0.0


def test_cispo_by_hand():
    loss, metrics, grad = run("cispo", [1.5, 0.5], [1.0, 1.0], clip_ratio=0.2)
    # weights clip(r) = 1.2 and 0.8 (no gradient through them); loss -w·A·log π
    assert math.isclose(loss, -(1.2 * math.log(1.5) + 0.8 * math.log(0.5)) / 2, rel_tol=1e-9)
    # every token keeps a gradient, -w·A / 2, even where the ratio was clipped
    torch.testing.assert_close(grad, torch.tensor([-0.6, -0.4], dtype=torch.float64))
    assert metrics["pg_clipfrac_high"].item() == 0.5 and metrics["pg_clipfrac_low"].item() == 0.5


def test_every_loss_reports_the_same_metrics():
    keys = {"pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "pg_clipfrac_lower", "ppo_kl"}
    for name in ["vanilla", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"]:
        _, metrics, _ = run(name, [1.1, 0.9], [1.0, -1.0])
        assert keys <= set(metrics), name
        assert all(not torch.is_tensor(v) or not v.requires_grad for v in metrics.values())


@settings(derandomize=True, max_examples=30, deadline=None)
@given(
    adv=st.floats(0.01, 10.0),
    excess=st.floats(1e-3, 5.0),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    side=st.sampled_from(["high", "low", "dual"]),
)
def test_clipped_region_is_flat(adv, excess, eps_low, eps_high, side):
    c = 3.0
    if side == "high":  # A > 0 and r beyond 1 + ε_high: loss -A(1 + ε_high)
        ratio, a, expected = (1 + eps_high) * math.exp(excess), adv, -adv * (1 + eps_high)
    elif side == "low":  # A < 0 and r below 1 - ε_low: loss |A|(1 - ε_low)
        ratio, a, expected = (1 - eps_low) * math.exp(-excess), -adv, adv * (1 - eps_low)
    else:  # A < 0 and r beyond c: the dual clip holds the loss at |A|·c
        ratio, a, expected = c * math.exp(excess), -adv, adv * c
    cfg = dict(clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=c)
    loss, _, grad = run("vanilla", [ratio], [a], **cfg)
    assert math.isclose(loss, expected, rel_tol=1e-9)
    assert grad.item() == 0.0
    if side != "dual":  # GSPO with one token: the sequence ratio is the token ratio
        loss, _, grad = run("gspo", [ratio], [a], **cfg)
        assert math.isclose(loss, expected, rel_tol=1e-9)
        assert grad.item() == 0.0
