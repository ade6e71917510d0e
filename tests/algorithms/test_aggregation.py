"""loss_agg_mode by hand, and the gradient-accumulation contract (property test)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import AGG_MODES, LossAggregation, agg_loss, count_tokens_and_seqs

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # third row: no response tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),  # 18 / 5 tokens
        ("token-sum", 1 + 2 + 4 + 5 + 6),  # the masked tokens, summed
        ("seq-mean-token-sum", (3 + 15) / 2),  # sums 3 and 15 over 2 non-empty sequences
        ("seq-mean-token-mean", (1.5 + 5.0) / 2),  # means 3/2 and 15/3
        ("seq-mean-token-sum-norm", (3 / 3 + 15 / 3) / 2),  # sums divided by T = 3
    ],
)
def test_modes_by_hand(mode, expected):
    assert math.isclose(agg_loss(L, M, mode).item(), expected, rel_tol=1e-6)


def test_norm_constant():
    agg = LossAggregation("seq-mean-token-sum-norm", norm_constant=10.0)
    assert math.isclose(agg_loss(L, M, agg).item(), (3 / 10 + 15 / 10) / 2, rel_tol=1e-6)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="token-mean"):
        LossAggregation("token_sum")


def test_token_mean_with_accumulation_is_not_mean_of_means():
    # micro-batch 1 = row 0 (2 tokens, mean 1.5); micro-batch 2 = row 1 (3 tokens, mean 5)
    naive = (agg_loss(L[:1], M[:1], "token-mean") + agg_loss(L[1:2], M[1:2], "token-mean")) / 2
    assert math.isclose(naive.item(), 3.25, rel_tol=1e-6)  # wrong: weights rows, not tokens
    agg = LossAggregation.for_minibatch("token-mean", M)
    assert (agg.global_tokens, agg.global_seqs) == (5.0, 2.0)
    accumulated = agg_loss(L[:1], M[:1], agg) + agg_loss(L[1:], M[1:], agg)
    assert math.isclose(accumulated.item(), 18 / 5, rel_tol=1e-6)  # 3/5 + 15/5


def test_empty_mask_is_zero():
    empty = torch.zeros_like(M)
    for mode in AGG_MODES:
        assert agg_loss(L, empty, mode).item() == 0.0
    assert count_tokens_and_seqs(empty) == (0.0, 0.0)


@settings(derandomize=True, max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 6),
    length=st.integers(1, 5),
    n_micro=st.integers(1, 4),
    mode=st.sampled_from(AGG_MODES),
    seed=st.integers(0, 2**16),
)
def test_accumulated_micro_batches_equal_the_whole(batch, length, n_micro, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.7).double()
    weights = torch.randn(batch, length, generator=gen, dtype=torch.float64, requires_grad=True)

    whole = agg_loss(losses * weights, mask, LossAggregation(mode))
    (grad_whole,) = torch.autograd.grad(whole, weights)

    agg = LossAggregation.for_minibatch(mode, mask)
    bounds = torch.linspace(0, batch, n_micro + 1).round().long().tolist()
    accumulated = sum(agg_loss(losses[a:b] * weights[a:b], mask[a:b], agg) for a, b in zip(bounds, bounds[1:]) if b > a)
    (grad_acc,) = torch.autograd.grad(accumulated, weights)
    torch.testing.assert_close(accumulated, whole)
    torch.testing.assert_close(grad_acc, grad_whole)


def test_token_weights_multiply_the_per_token_losses():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights = torch.tensor([[2.0, 0.0, 9.0], [1.0, 1.0, 0.5]])
    agg = LossAggregation("token-mean").weighted(weights)
    # (1·2 + 2·0 + 4·1 + 5·1 + 6·0.5) / 5 tokens: the counts stay the mask's
    assert agg_loss(loss, mask, agg).item() == pytest.approx(14.0 / 5)
    seq = LossAggregation("seq-mean-token-sum").weighted(weights)
    assert agg_loss(loss, mask, seq).item() == pytest.approx((2.0 + 12.0) / 2)
    assert LossAggregation("token-mean").weighted(None).token_weights is None
