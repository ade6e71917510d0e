"""Clip-Cov and KL-Cov policy losses (Cui et al. 2025, "The Entropy Mechanism of RL for
Reasoning Language Models").

Both act on the few response tokens whose centred covariance
cov_t = (A_t - mean A) · (log π_t - mean log π) (means over the batch's response tokens)
is largest: those tokens drive the entropy collapse. Clip-Cov detaches their gradient,
KL-Cov adds a |log r| penalty on them. Registered as `clip_cov` and `kl_cov`.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    clamped_log_ratio,
    clip_metrics,
    clipped_surrogates,
    no_clip_metrics,
    register_policy_loss,
)


def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Centred (A · log π) product per token, detached: (B, T) → (B, T)."""
    adv = advantages.detach()
    logp = log_prob.detach()
    return (adv - masked_mean(adv, response_mask)) * (logp - masked_mean(logp, response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """Clip-Cov: PPO clip, plus the gradient of a few high-covariance tokens detached.

    Eligible tokens: in the mask, not already ratio-clipped, clip_cov_lb < cov < clip_cov_ub.
    max(1, ⌊clip_cov_ratio · n_tokens⌋) of them are drawn at random (torch's global RNG) and
    their per-token loss is detached (same value, no gradient). Extra metric
    `pg_clipfrac_cov`: the fraction of response tokens detached this way. All inputs (B, T).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    surr, surr_clipped = clipped_surrogates(torch.exp(log_ratio), advantages, config)
    pg_losses = torch.maximum(surr, surr_clipped)

    in_mask = response_mask.bool()
    cov = token_covariance(advantages, log_prob, response_mask)
    eligible = in_mask & (surr_clipped <= surr) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    candidates = eligible.flatten().nonzero(as_tuple=True)[0]
    n_pick = min(max(int(config.clip_cov_ratio * int(in_mask.sum())), 1), candidates.numel())
    picked = torch.zeros(in_mask.numel(), dtype=torch.bool, device=in_mask.device)
    picked[candidates[torch.randperm(candidates.numel(), device=candidates.device)[:n_pick]]] = True
    picked = picked.view_as(in_mask)

    pg_losses = torch.where(picked, pg_losses.detach(), pg_losses)
    loss = agg_loss(pg_losses, response_mask, loss_agg)
    metrics = clip_metrics(surr, surr_clipped, advantages, response_mask, log_ratio)
    metrics["pg_clipfrac_cov"] = masked_mean(picked.float(), response_mask).detach()
    return loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """KL-Cov: unclipped surrogate -A·r, plus ppo_kl_coef·|log r| on the top-covariance tokens.

    The max(1, ⌊kl_cov_ratio · n_tokens⌋) response tokens of largest cov get the penalty.
    Extra metric `pg_klfrac_cov`: the fraction of response tokens penalised. All inputs (B, T).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    pg_losses = -advantages * torch.exp(log_ratio)

    in_mask = response_mask.bool()
    n_tokens = int(in_mask.sum())
    picked = torch.zeros(in_mask.numel(), dtype=torch.bool, device=in_mask.device)
    if n_tokens > 0:
        cov = token_covariance(advantages, log_prob, response_mask)
        cov = torch.where(in_mask, cov, torch.full_like(cov, float("-inf"))).flatten()
        n_pick = max(int(config.kl_cov_ratio * n_tokens), 1)
        picked[torch.topk(cov, n_pick).indices] = True
    picked = picked.view_as(in_mask)

    penalty = config.ppo_kl_coef * log_ratio.abs()
    pg_losses = pg_losses + torch.where(picked, penalty, torch.zeros_like(penalty))
    loss = agg_loss(pg_losses, response_mask, loss_agg)
    metrics = no_clip_metrics(log_ratio, response_mask)
    metrics["pg_klfrac_cov"] = masked_mean(picked.float(), response_mask).detach()
    return loss, metrics
