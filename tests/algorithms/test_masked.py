"""Masked helpers against hand-computed numbers, and their behaviour on empty masks."""

import math

import torch

from hybridflow.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # selects 1, 2 and 5


def test_masked_sum_and_mean():
    assert masked_sum(X, M).item() == 8.0  # 1 + 2 + 5
    assert math.isclose(masked_mean(X, M).item(), 8.0 / 3.0, rel_tol=1e-6)
    torch.testing.assert_close(masked_sum(X, M, dim=-1), torch.tensor([3.0, 5.0]))
    torch.testing.assert_close(masked_mean(X, M, dim=-1), torch.tensor([1.5, 5.0]))  # 3/2, 5/1


def test_masked_var():
    # mean 8/3; deviations -5/3, -2/3, 7/3; squares sum to (25 + 4 + 49) / 9 = 78/9
    assert math.isclose(masked_var(X, M).item(), (78 / 9) / 2, rel_tol=1e-6)  # unbiased: / (n - 1)
    assert math.isclose(masked_var(X, M, unbiased=False).item(), (78 / 9) / 3, rel_tol=1e-6)


def test_masked_whiten():
    x = torch.tensor([[2.0, 4.0, 6.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 4, unbiased var ((-2)^2 + 0 + 2^2) / 2 = 4, std 2 → (-1, 0, 1); the masked-out 100 → 0
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # shift_mean=False keeps the mean: (-1, 0, 1) + 4
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), torch.tensor([[3.0, 4.0, 5.0, 0.0]]))


def test_bool_mask_is_accepted():
    assert masked_sum(X, M.bool()).item() == 8.0


def test_empty_mask_gives_zeros_not_nan():
    empty = torch.zeros_like(M)
    assert masked_sum(X, empty).item() == 0.0
    assert masked_mean(X, empty).item() == 0.0
    assert masked_var(X, empty).item() == 0.0
    assert torch.equal(masked_whiten(X, empty), torch.zeros_like(X))
    # one empty row among non-empty ones
    row_means = masked_mean(X, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), dim=-1)
    torch.testing.assert_close(row_means, torch.tensor([2.0, 0.0]))


def test_single_element_variance_is_zero():
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(X, one).item() == 0.0  # n - 1 = 0: no NaN
    assert torch.isfinite(masked_whiten(X, one)).all()


def test_nan_outside_the_mask_does_not_leak():
    x = torch.tensor([[1.0, float("nan"), float("inf")]], requires_grad=True)
    m = torch.tensor([[1.0, 0.0, 0.0]])
    out = masked_mean(x, m)
    assert out.item() == 1.0
    out.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 0.0, 0.0]]))
