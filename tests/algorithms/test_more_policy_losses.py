"""geo_mean (GMPO), sapo, dro, dppo_tv and dppo_kl against values and gradients worked out by hand."""

import math

import pytest
import torch
from algo_configs import policy_loss_config

from hybridflow.algorithms import LossAggregation, get_policy_loss
from hybridflow.algorithms.dppo_losses import binary_kl

TOKEN_MEAN = LossAggregation("token-mean")
D = torch.float64


def loss_and_grad(name, old_log_prob, log_prob, advantages, mask, agg=TOKEN_MEAN, **cfg):
    log_prob = torch.tensor(log_prob, dtype=D).requires_grad_(True)
    loss, metrics = get_policy_loss(name)(
        torch.tensor(old_log_prob, dtype=D),
        log_prob,
        torch.tensor(advantages, dtype=D),
        torch.tensor(mask, dtype=D),
        policy_loss_config(**cfg),
        agg,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.item(), metrics, grad


# ---- geo_mean -------------------------------------------------------------------------------
# log r: row 0 (A = +1) [0.1, 0.3, -0.5]; row 1 (A = -2) [0.4, -0.1, padding]; ε = 0.2 in log space.
# Row 0, A > 0 keeps min(ℓ, clip ℓ): [0.1, 0.2, -0.5] -> mean -0.2/3, R0 = e^(-0.2/3), loss0 = -R0.
# Row 1, A < 0 keeps max(ℓ, clip ℓ): [0.4, -0.1] -> mean 0.15, R1 = e^0.15, loss1 = +2 R1.
GEO_OLD = [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
GEO_NEW = [[-0.9, -0.7, -1.5], [-1.6, -2.1, 7.0]]
GEO_ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
GEO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
R0, R1 = math.exp(-0.2 / 3), math.exp(0.15)


def test_geo_mean_by_hand():
    loss, metrics, grad = loss_and_grad("geo_mean", GEO_OLD, GEO_NEW, GEO_ADV, GEO_MASK, clip_ratio=0.2)
    assert loss == pytest.approx((-R0 + 2 * R1) / 2, rel=1e-9)
    # ∂/∂ℓ_t: -Ā·R·(1/n)·[ℓ̂_t follows ℓ_t], over 2 responses; the clipped token 0.3 (row 0) has none
    expected = torch.tensor([[-R0 / 6, 0.0, -R0 / 6], [R1 / 2, R1 / 2, 0.0]], dtype=D)
    torch.testing.assert_close(grad, expected)
    # clipped: 0.3 and -0.5 (A > 0), 0.4 (A < 0), out of 5 tokens
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(1 / 5)


def test_geo_mean_micro_batches_sum_to_the_whole():
    whole = LossAggregation.for_minibatch("token-mean", torch.tensor(GEO_MASK))
    full, _, _ = loss_and_grad("geo_mean", GEO_OLD, GEO_NEW, GEO_ADV, GEO_MASK, clip_ratio=0.2)
    halves = [
        loss_and_grad("geo_mean", [GEO_OLD[i]], [GEO_NEW[i]], [GEO_ADV[i]], [GEO_MASK[i]], agg=whole, clip_ratio=0.2)[0]
        for i in range(2)
    ]
    assert sum(halves) == pytest.approx(full, rel=1e-12)


def test_geo_mean_weights_each_response_by_the_geometric_mean_of_its_token_weights():
    weights = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 123.0]], dtype=D)  # geometric means 1 and 2
    agg = TOKEN_MEAN.weighted(weights)
    loss, _, _ = loss_and_grad("geo_mean", GEO_OLD, GEO_NEW, GEO_ADV, GEO_MASK, agg=agg, clip_ratio=0.2)
    assert loss == pytest.approx((-R0 * 1.0 + 2 * R1 * 2.0) / 2, rel=1e-9)


# ---- sapo -----------------------------------------------------------------------------------
def test_sapo_by_hand():
    # token 0: A = +1, r = 1 -> f = σ(0)·4/τ_pos = 2 (τ_pos = 1): L = -2
    # token 1: A = -1, r = 1.5 -> f = σ(1.05·0.5)·4/1.05: L = +f
    f1 = 1 / (1 + math.exp(-1.05 * 0.5)) * 4 / 1.05
    loss, metrics, grad = loss_and_grad(
        "sapo", [[0.0, 0.0]], [[0.0, math.log(1.5)]], [[1.0, -1.0]], [[1.0, 1.0]], tau_pos=1.0, tau_neg=1.05
    )
    assert loss == pytest.approx((-2.0 + f1) / 2, rel=1e-9)
    # ∂L/∂log π = -A · 4σ'(τ(r-1)) · r; σ'(0) = 1/4, so token 0 gets -1 (the plain policy gradient)
    s = 1 / (1 + math.exp(-1.05 * 0.5))
    torch.testing.assert_close(grad, torch.tensor([[-1.0 / 2, 4 * s * (1 - s) * 1.5 / 2]], dtype=D))
    assert metrics["pg_clipfrac"].item() == 0.0


def test_sapo_equals_the_vanilla_gradient_on_policy():
    args = ([[0.0, 0.0, 0.0]], [[-1.0, -2.0, -0.5]], [[1.5, -0.7, 0.2]], [[1.0, 1.0, 1.0]])
    _, _, sapo = loss_and_grad("sapo", [[-1.0, -2.0, -0.5]], *args[1:], tau_pos=3.0, tau_neg=7.0)
    _, _, vanilla = loss_and_grad("vanilla", [[-1.0, -2.0, -0.5]], *args[1:])
    torch.testing.assert_close(sapo, vanilla)


# ---- dro ------------------------------------------------------------------------------------
def test_dro_by_hand():
    # L = -(A·log π - β/2·(log π - log π_old)²), β = 0.1; tokens (A, log π_old, log π): (2, -1, -0.5), (-1, -2, -3)
    loss, _, grad = loss_and_grad("dro", [[-1.0, -2.0]], [[-0.5, -3.0]], [[2.0, -1.0]], [[1.0, 1.0]], dro_beta=0.1)
    per_token = [-(2 * -0.5 - 0.05 * 0.25), -(-1 * -3.0 - 0.05 * 1.0)]
    assert loss == pytest.approx(sum(per_token) / 2, rel=1e-9)
    # ∂L/∂log π = -A + β·log r: -2 + 0.1·0.5 and 1 + 0.1·(-1), over 2 tokens
    torch.testing.assert_close(grad, torch.tensor([[(-2 + 0.05) / 2, (1 - 0.1) / 2]], dtype=D))


# ---- dppo -----------------------------------------------------------------------------------
# p_old, p and A per token; δ = 0.2 (both sides), C = 3
DPPO_OLD_P = [0.5, 0.5, 0.5, 0.5, 0.1]
DPPO_NEW_P = [0.6, 0.8, 0.2, 0.45, 0.5]
DPPO_ADV = [1.0, 1.0, -1.0, -1.0, -1.0]


def dppo(name, **cfg):
    old = [[math.log(p) for p in DPPO_OLD_P]]
    new = [[math.log(p) for p in DPPO_NEW_P]]
    return loss_and_grad(name, old, new, [DPPO_ADV], [[1.0] * 5], clip_ratio=0.2, clip_ratio_c=3.0, **cfg)


def test_dppo_tv_by_hand():
    loss, metrics, grad = dppo("dppo_tv")
    # p - p_old: +0.1 (A>0, ≤ 0.2: in), +0.3 (A>0: out), -0.3 (A<0, < -0.2: out), -0.05 (in), +0.4 (A<0: in)
    valid = [1.0, 0.0, 0.0, 1.0, 1.0]
    weights = [1.2, 1.6, 0.4, 0.9, 3.0]  # r = p / p_old, the last (5.0) truncated at C = 3
    per_token = [-a * w * math.log(p) * v for a, w, p, v in zip(DPPO_ADV, weights, DPPO_NEW_P, valid)]
    assert loss == pytest.approx(sum(per_token) / 5, rel=1e-9)
    # the weight and the mask are constants (sg): ∂L/∂log π = -A·w·valid / N; a weight carrying its
    # gradient would add -A·w·log π·valid / N to each token
    expected = [-a * w * v / 5 for a, w, v in zip(DPPO_ADV, weights, valid)]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=D))
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)  # the truncated weight


def test_dppo_kl_by_hand():
    loss, metrics, grad = dppo("dppo_kl")
    kl = [binary_kl(torch.tensor(o), torch.tensor(p)).item() for o, p in zip(DPPO_OLD_P, DPPO_NEW_P)]
    # by hand: KL(0.5 ‖ 0.6) = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) ≈ 0.0204
    assert kl[0] == pytest.approx(0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4), abs=1e-7)
    # in the region: KL ≤ 0.2, or the token moved against its advantage (A<0 and p ≥ p_old: the last one)
    valid = [float(kl[0] <= 0.2), float(kl[1] <= 0.2), float(kl[2] <= 0.2), float(kl[3] <= 0.2), 1.0]
    assert valid == [1.0, 0.0, 0.0, 1.0, 1.0]  # KL(0.5 ‖ 0.8) ≈ 0.22 and KL(0.5 ‖ 0.2) ≈ 0.22 are outside
    weights = [1.2, 1.6, 0.4, 0.9, 3.0]
    expected = [-a * w * v / 5 for a, w, v in zip(DPPO_ADV, weights, valid)]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=D))
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("name", ["geo_mean", "sapo", "dro", "dppo_tv", "dppo_kl"])
def test_importance_weights_multiply_the_token_losses(name):
    old = [[-1.0, -1.2, -0.8]]
    new = [[-0.9, -1.3, -0.8]]
    adv = [[0.5, 0.5, 0.5]]
    mask = [[1.0, 1.0, 1.0]]
    plain, _, _ = loss_and_grad(name, old, new, adv, mask)
    doubled, _, _ = loss_and_grad(name, old, new, adv, mask, agg=TOKEN_MEAN.weighted(torch.full((1, 3), 2.0, dtype=D)))
    assert doubled == pytest.approx(2 * plain, rel=1e-9)
