"""Token entropy and sampled-token log-probs from logits, light on memory.

The vocabulary dimension V is large (32k-250k), so a (B, T, V) tensor is the biggest thing
in the step. These functions never build log_softmax(logits) next to softmax(logits):

    entropy  H = logsumexp(z) - Σ_v softmax(z)_v · z_v      (one softmax, contracted by matmul)
    log-prob log p(y) = z_y - logsumexp(z)                  (a gather, no log_softmax)

With `chunk_size`, rows are processed in chunks (and upcast to float32 chunk by chunk), which
bounds the extra memory to chunk_size × V; useful without autograd (old / ref log-probs).
Logits must be finite (mask vocabulary entries with a large negative number, not -inf).
"""

from __future__ import annotations

from typing import Callable

import torch


def _by_rows(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *rest: torch.Tensor, chunk_size: int | None
) -> torch.Tensor:
    """Apply `fn` to (N, V) rows of `logits` (and matching (N,) rows of `rest`), in chunks."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_rest = [r.reshape(-1) for r in rest]
    if chunk_size is None or flat.shape[0] <= chunk_size:
        return fn(flat, *flat_rest).view(lead)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    parts = [
        fn(flat[i : i + chunk_size], *(r[i : i + chunk_size] for r in flat_rest))
        for i in range(0, flat.shape[0], chunk_size)
    ]
    return torch.cat(parts).view(lead)


def _upcast(z: torch.Tensor) -> torch.Tensor:
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


def _entropy_rows(z: torch.Tensor) -> torch.Tensor:
    z = _upcast(z)  # (N, V)
    probs = torch.softmax(z, dim=-1)  # (N, V), the only full-vocabulary temporary
    expected_logit = torch.matmul(probs.unsqueeze(-2), z.unsqueeze(-1)).view(-1)  # Σ_v p_v z_v, (N,)
    return torch.logsumexp(z, dim=-1) - expected_logit


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: (..., V) → (...), float32 or wider.

    Differentiable; `chunk_size` rows at a time when given (see the module docstring).
    """
    return _by_rows(_entropy_rows, logits, chunk_size=chunk_size)


def _log_prob_rows(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    z = _upcast(z)  # (N, V)
    picked = torch.gather(z, -1, labels.long().unsqueeze(-1)).squeeze(-1)  # (N,)
    return picked - torch.logsumexp(z, dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[label]: logits (..., V), labels (...) integer ids → (...).

    Computed as logit[label] - logsumexp(logits), without a full log_softmax copy.
    Differentiable; `chunk_size` rows at a time when given.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without V")
    return _by_rows(_log_prob_rows, logits, labels, chunk_size=chunk_size)
