"""Policy losses that bound the update without PPO's per-token hard clip: GMPO's geometric mean of the
ratios (`geo_mean`), SAPO's soft gate (`sapo`) and DRO's quadratic log-ratio penalty (`dro`).

Same signature and metrics as the losses in policy_loss.py; all inputs (B, T).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation
from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    clamped_log_ratio,
    no_clip_metrics,
    register_policy_loss,
    unclipped_loss,
)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of the token ratios, clipped in log space.

    Per token, with s = sign(A_t) and ℓ_t = log r_t: ℓ̂_t = s · min(s·ℓ_t, s·clip(ℓ_t, -ε_low, ε_high))
    (the pessimistic side, as PPO's max picks it; GMPO uses ε = 0.4 in log space). Per response i:
    R_i = exp(mean_t ℓ̂_t), Ā_i = mean_t A_t, loss_i = -Ā_i · R_i. The loss is the mean of loss_i over
    the responses with at least one token (the mini-batch's count under gradient accumulation), whatever
    loss_agg_mode says: the estimator is sequence-level. Importance weights in ``loss_agg`` enter per
    response as the geometric mean of the token weights.
    """
    if isinstance(loss_agg, str):
        loss_agg = LossAggregation(loss_agg)
    low, high = config.clip_bounds()
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    clipped_log_ratio = torch.clamp(log_ratio, -low, high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)
    mask = response_mask.float()
    lengths = mask.sum(dim=-1)
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths.clamp_min(1.0))
    seq_advantage = masked_sum(advantages, mask, dim=-1) / lengths.clamp_min(1.0)
    per_sequence = -seq_advantage * seq_ratio
    if loss_agg.token_weights is not None:
        log_weights = torch.log(loss_agg.token_weights.clamp_min(1e-10))
        per_sequence = per_sequence * torch.exp(masked_sum(log_weights, mask, dim=-1) / lengths.clamp_min(1.0))
    has_tokens = lengths > 0
    if loss_agg.global_seqs is not None:
        n_sequences = max(float(loss_agg.global_seqs), 1.0)
    else:
        n_sequences = has_tokens.sum().to(per_sequence.dtype).clamp_min(1.0)
    loss = (per_sequence * has_tokens).sum() / n_sequences

    clipped = (log_ratio != clipped_log_ratio).detach()
    high_frac = masked_mean((clipped & (advantages > 0)).float(), response_mask).detach()
    low_frac = masked_mean((clipped & (advantages < 0)).float(), response_mask).detach()
    metrics = no_clip_metrics(log_ratio, response_mask)
    metrics.update(pg_clipfrac=high_frac + low_frac, pg_clipfrac_high=high_frac, pg_clipfrac_low=low_frac)
    return loss, metrics


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, temperature-controlled gate instead of the clip.

    Per token L = -f(r, τ) · A with f(r, τ) = σ(τ (r - 1)) · 4/τ, τ = tau_pos where A > 0 and tau_neg
    otherwise. f'(r) = 4 σ'(τ (r - 1)) is 1 at r = 1, so on-policy the gradient is the plain policy
    gradient; away from r = 1 the gate's slope fades smoothly (faster for larger τ) instead of
    dropping to 0 at a clip edge. Aggregated by loss_agg_mode (verl forces seq-mean-token-mean).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(config.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(config.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return unclipped_loss(-gate * advantages, log_ratio, response_mask, loss_agg)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    loss_agg: LossAggregation | str,
) -> PolicyLossOutput:
    """DRO (Richemond et al. 2024, arXiv 2405.19107): policy gradient with a quadratic log-ratio penalty.

    Per token L = -(A · log π - (β/2) · (log π - log π_old)²), β = dro_beta: the penalty pulls the
    policy back towards π_old (the same regulariser as Kimi k1.5's policy mirror descent), with
    ∂L/∂log π = -A + β · log r. log r is clamped to ±log_ratio_clamp (finite gradients).
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob, config)
    per_token = -(advantages * log_prob - 0.5 * config.dro_beta * log_ratio**2)
    return unclipped_loss(per_token, log_ratio, response_mask, loss_agg)
