"""Policy losses and their registry (config: `actor_rollout_ref.actor.policy_loss.loss_mode`).

Every loss has one signature:

    loss_fn(old_log_prob, log_prob, advantages, response_mask, config, loss_agg)
        -> (loss, metrics)

    old_log_prob, log_prob, advantages, response_mask: (B, T); log_prob carries the gradient.
    config: PolicyLossConfig; loss_agg: LossAggregation (or a mode name).
    loss: scalar; metrics: detached scalars, the same keys for every loss:
      pg_clipfrac       fraction of response tokens whose ratio clipping zeroed the gradient
      pg_clipfrac_high  ... of which A > 0 and r > 1 + ε_high (the clip-higher side)
      pg_clipfrac_low   ... of which A < 0 and r < 1 - ε_low
      pg_clipfrac_lower fraction of tokens held by the dual clip (A < 0 and r > clip_ratio_c)
      ppo_kl            approximate KL(π_old ‖ π) = masked mean of (log π_old - log π)

r = π/π_old is computed from a log-ratio clamped to ±`log_ratio_clamp` so that very large
log-prob differences give finite losses and gradients. The covariance losses (Clip-Cov,
KL-Cov) are in `cov_losses.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.registry import Registry
from hybridflow.validation import require, require_choice, require_positive

PolicyLossOutput = tuple[torch.Tensor, dict[str, torch.Tensor | float]]
PolicyLossFn = Callable[..., PolicyLossOutput]


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Settings of the policy losses (`actor_rollout_ref.actor.policy_loss.*`)."""

    # a registered policy loss: vanilla | gspo | gpg | cispo | clip_cov | kl_cov | geo_mean | sapo | dro | dppo_tv |
    # dppo_kl
    loss_mode: str
    clip_ratio: float  # PPO ε, used for both sides unless clip_ratio_low/high are set (geo_mean: in log space; dppo: δ)
    clip_ratio_low: float | None  # ε_low: ratio floor 1 - ε_low (None: clip_ratio)
    clip_ratio_high: float | None  # ε_high: ratio ceiling 1 + ε_high (DAPO clip-higher; None: clip_ratio)
    clip_ratio_c: float  # dual-clip bound c > 1 on the ratio for A < 0 (vanilla); dppo: the importance-weight cap
    clip_cov_ratio: float  # clip_cov: fraction of response tokens whose gradient is detached
    clip_cov_lb: float  # clip_cov: lower bound of the covariance of eligible tokens
    clip_cov_ub: float  # clip_cov: upper bound of the covariance of eligible tokens
    kl_cov_ratio: float  # kl_cov: fraction of response tokens that get the KL penalty
    ppo_kl_coef: float  # kl_cov: coefficient of |log r| on the selected tokens (verl's default)
    tau_pos: float  # sapo: gate temperature for tokens with A > 0
    tau_neg: float  # sapo: gate temperature for tokens with A <= 0
    dro_beta: float  # dro: weight of the quadratic log-ratio penalty
    log_ratio_clamp: float  # |log r| is clamped to this before exp, for stability

    def __post_init__(self) -> None:
        require_choice(self.loss_mode, list_policy_losses(), "loss_mode")
        require(self.clip_ratio_c > 1.0, "clip_ratio_c", f"must be > 1 (dual clip), got {self.clip_ratio_c}")
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            require(value is None or value >= 0, name, f"must be >= 0, got {value}")
        require_positive(self.clip_cov_ratio, "clip_cov_ratio")
        require_positive(self.kl_cov_ratio, "kl_cov_ratio")
        require_positive(self.log_ratio_clamp, "log_ratio_clamp")
        for name in ("tau_pos", "tau_neg", "dro_beta"):
            require_positive(getattr(self, name), name)

    def clip_bounds(self) -> tuple[float, float]:
        """(ε_low, ε_high), each falling back to clip_ratio."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high


_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss of the signature above under `name` (no duplicates)."""
    return _POLICY_LOSSES.decorator(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as `name`; ValueError listing the known names otherwise."""
    return _POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Registered loss names, sorted."""
    return _POLICY_LOSSES.names()


# ---- helpers shared by the losses -----------------------------------------------------


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
    """log r = log π - log π_old, clamped to ±log_ratio_clamp: (B, T) → (B, T)."""
    bound = config.log_ratio_clamp
    return torch.clamp(log_prob - old_log_prob, min=-bound, max=bound)


def clipped_surrogates(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token losses -A·r and -A·clip(r, 1-ε_low, 1+ε_high): (B, T) each."""
    low, high = config.clip_bounds()
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)


def clip_metrics(
    surr: torch.Tensor,
    surr_clipped: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    dual_held: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | float]:
    """The shared metrics from the unclipped / clipped per-token losses -A·r and -A·clip(r).

    A token is clipped where the clipped loss is the larger (the max picks it; its gradient
    is 0). dual_held: bool (B, T) tokens held by the dual clip, or None.
    """
    clipped = (surr_clipped > surr).detach()
    high = masked_mean((clipped & (advantages > 0)).float(), response_mask)
    low = masked_mean((clipped & (advantages < 0)).float(), response_mask)
    lower = torch.zeros((), device=surr.device) if dual_held is None else masked_mean(dual_held.float(), response_mask)
    return {
        "pg_clipfrac": (high + low).detach(),
        "pg_clipfrac_high": high.detach(),
        "pg_clipfrac_low": low.detach(),
        "pg_clipfrac_lower": lower.detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


def no_clip_metrics(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """Metrics of a loss without ratio clipping: clip fractions 0, plus ppo_kl."""
    zero = torch.zeros((), device=log_ratio.device)
    return {
        "pg_clipfrac": zero,
        "pg_clipfrac_high": zero,
        "pg_clipfrac_low": zero,
        "pg_clipfrac_lower": zero,
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


def unclipped_loss(
    per_token: torch.Tensor, log_ratio: torch.Tensor, response_mask: torch.Tensor, loss_agg: LossAggregation | str
) -> PolicyLossOutput:
    """A loss without ratio clipping: its per-token losses (B, T) aggregated, and ``no_clip_metrics``."""
    return agg_loss(per_token, response_mask, loss_agg), no_clip_metrics(log_ratio, response_mask)


# ---- the losses -----------------------------------------------------------------------


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual clip.

    Per token: L = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)); for A < 0 also
    L = min(L, -A·c) (dual clip, Ye et al. 2020), so a huge ratio cannot blow up the loss.
    Asymmetric ε_low ≠ ε_high is DAPO's clip-higher (Yu et al. 2025). All inputs (B, T).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    surr, surr_clipped = clipped_surrogates(torch.exp(log_ratio), advantages, config)
    clip_loss = torch.maximum(surr, surr_clipped)
    dual_bound = -advantages * config.clip_ratio_c
    dual_held = (advantages < 0) & (clip_loss > dual_bound)
    pg_losses = torch.where(advantages < 0, torch.minimum(clip_loss, dual_bound), clip_loss)
    loss = agg_loss(pg_losses, response_mask, loss_agg)
    return loss, clip_metrics(surr, surr_clipped, advantages, response_mask, log_ratio, dual_held.detach())


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025), token form: a sequence-level ratio in the PPO clip.

    s_i = exp(mean_t log r_it) over the response tokens of sequence i; per token the ratio is
    s_it = sg(s_i) · π(y_t)/sg(π(y_t)) (value s_i, gradient s_i·∇log π(y_t)), and the loss is
    max(-A·s_it, -A·clip(s_it, 1-ε_low, 1+ε_high)). The paper uses tiny ranges
    (clip_ratio_low=3e-4, clip_ratio_high=4e-4) and `seq-mean-token-mean`. All inputs (B, T).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # (B,)
    token_log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=config.log_ratio_clamp))
    surr, surr_clipped = clipped_surrogates(ratio, advantages, config)
    pg_losses = torch.maximum(surr, surr_clipped)
    loss = agg_loss(pg_losses, response_mask, loss_agg)
    return loss, clip_metrics(surr, surr_clipped, advantages, response_mask, log_ratio)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """GPG (Chu et al. 2025): the plain policy gradient L = -A·log π, no ratio, no clip. (B, T)."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    return unclipped_loss(-advantages * log_prob, log_ratio, response_mask, loss_agg)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update.

    L = -sg(clip(r, 1-ε_low, 1+ε_high)) · A · log π: every token keeps a gradient, with a
    truncated weight. MiniMax-M1 sets no lower bound in effect (a large clip_ratio_low, e.g. 1.0).
    Here pg_clipfrac_high / _low count tokens whose weight was truncated (r > 1+ε_high /
    r < 1-ε_low), whatever the sign of A. All inputs (B, T).
    """
    low, high = config.clip_bounds()
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    loss = agg_loss(-weight * advantages * log_prob, response_mask, loss_agg)
    metrics = no_clip_metrics(log_ratio, response_mask)
    frac_high = masked_mean((ratio > 1.0 + high).float(), response_mask).detach()
    frac_low = masked_mean((ratio < 1.0 - low).float(), response_mask).detach()
    metrics.update(pg_clipfrac=frac_high + frac_low, pg_clipfrac_high=frac_high, pg_clipfrac_low=frac_low)
    return loss, metrics
