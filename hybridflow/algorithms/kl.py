"""KL between the policy and the reference: per-token estimators, controllers, and the two uses.

Estimators (Schulman, "Approximating KL divergence", 2020), with δ = log π - log π_ref on
tokens sampled from π:

    kl / k1          δ                       unbiased, can be negative
    abs              |δ|
    mse / k2         ½ δ²                    biased, low variance; its gradient is δ·∇log π
    low_var_kl / k3  e^{-δ} - 1 + δ          unbiased, >= 0; δ clamped to ±20, result to [-10, 10]

Each name with a `+` suffix (e.g. `k1+`, `low_var_kl+`) is straight-through: its value is
the named estimator's and its gradient is k2's, which is the unbiased gradient of KL(π‖π_ref)
when the loss is averaged over tokens sampled from π.

Two uses, both supported:
- in the reward (`algorithm.use_kl_in_reward`, `algorithm.kl_penalty`, `algorithm.kl_ctrl.*`):
  `apply_kl_penalty` with a `FixedKLController` or `AdaptiveKLController`;
- as a loss term (`actor.use_kl_loss`, `actor.kl_loss_coef`, `actor.kl_loss_type`):
  `compute_kl_loss`, which the caller scales by kl_loss_coef.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.algorithms.aggregation import LossAggregation, agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.validation import require, require_choice, require_positive


def _k1(delta: torch.Tensor) -> torch.Tensor:
    return delta


def _abs(delta: torch.Tensor) -> torch.Tensor:
    return delta.abs()


def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta.square()


def _k3(delta: torch.Tensor) -> torch.Tensor:
    neg = torch.clamp(-delta, min=-20.0, max=20.0)  # log(π_ref/π), clamped so exp stays finite
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}

KL_TYPES: tuple[str, ...] = tuple(sorted([*_KL_ESTIMATORS, *(name + "+" for name in _KL_ESTIMATORS)]))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate between π (log_prob) and π_ref (ref_log_prob).

    log_prob, ref_log_prob: (B, T) log-probs of the sampled tokens → (B, T).
    kl_type: one of KL_TYPES (see the module docstring). Unknown → ValueError.
    """
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    if base not in _KL_ESTIMATORS:
        raise ValueError(f"unknown kl type {kl_type!r}; known: {', '.join(KL_TYPES)}")
    delta = log_prob - ref_log_prob
    value = _KL_ESTIMATORS[base](delta)
    if not straight_through:
        return value
    k2 = _k2(delta)
    return k2 + (value - k2).detach()  # value of `base`, gradient of k2


class FixedKLController:
    """A constant KL coefficient β (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""


class AdaptiveKLController:
    """β adapted toward a target KL (Ziegler et al. 2019, `algorithm.kl_ctrl.type=adaptive`).

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be positive, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β after observing `current_kl` over `n_steps` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


@dataclass(kw_only=True)
class KLControlConfig:
    """The coefficient β of the KL penalty in the reward (`algorithm.kl_ctrl.*`)."""

    type: str  # a registered controller (KL_CONTROLLERS): fixed | adaptive
    kl_coef: float  # initial (fixed: constant) coefficient β of the KL penalty in the reward
    target_kl: float  # adaptive: the KL per sequence the controller steers towards
    horizon: int  # adaptive: samples over which the coefficient adapts

    def __post_init__(self) -> None:
        require_choice(self.type, KL_CONTROLLERS, "type")
        require(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        require_positive(self.target_kl, "target_kl")
        require_positive(self.horizon, "horizon")


# name -> how to build that controller from its config (the registry `algorithm.kl_ctrl.type` picks from)
KL_CONTROLLERS: dict[str, Callable[[KLControlConfig], KLController]] = {
    "fixed": lambda config: FixedKLController(config.kl_coef),
    "adaptive": lambda config: AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon),
}


def make_kl_controller(config: KLControlConfig) -> KLController:
    """The controller named by ``config.type``."""
    if config.type not in KL_CONTROLLERS:
        raise ValueError(f"unknown kl_ctrl type {config.type!r}; known: {', '.join(sorted(KL_CONTROLLERS))}")
    return KL_CONTROLLERS[config.type](config)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_type: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: r_t = score_t - β·kl_t on the response tokens, then update β.

    token_level_scores, log_prob, ref_log_prob, response_mask: (B, T) → rewards (B, T).
    The controller is updated with the batch mean of each sequence's mean token KL and
    n_steps = B. Metrics: `actor/reward_kl_penalty` (that mean KL) and
    `actor/reward_kl_penalty_coeff` (the β that was applied, before the update).
    """
    with torch.no_grad():
        kld = torch.where(response_mask.bool(), kl_penalty(log_prob, ref_log_prob, kl_type), 0.0)
        beta = kl_ctrl.value
        token_level_rewards = token_level_scores - beta * kld
        current_kl = masked_mean(kld, response_mask, dim=-1).mean().item() if kld.shape[0] else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str,
    loss_agg: LossAggregation | str,
) -> torch.Tensor:
    """KL as a loss term (`actor.use_kl_loss`): agg_loss(kl_penalty(log π, log π_ref)).

    log_prob (with gradient), ref_log_prob, response_mask: (B, T) → scalar. The caller adds
    `kl_loss_coef` × this to the policy loss. `low_var_kl` is the usual choice (GRPO).
    """
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg)
