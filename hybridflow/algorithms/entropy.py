"""Token entropy and sampled-token log-probs from logits, light on memory.

The vocabulary dimension V is large (32k-250k), so a (B, T, V) tensor is the biggest thing
in the step. These functions never build log_softmax(logits) next to softmax(logits):

    entropy  H = logsumexp(z) - Σ_v softmax(z)_v · z_v      (softmax(z) = exp(z - logsumexp(z)), one dot a row)
    log-prob log p(y) = z_y - logsumexp(z)                  (a gather, no log_softmax)

Rows are processed in chunks, upcast to float32 chunk by chunk. Besides bounding the extra
memory to chunk_size × V, this is faster on CPU: a chunk of a few dozen rows stays in cache
through the max, exp and sum passes (bench/train_kernels.py, 2 cores of the AMX host, 1024 × 49152 bf16
logits: log-probs 61 ms whole, 29 ms in chunks of 16; entropy 120 ms whole, 63 ms in chunks of 64, where contracting
the probabilities by a batched matmul took 147 ms and lost 1e-3 of accuracy).
The log-prob has its own backward, (onehot - softmax) · grad, also by chunks, so autograd
keeps neither a float32 copy nor a softmax of the logits.
Logits must be finite (mask vocabulary entries with a large negative number, not -inf).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOG_PROB_CHUNK = 16  # rows per chunk, see the module docstring
ENTROPY_CHUNK = 64


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
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (N, 1)
    probs = torch.exp(z - lse)  # (N, V), the only full-vocabulary temporary
    return lse.squeeze(-1) - torch.linalg.vecdot(probs, z)  # Σ_v p_v z_v as one pass per row


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: (..., V) → (...), float32 or wider.

    Differentiable; `chunk_size` rows at a time (default ENTROPY_CHUNK; see the module docstring).
    """
    return _by_rows(_entropy_rows, logits, chunk_size=ENTROPY_CHUNK if chunk_size is None else chunk_size)


class _ChunkedLogProb(torch.autograd.Function):
    """log softmax(z)[y] for (N, V) logits, forward and backward in row chunks."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        labels = labels.long()
        out = torch.empty(logits.shape[0], dtype=_upcast(logits[:0]).dtype, device=logits.device)
        lse = torch.empty_like(out)
        for i in range(0, logits.shape[0], chunk_size):
            z = _upcast(logits[i : i + chunk_size])
            lse[i : i + chunk_size] = torch.logsumexp(z, dim=-1)
            out[i : i + chunk_size] = z.gather(-1, labels[i : i + chunk_size, None]).squeeze(-1)
        out -= lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(i, i + ctx.chunk_size)
            g = grad_out[rows, None]
            chunk = torch.exp(_upcast(logits[rows]) - lse[rows, None]).mul_(-g)  # -softmax · grad
            chunk.scatter_add_(-1, labels[rows, None], g)  # + onehot · grad
            grad[rows] = chunk
        return grad, None, None


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[label]: logits (..., V), labels (...) integer ids → (...).

    Computed as logit[label] - logsumexp(logits), without a full log_softmax copy, in chunks of
    `chunk_size` rows (default LOG_PROB_CHUNK). Differentiable, with a chunked backward.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without V")
    chunk_size = LOG_PROB_CHUNK if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedLogProb.apply(flat, labels.reshape(-1), chunk_size).view(labels.shape)
