"""The Tinker API's losses (algorithms/datum_losses.py) against numbers worked by hand: sums over tokens, padding
ignored, the ppo clip on the ratio and its gradient, and the settings each loss takes."""

import math

import pytest
import torch

from hybridflow.algorithms.datum_losses import DATUM_LOSSES, loss_settings

MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding


def loss(name: str, target_logprobs: torch.Tensor, config: dict | None = None, **inputs) -> torch.Tensor:
    tensors = {key: torch.tensor([value]) for key, value in inputs.items()}
    return DATUM_LOSSES[name].fn(target_logprobs, tensors, MASK, loss_settings(name, config))


def test_cross_entropy_is_the_weighted_negative_log_likelihood_summed():
    per_token = loss("cross_entropy", torch.tensor([[-1.0, -2.0, -9.0]]), weights=[1.0, 0.5, 1.0])
    assert per_token.tolist() == [[1.0, 1.0, 0.0]]


def test_importance_sampling_weighs_the_advantage_by_the_ratio():
    target = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    per_token = loss(
        "importance_sampling", target, logprobs=[math.log(0.25), math.log(0.2), 5.0], advantages=[1.0, -2.0, 7.0]
    )
    assert per_token.detach()[0].tolist() == pytest.approx([-2.0, 2.0, 0.0])  # ratios 2 and 1
    per_token.sum().backward()
    assert target.grad[0].tolist() == pytest.approx([-2.0, 2.0, 0.0])  # d/dlogp of -ratio·A is -ratio·A


def test_ppo_clips_the_ratio_where_it_would_gain_and_then_passes_no_gradient():
    # ratios 2 (A > 0: clipped to 1.2), 0.5 (A > 0: kept, the pessimistic side), 2 (A < 0: kept)
    target = torch.tensor([[math.log(2.0), math.log(0.5), math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 3)
    inputs = {"logprobs": torch.zeros(1, 3), "advantages": torch.tensor([[1.0, 1.0, -1.0]])}
    per_token = DATUM_LOSSES["ppo"].fn(target, inputs, mask, loss_settings("ppo", None))
    assert per_token.detach()[0].tolist() == pytest.approx([-1.2, -0.5, 2.0])
    per_token.sum().backward()
    assert target.grad[0].tolist() == pytest.approx([0.0, -0.5, 2.0])
    wider = DATUM_LOSSES["ppo"].fn(target.detach(), inputs, mask, loss_settings("ppo", {"clip_high_threshold": 3}))
    assert wider[0, 0].item() == pytest.approx(-2.0)


def test_settings_are_checked():
    assert loss_settings("ppo", {"clip_low_threshold": 0.7}) == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.2}
    with pytest.raises(ValueError, match="not a setting of importance_sampling"):
        loss_settings("importance_sampling", {"clip_low_threshold": 0.7})
    with pytest.raises(ValueError, match="<= 1 <="):
        loss_settings("ppo", {"clip_low_threshold": 1.1})
