"""Clip-Cov and KL-Cov on a batch where the high-covariance token is known by hand."""

import math

import torch
from algo_configs import policy_loss_config

from hybridflow.algorithms import LossAggregation, get_policy_loss

# A = (3, -1, -1, -1), mean 0; log π = (-1, -3, -2, -2), mean -2 → centred (1, -1, 0, 0)
# covariance per token: (3·1, (-1)·(-1), 0, 0) = (3, 1, 0, 0)
ADV = torch.tensor([[3.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
LOGP = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64)
MASK = torch.ones_like(ADV)


def run(name, old_log_prob, **cfg):
    log_prob = LOGP.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(
        old_log_prob, log_prob, ADV, MASK, policy_loss_config(**cfg), LossAggregation("token-mean")
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.item(), metrics, grad[0]


def test_clip_cov_detaches_the_high_covariance_token():
    # ratio 1 everywhere; only token 0 has lb = 1 < cov < ub = 5 (token 1's cov = 1 is not > 1)
    loss, metrics, grad = run("clip_cov", LOGP.clone(), clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0)
    # the value is unchanged: mean(-A·r) = -(3 - 1 - 1 - 1) / 4 = 0
    assert math.isclose(loss, 0.0, abs_tol=1e-12)
    # gradient -A·r / 4 except on the detached token 0
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.25, 0.25, 0.25], dtype=torch.float64))
    assert math.isclose(metrics["pg_clipfrac_cov"].item(), 0.25)


def test_clip_cov_without_eligible_tokens_is_ppo():
    loss, metrics, grad = run("clip_cov", LOGP.clone(), clip_cov_lb=10.0, clip_cov_ub=20.0)
    torch.testing.assert_close(grad, torch.tensor([-0.75, 0.25, 0.25, 0.25], dtype=torch.float64))
    assert metrics["pg_clipfrac_cov"].item() == 0.0


def test_kl_cov_penalises_the_top_covariance_token():
    old = LOGP - 0.1  # log r = 0.1 on every token
    loss, metrics, grad = run("kl_cov", old, kl_cov_ratio=0.0002, ppo_kl_coef=1.0)
    r = math.exp(0.1)
    # per token -A·r, plus |log r| = 0.1 on token 0 only: (-r·(3 - 1 - 1 - 1) + 0.1) / 4
    assert math.isclose(loss, 0.1 / 4, rel_tol=1e-9)
    # d/dlog π: -A·r, plus d|log r|/dlog π = +1 on token 0
    expected = torch.tensor([(-3 * r + 1) / 4, r / 4, r / 4, r / 4], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    assert math.isclose(metrics["pg_klfrac_cov"].item(), 0.25)
