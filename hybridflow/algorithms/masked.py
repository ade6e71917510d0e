"""Masked reductions over response tokens.

Every function takes a 0/1 `mask` broadcastable to `x` (bool or float; 1 = a real
response token) and is safe on empty masks: no division by zero, no NaN, results are 0.
Values of `x` at masked-out positions never reach the result, even if they are NaN or
inf (they are selected away with `torch.where`, not multiplied by 0).
"""

from __future__ import annotations

import torch


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` where mask is set, 0 elsewhere (NaN/inf outside the mask are dropped)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is set.

    x: (B, T) or any shape; mask: broadcastable to x.
    Returns a scalar when `dim` is None, else `x` reduced over `dim`.
    """
    selected = _select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def _count(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Number of masked-in positions, reduced like `masked_sum`."""
    ones = torch.broadcast_to(mask.bool(), x.shape).to(x.dtype)
    return ones.sum() if dim is None else ones.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over masked positions; 0 where nothing is masked in.

    x: (B, T); mask: (B, T). `dim=None` → scalar; `dim=-1` → (B,) per-row means.
    """
    total = masked_sum(x, mask, dim)
    count = _count(x, mask, dim)
    return total / count.clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all masked positions (a scalar).

    With `unbiased`, divides by n - 1 (Bessel); returns 0 when n <= 1 (or n == 0 if biased)
    instead of NaN.
    """
    mask = torch.broadcast_to(mask, x.shape)
    mean = masked_mean(x, mask)
    sq_dev = masked_sum((x - mean) ** 2, mask)
    n = mask.bool().sum().to(x.dtype)
    denom = n - 1.0 if unbiased else n
    return torch.where(denom > 0, sq_dev / denom.clamp_min(1.0), torch.zeros_like(sq_dev))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Standardise `x` with the mean and (unbiased) variance of its masked positions.

    x, mask: (B, T) → (B, T). Computes (x - mean) / sqrt(var + eps); with
    `shift_mean=False` the mean is added back (only the scale changes). Positions outside
    the mask are returned as 0. An empty mask gives all zeros.
    """
    mask = torch.broadcast_to(mask, x.shape)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)
