"""Clipped value loss by hand."""

import math

import torch

from hybridflow.algorithms import compute_value_loss

VALUES = torch.tensor([[1.0, 0.0, 3.0]], dtype=torch.float64)  # critic at rollout time
RETURNS = torch.tensor([[2.0, 1.0, 2.5]], dtype=torch.float64)
MASK = torch.ones_like(VALUES)


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.5, 0.1, 3.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = compute_value_loss(vpreds, VALUES, RETURNS, MASK, cliprange_value=0.2, loss_agg="token-mean")
    # token 0: V_clip = 1 + 0.2 = 1.2; (1.5-2)² = 0.25 < (1.2-2)² = 0.64 → 0.64, clipped
    # token 1: V_clip = 0.1 (inside); both (0.1-1)² = 0.81
    # token 2: V_clip = 3.0; both (3-2.5)² = 0.25
    assert math.isclose(loss.item(), 0.5 * (0.64 + 0.81 + 0.25) / 3, rel_tol=1e-9)
    assert math.isclose(metrics["vf_clipfrac"].item(), 1 / 3, rel_tol=1e-6)
    loss.backward()
    # token 0 clipped: no gradient; token 2: ½·2·(3 - 2.5) / 3
    assert vpreds.grad[0, 0].item() == 0.0
    assert math.isclose(vpreds.grad[0, 2].item(), 0.5 / 3, rel_tol=1e-9)


def test_value_loss_without_clipping():
    vpreds = torch.tensor([[1.5, 0.1, 3.0]], dtype=torch.float64)
    loss, metrics = compute_value_loss(vpreds, VALUES, RETURNS, MASK, cliprange_value=None, loss_agg="token-mean")
    assert math.isclose(loss.item(), 0.5 * (0.25 + 0.81 + 0.25) / 3, rel_tol=1e-9)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_on_an_empty_mask_is_zero():
    vpreds = torch.zeros_like(VALUES, requires_grad=True)
    loss, metrics = compute_value_loss(vpreds, VALUES, RETURNS, torch.zeros_like(MASK), 0.2, "token-mean")
    loss.backward()
    assert loss.item() == 0.0 and metrics["vf_clipfrac"].item() == 0.0
    assert torch.equal(vpreds.grad, torch.zeros_like(VALUES))
