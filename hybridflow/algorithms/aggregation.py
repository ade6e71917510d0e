"""Loss aggregation: how a (B, T) matrix of per-token losses becomes one scalar.

Config key: `actor_rollout_ref.actor.loss_agg_mode` (and `critic.loss_agg_mode`).

Modes (L = per-token loss, m = response mask, T = response length, S = sequences):

- `token-mean`: Σ_{i,t} m·L / Σ_{i,t} m — every token weighs the same (DAPO, Yu et al. 2025).
- `token-sum`: Σ_{i,t} m·L — no normalisation: the loss (and gradient) scale with the tokens.
- `seq-mean-token-sum`: (1/S) Σ_i Σ_t m·L — each sequence's token sum, averaged.
- `seq-mean-token-mean`: (1/S) Σ_i (Σ_t m·L / Σ_t m) — the original GRPO (Shao et al. 2024).
- `seq-mean-token-sum-norm`: (1/S) Σ_i (Σ_t m·L / C) with a constant C (default T), so that
  no length-dependent weight enters the gradient (Dr.GRPO, Liu et al. 2025).

Gradient accumulation contract
------------------------------
An engine that splits a mini-batch into micro-batches passes the *mini-batch's* totals to
every micro-batch: `global_tokens` (number of response tokens, Σ m) and `global_seqs`
(number of sequences with at least one response token). Then the SUM over micro-batches
of `agg_loss(...)` equals `agg_loss` of the whole mini-batch in one piece, for every mode,
so summing gradients (not averaging micro-batch losses) gives the exact mini-batch
gradient. `token-mean` is thus the mean over all the mini-batch's tokens, not the mean of
micro-batch means. When the globals are None, the micro-batch itself is the whole.
`LossAggregation.for_minibatch` computes the globals from the mini-batch's mask.
Under data parallelism with gradient all-reduce *averaging*, counts taken over all ranks
must be divided by the world size (or the loss multiplied by it) to keep the same scale.

Token weights
-------------
`token_weights` (B, T), when set, multiplies each per-token loss before the reduction (the
counts stay the mask's): rollout-correction importance weights enter every policy loss this way
(`LossAggregation.weighted`), so no loss has to know about them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridflow.algorithms.masked import masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossAggregation:
    """How to reduce a loss matrix, and the mini-batch totals for gradient accumulation."""

    mode: str = "token-mean"  # one of AGG_MODES (config: loss_agg_mode)
    global_tokens: float | None = None  # response tokens in the whole mini-batch; None: this batch's
    global_seqs: float | None = None  # non-empty sequences in the mini-batch; None: this batch's
    norm_constant: float | None = None  # seq-mean-token-sum-norm divisor; None: response length T
    token_weights: torch.Tensor | None = None  # (B, T) multiplies the per-token losses; None: all 1

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.mode!r}; known: {', '.join(AGG_MODES)}")
        if self.norm_constant is not None and self.norm_constant <= 0:
            raise ValueError(f"norm_constant must be positive, got {self.norm_constant}")

    @classmethod
    def for_minibatch(
        cls, mode: str, response_mask: torch.Tensor, norm_constant: float | None = None
    ) -> LossAggregation:
        """Aggregation whose globals are the totals of `response_mask` (B, T), a whole mini-batch.

        Pass the result to every micro-batch of that mini-batch. `norm_constant` defaults to
        the mini-batch's T, so micro-batches padded to different lengths still agree.
        """
        tokens, seqs = count_tokens_and_seqs(response_mask)
        if norm_constant is None:
            norm_constant = float(response_mask.shape[-1])
        return cls(mode, global_tokens=tokens, global_seqs=seqs, norm_constant=norm_constant)

    def weighted(self, token_weights: torch.Tensor | None) -> LossAggregation:
        """The same aggregation with per-token loss weights (B, T) (detached), e.g. importance weights."""
        return replace(self, token_weights=None if token_weights is None else token_weights.detach())


def count_tokens_and_seqs(response_mask: torch.Tensor) -> tuple[float, float]:
    """(number of response tokens, number of sequences with >= 1 response token) of a (B, T) mask."""
    mask = response_mask.bool()
    return float(mask.sum().item()), float(mask.any(dim=-1).sum().item())


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: LossAggregation | str) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar (see the module docstring for the modes).

    loss_mat: (B, T) per-token losses; loss_mask: (B, T) 0/1; agg: a LossAggregation or a
    mode name (then the batch is its own whole). Returns a scalar; 0 for an empty mask.
    """
    if isinstance(agg, str):
        agg = LossAggregation(agg)
    if agg.token_weights is not None:
        loss_mat = loss_mat * agg.token_weights.to(loss_mat.dtype)
    if agg.mode == "token-mean":
        if agg.global_tokens is None:
            n_tokens = loss_mask.bool().sum().to(loss_mat.dtype).clamp_min(1.0)
        else:
            n_tokens = max(float(agg.global_tokens), 1.0)
        return masked_sum(loss_mat, loss_mask) / n_tokens
    if agg.mode == "token-sum":  # a sum over micro-batches is the mini-batch's sum: no totals needed
        return masked_sum(loss_mat, loss_mask)

    seq_sum = masked_sum(loss_mat, loss_mask, dim=-1)  # (B,)
    seq_tokens = loss_mask.bool().sum(dim=-1).to(loss_mat.dtype)  # (B,)
    if agg.mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif agg.mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp_min(1.0)
    else:  # seq-mean-token-sum-norm
        norm = agg.norm_constant if agg.norm_constant is not None else max(loss_mat.shape[-1], 1)
        per_seq = seq_sum / float(norm)
    if agg.global_seqs is None:
        n_seqs = (seq_tokens > 0).sum().to(loss_mat.dtype).clamp_min(1.0)
    else:
        n_seqs = max(float(agg.global_seqs), 1.0)
    return per_seq.sum() / n_seqs
