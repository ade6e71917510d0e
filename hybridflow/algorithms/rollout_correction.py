"""Rollout-training mismatch correction (`algorithm.rollout_correction.*`, verl's names).

The generator samples with π_rollout (another engine, other kernels, bf16, possibly stale weights);
the trainer's π_old scores the same tokens a little differently. With the per-token log-ratio

    log ρ_t = log π_old(y_t) - log π_rollout(y_t)      (clamped to ±20 before any exp)

the correction re-weights or drops the samples whose ratio says they are off-policy:

- importance weights (`rollout_is`): `token` w_t = ρ_t; `sequence` w_t = Π_s ρ_s for every token of
  the row. `rollout_is_mode` `truncate` (TIS) caps them: min(w, C); `mask` (MIS) zeroes the ones
  above the cap: w·[w ≤ C]; C = `rollout_is_threshold`. The weights multiply the per-token policy
  loss (LossAggregation.weighted), detached.
- rejection (`rollout_rs`): tokens (`token`: ρ_t) or whole rows (`sequence`: Π ρ_t; `geometric`:
  exp(mean_t log ρ_t)) whose ratio leaves [`rollout_rs_threshold_lower`, `rollout_rs_threshold`]
  leave the loss (their response-mask entries become 0), as verl's token_k1 / seq_sum_k1 / seq_mean_k1.

`correction_diagnostics` measures the gap every step (metrics `rollout_corr/*`): both perplexities,
their log-ratio, KL(π_rollout ‖ π_old) by the k1 and k3 estimators, chi-square at token and sequence
level, the effective sample sizes, and the fractions of weights capped and of tokens / rows rejected.
The "bypass" mode needs none of this: with `rollout.old_log_prob_source=rollout` the rollout's
log-probs are the old policy, so the policy loss's own ratio π/π_rollout (and its clipping) is the
correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.validation import require, require_choice, require_positive

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
RS_LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0  # |log ρ| (and |Σ log ρ|) is clamped to this before exp


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection between the trainer's old log-probs and the rollout's."""

    rollout_is: str | None  # importance weights: null (off) | token | sequence
    rollout_is_mode: str  # truncate (TIS: cap the weights at the threshold) | mask (MIS: zero the ones above it)
    rollout_is_threshold: float  # the cap C on the importance weights (> 0; typical 2.0)
    rollout_rs: str | None  # rejection: null (off) | token | sequence (product of ratios) | geometric (per-token mean)
    rollout_rs_threshold_lower: float  # rejection band's lower bound on the ratio (> 0)
    rollout_rs_threshold: float  # rejection band's upper bound on the ratio (> lower)

    def __post_init__(self) -> None:
        if self.rollout_is is not None:
            require_choice(self.rollout_is, IS_LEVELS, "rollout_is")
        require_choice(self.rollout_is_mode, IS_MODES, "rollout_is_mode")
        require_positive(self.rollout_is_threshold, "rollout_is_threshold")
        if self.rollout_rs is not None:
            require_choice(self.rollout_rs, RS_LEVELS, "rollout_rs")
        require_positive(self.rollout_rs_threshold_lower, "rollout_rs_threshold_lower")
        require(
            self.rollout_rs_threshold > self.rollout_rs_threshold_lower,
            "rollout_rs_threshold",
            f"must be > rollout_rs_threshold_lower ({self.rollout_rs_threshold_lower}), "
            f"got {self.rollout_rs_threshold}",
        )

    @property
    def enabled(self) -> bool:
        """Whether the correction changes the loss (weights or rejection); diagnostics are always measured."""
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass
class Correction:
    """What the correction does to one batch: weights (B, T) or None, keep (B, T) bool, and metrics."""

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]


def correction_log_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log ρ = log π_old - log π_rollout, clamped to ±SAFETY_BOUND, 0 off the mask: (B, T) -> (B, T)."""
    log_ratio = torch.clamp(old_log_prob.float() - rollout_log_prob.float(), -SAFETY_BOUND, SAFETY_BOUND)
    return log_ratio * response_mask


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log Π_t ρ_t per row, clamped to ±SAFETY_BOUND: (B, T) -> (B,)."""
    return torch.clamp(masked_sum(log_ratio, response_mask, dim=-1), -SAFETY_BOUND, SAFETY_BOUND)


def raw_importance_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Untruncated weights (B, T): ρ_t per token, or the row's Π ρ on each of its tokens; 0 off the mask."""
    if level == "token":
        weights = torch.exp(log_ratio)
    else:
        weights = torch.exp(sequence_log_ratio(log_ratio, response_mask))[:, None].expand_as(log_ratio)
    return weights * response_mask


def importance_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, mode: str, threshold: float
) -> torch.Tensor:
    """Capped (truncate) or masked (mask) importance weights (B, T), detached, 0 off the mask."""
    raw = raw_importance_weights(log_ratio, response_mask, level)
    if mode == "truncate":
        return torch.clamp(raw, max=threshold).detach()
    return torch.where(raw <= threshold, raw, torch.zeros_like(raw)).detach()


def rejection_keep(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, lower: float, upper: float
) -> torch.Tensor:
    """True where a response token stays in the loss (its ratio, or its row's, inside [lower, upper]): (B, T) bool."""
    low, high = math.log(lower), math.log(upper)
    if level == "token":
        statistic = log_ratio
    elif level == "sequence":
        statistic = sequence_log_ratio(log_ratio, response_mask)[:, None].expand_as(log_ratio)
    else:  # geometric
        statistic = masked_mean(log_ratio, response_mask, dim=-1)[:, None].expand_as(log_ratio)
    return (statistic >= low) & (statistic <= high) & response_mask.bool()


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> Correction:
    """The weights and rejection that `config` asks for on one batch (all (B, T)), with the diagnostics."""
    mask = response_mask.float()
    log_ratio = correction_log_ratio(old_log_prob, rollout_log_prob, mask)
    weights = None
    if config.rollout_is is not None:
        weights = importance_weights(
            log_ratio, mask, config.rollout_is, config.rollout_is_mode, config.rollout_is_threshold
        )
    keep = response_mask.bool()
    if config.rollout_rs is not None:
        keep = rejection_keep(
            log_ratio, mask, config.rollout_rs, config.rollout_rs_threshold_lower, config.rollout_rs_threshold
        )
    metrics = correction_diagnostics(old_log_prob, rollout_log_prob, response_mask)
    metrics.update(correction_effect(log_ratio, mask, weights, keep, config))
    return Correction(weights=weights, keep=keep, metrics=metrics)


def effective_sample_size(weights: torch.Tensor) -> float:
    """(Σ w)² / (n · Σ w²) of n weights: 1 when all are equal, 1/n when one carries everything."""
    weights = weights.double()
    if weights.numel() == 0 or float((weights**2).sum()) == 0.0:
        return 0.0
    return float(weights.sum() ** 2 / (weights.numel() * (weights**2).sum()))


def correction_diagnostics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far π_old is from π_rollout on the sampled tokens; keys `rollout_corr/*`.

    Per row i (rows with at least one response token): ℓ_i = mean_t log π(y_t). training_ppl and
    rollout_ppl: mean_i exp(-ℓ_i); log_ppl_diff: mean_i (ℓ_i^rollout - ℓ_i^old) = mean_i log(ppl_old/ppl_rollout).
    Per token: log_ratio_mean / log_ratio_abs_mean: masked mean of log ρ / |log ρ|; kl (k1): mean of
    -log ρ, k3_kl: mean of ρ - 1 - log ρ, both estimating KL(π_rollout ‖ π_old) from rollout samples;
    chi2_token: mean ρ² - 1; chi2_seq: mean_i (Π ρ)² - 1; ess_token / ess_seq: normalised effective
    sample size of the token ratios / the row ratios.
    """
    mask = response_mask.float()
    rows = mask.sum(dim=-1) > 0
    if not bool(rows.any()):
        return {}
    log_ratio = correction_log_ratio(old_log_prob, rollout_log_prob, mask)
    token = mask.bool()
    ratio = torch.exp(log_ratio)
    mean_old = masked_mean(old_log_prob.float(), mask, dim=-1)[rows]
    mean_rollout = masked_mean(rollout_log_prob.float(), mask, dim=-1)[rows]
    seq_log_ratio = sequence_log_ratio(log_ratio, mask)[rows]
    metrics = {
        "training_ppl": torch.exp(-mean_old).mean(),
        "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "log_ppl_diff": (mean_rollout - mean_old).mean(),
        "log_ratio_mean": masked_mean(log_ratio, mask),
        "log_ratio_abs_mean": masked_mean(log_ratio.abs(), mask),
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
        "chi2_token": masked_mean(ratio**2, mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
        "ess_token": effective_sample_size(ratio[token]),
        "ess_seq": effective_sample_size(torch.exp(seq_log_ratio)),
    }
    return {f"rollout_corr/{name}": float(value) for name, value in metrics.items()}


def correction_effect(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    weights: torch.Tensor | None,
    keep: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> dict[str, float]:
    """What the correction did: weight statistics and the fraction capped (or masked) at the threshold
    (tokens for token weights, rows for sequence weights), and the fractions of tokens and rows rejected."""
    token = response_mask.bool()
    rows = token.any(dim=-1)
    if not bool(rows.any()):
        return {}
    rejected = token & ~keep
    metrics = {
        "rollout_corr/rejected_token_fraction": float(rejected.sum() / token.sum()),
        "rollout_corr/rejected_seq_fraction": float(rejected.any(dim=-1)[rows].float().mean()),
    }
    if weights is not None:
        raw = raw_importance_weights(log_ratio, response_mask, config.rollout_is)
        over = raw > config.rollout_is_threshold
        per_unit = over[token] if config.rollout_is == "token" else over.any(dim=-1)[rows]
        applied = weights[token] if config.rollout_is == "token" else weights.max(dim=-1).values[rows]
        metrics.update(
            {
                "rollout_corr/is_weight_mean": float(applied.mean()),
                "rollout_corr/is_weight_max": float(applied.max()),
                "rollout_corr/is_clipped_fraction": float(per_unit.float().mean()),
                "rollout_corr/is_ess": effective_sample_size(applied),
            }
        )
    return metrics
