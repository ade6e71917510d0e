"""The Tinker API's losses (algorithms/datum_losses.py, objectives of the registry: objectives/datum.py) against
numbers worked by hand: sums over tokens, padding ignored, the ppo clip on the ratio and its gradient, and the
settings each loss takes."""

import math

import pytest
import torch

from hybridflow.algorithms import LossAggregation
from hybridflow.algorithms.objectives import OBJECTIVES, ForwardOutputs, datum_objective, datum_objectives
from hybridflow.batch_keys import RESPONSE_MASK

MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding


def per_token(name: str, target_logprobs: torch.Tensor, inputs: dict, mask: torch.Tensor, config=None) -> torch.Tensor:
    objective = OBJECTIVES.get(name)(config)
    outputs = ForwardOutputs(log_probs=target_logprobs)
    total, _ = objective.loss(outputs, {**inputs, RESPONSE_MASK: mask}, LossAggregation())
    each = objective.per_token(outputs, {**inputs, RESPONSE_MASK: mask})
    torch.testing.assert_close(total, each.sum())  # the loss is the sum, not a mean
    return each


def loss(name: str, target_logprobs: torch.Tensor, config: dict | None = None, **inputs) -> torch.Tensor:
    return per_token(name, target_logprobs, {key: torch.tensor([value]) for key, value in inputs.items()}, MASK, config)


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
    losses = per_token("ppo", target, inputs, mask)
    assert losses.detach()[0].tolist() == pytest.approx([-1.2, -0.5, 2.0])
    losses.sum().backward()
    assert target.grad[0].tolist() == pytest.approx([0.0, -0.5, 2.0])
    wider = per_token("ppo", target.detach(), inputs, mask, {"clip_high_threshold": 3})
    assert wider[0, 0].item() == pytest.approx(-2.0)


def test_settings_are_checked():
    ppo = datum_objective("ppo")
    assert ppo({"clip_low_threshold": 0.7}).settings == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.2}
    with pytest.raises(ValueError, match="not a setting of importance_sampling"):
        datum_objective("importance_sampling")({"clip_low_threshold": 0.7})
    with pytest.raises(ValueError, match="<= 1 <="):
        ppo.checked({"clip_low_threshold": 1.1})


def test_the_service_serves_the_datum_objectives_only():
    assert datum_objectives() == ["cross_entropy", "importance_sampling", "ppo"]
    with pytest.raises(ValueError, match=r"loss_fn 'sft' is not served here .*'cross_entropy'"):
        datum_objective("sft")
