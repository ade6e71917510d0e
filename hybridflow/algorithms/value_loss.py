"""Clipped value loss for the PPO critic (config: `critic.cliprange_value`, `critic.loss_agg_mode`)."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg: LossAggregation | str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with value clipping (Schulman et al. 2017; as in OpenAI baselines' PPO2).

    V_clip = V_old + clip(V - V_old, -c, c);  L = ½ · max((V - R)², (V_clip - R)²),
    aggregated with `loss_agg`. `cliprange_value=None` disables clipping: L = ½ (V - R)².

    vpreds: (B, T) current critic values (with gradient); values: (B, T) critic values at
    rollout time; returns: (B, T) targets; response_mask: (B, T).
    Returns (loss scalar, {"vf_clipfrac": fraction of response tokens where the clipped
    term was the larger one, i.e. whose gradient was cut}).
    """
    err = (vpreds - returns) ** 2
    if cliprange_value is None:
        clipfrac = torch.zeros((), device=vpreds.device)
        per_token = err
    else:
        if cliprange_value < 0:
            raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
        vpreds_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
        err_clipped = (vpreds_clipped - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).float(), response_mask)
    loss = 0.5 * agg_loss(per_token, response_mask, loss_agg)
    return loss, {"vf_clipfrac": clipfrac.detach()}
