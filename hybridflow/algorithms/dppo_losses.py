"""DPPO's trust-region losses (arXiv 2602.04879): a token is trained only while the new policy stays
within a divergence bound of the old one on that token, with a truncated importance weight.

Here ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` are divergence thresholds δ (not ratio
ranges) and ``clip_ratio_c`` is the cap C of the importance weight. With p = π(y_t), p_old = π_old(y_t),
r = p / p_old and w = sg(min(r, C)), per token

    L = -A · w · log π · sg(valid)

where ``valid`` is the trust region: tokens outside it get no gradient (their loss is a constant 0).
Metrics: pg_clipfrac (tokens outside the region; _high: A > 0, _low: A ≤ 0), pg_clipfrac_lower
(tokens inside it whose weight was truncated at C).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    clamped_log_ratio,
    no_clip_metrics,
    register_policy_loss,
)


def binary_kl(old_prob: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """KL between the Bernoulli distributions (p_old, 1 - p_old) and (p, 1 - p): "this token or another"."""
    eps = 1e-8
    return old_prob * (torch.log(old_prob + eps) - torch.log(prob + eps)) + (1.0 - old_prob) * torch.log(
        (1.0 - old_prob + eps) / (1.0 - prob + eps)
    )


def _trust_region_loss(
    valid: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """The DPPO loss and metrics (module docstring) of the tokens whose trust-region test is ``valid`` (B, T) bool;
    the two losses differ only in that test."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=config.clip_ratio_c).detach()
    valid = valid.detach()
    loss = agg_loss(-advantages * weight * log_prob * valid.to(log_prob.dtype), response_mask, loss_agg)
    outside = ~valid
    high = masked_mean((outside & (advantages > 0)).float(), response_mask).detach()
    low = masked_mean((outside & (advantages <= 0)).float(), response_mask).detach()
    metrics = no_clip_metrics(log_ratio, response_mask)
    metrics.update(
        pg_clipfrac=high + low,
        pg_clipfrac_high=high,
        pg_clipfrac_low=low,
        pg_clipfrac_lower=masked_mean(((ratio > config.clip_ratio_c) & valid).float(), response_mask).detach(),
    )
    return loss, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """DPPO-Binary-TV: valid where A > 0 and p - p_old ≤ δ_high, or A ≤ 0 and p - p_old ≥ -δ_low."""
    low, high = config.clip_bounds()
    change = (torch.exp(log_prob) - torch.exp(old_log_prob)).detach()
    valid = torch.where(advantages > 0, change <= high, change >= -low)
    return _trust_region_loss(valid, old_log_prob, log_prob, advantages, response_mask, config, loss_agg)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """DPPO-Binary-KL: valid where the binary KL(p_old ‖ p) ≤ δ_high (A > 0) or ≤ δ_low (A ≤ 0), and
    always where the token moved against its advantage (p ≤ p_old for A > 0, p ≥ p_old for A ≤ 0)."""
    low, high = config.clip_bounds()
    prob, old_prob = torch.exp(log_prob).detach(), torch.exp(old_log_prob).detach()
    divergence = binary_kl(old_prob, prob)
    valid = torch.where(
        advantages > 0, (divergence <= high) | (prob <= old_prob), (divergence <= low) | (prob >= old_prob)
    )
    return _trust_region_loss(valid, old_log_prob, log_prob, advantages, response_mask, config, loss_agg)
