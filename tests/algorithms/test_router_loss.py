"""The mixture-of-experts balancing loss and expert loads (algorithms/router_loss.py): hand-computed cases,
transformers' own function on the same logits (value and gradient), and statistics that add up over parts of the
batch and of the layers (pipeline stages) to the whole's."""

import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hybridflow.algorithms.router_loss import balancing_loss_of, expert_loads_of, routing_statistics


def load_balancing_loss(layers, top_k):
    return balancing_loss_of(routing_statistics(layers, top_k))


def expert_loads(layers, top_k):
    return expert_loads_of(routing_statistics(layers, top_k))


def _logits(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


BALANCED = _logits([0.75, 0.25], [0.25, 0.75])  # top-1: one token to each expert
TO_FIRST = _logits([0.75, 0.25], [0.6, 0.4])  # top-1: both tokens to expert 0


def test_hand_computed_values():
    # f = [1/2, 1/2], P = [1/2, 1/2]: E * sum f * P = 2 * (1/4 + 1/4)
    assert load_balancing_loss([BALANCED], top_k=1).item() == pytest.approx(1.0)
    # f = [1, 0], P = [0.675, 0.325]
    assert load_balancing_loss([TO_FIRST], top_k=1).item() == pytest.approx(2 * 0.675)
    # two layers pooled: f = [3/4, 1/4], P = [2.35/4, 1.65/4]
    pooled = 2 * (0.75 * 2.35 / 4 + 0.25 * 1.65 / 4)
    assert load_balancing_loss([BALANCED, TO_FIRST], top_k=1).item() == pytest.approx(pooled)
    # top-2 of 2 experts: every token has both, f = [1, 1]: E * sum P = E
    assert load_balancing_loss([TO_FIRST], top_k=2).item() == pytest.approx(2.0)


def test_expert_loads_are_each_layer_s_share_of_the_choices():
    loads = expert_loads([BALANCED, TO_FIRST], top_k=1)
    assert loads.tolist() == [[0.5, 0.5], [1.0, 0.0]]


def test_equals_transformers_function_in_value_and_gradient():
    torch.manual_seed(0)
    layers = [torch.randn(7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ours = load_balancing_loss(layers, top_k=2)
    ours_grads = torch.autograd.grad(ours, layers)
    theirs = load_balancing_loss_func(tuple(layers), num_experts=4, top_k=2)
    theirs_grads = torch.autograd.grad(theirs, layers)
    assert math.isclose(ours.item(), theirs.item(), rel_tol=1e-6)
    for a, b in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-7)  # both sum in fp32
    assert max(g.abs().max().item() for g in ours_grads) > 0


def test_statistics_of_parts_add_up_to_the_wholes():
    """Tokens split in two (sequence-parallel slices) and layers split in two (stages, each filling its rows of the
    whole model's L): the summed statistics give the whole's loss, gradient and loads."""
    torch.manual_seed(1)
    layers = [torch.randn(6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    whole = routing_statistics(layers, top_k=2)
    by_tokens = routing_statistics([x[:2] for x in layers], 2) + routing_statistics([x[2:] for x in layers], 2)
    by_layers = routing_statistics(layers[:1], 2, layers=3) + routing_statistics(layers[1:], 2, layers=3, first=1)
    want = torch.autograd.grad(balancing_loss_of(whole), layers)
    for parts in (by_tokens, by_layers):
        torch.testing.assert_close(parts, whole)
        torch.testing.assert_close(expert_loads_of(parts), expert_loads_of(whole))
        got = torch.autograd.grad(balancing_loss_of(parts), layers)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
