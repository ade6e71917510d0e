"""The per-token losses of the Tinker API (``forward_backward(data, loss_fn)``), as pure functions.

Each datum brings its own inputs (``target_tokens`` and, by loss, ``weights``, ``logprobs`` of the sampler,
``advantages``); the trainer's log-probs of the targets are ``target_logprobs``. Every loss is a *sum* over all
tokens of all datums, not a mean: that is the API's contract (the client chooses the normalisation through the
weights or advantages it sends), and it makes a batch split into chunks give the same gradient as one request.

    cross_entropy        -(weights · target_logprobs)
    importance_sampling  -(ratio · advantages),                      ratio = exp(target_logprobs - logprobs)
    ppo                  -min(ratio · A, clip(ratio, low, high) · A)  low, high: clip_low/high_threshold

Tensors are (B, T) with a 0/1 ``mask`` of each datum's real tokens (padding contributes nothing). A loss returns
the per-token loss (B, T), zero on padding, and its sum is the loss that is differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

TARGET_TOKENS = "target_tokens"
WEIGHTS = "weights"
SAMPLER_LOGPROBS = "logprobs"
ADVANTAGES = "advantages"

PPO_CLIP_LOW = "clip_low_threshold"
PPO_CLIP_HIGH = "clip_high_threshold"
PPO_DEFAULTS = {PPO_CLIP_LOW: 0.8, PPO_CLIP_HIGH: 1.2}  # on the ratio: 1 - 0.2 and 1 + 0.2


@dataclass(frozen=True)
class Datum:
    """One sequence: ``tokens`` (N,) int, ``inputs`` the loss's per-position arrays (N,), ``target_tokens`` too."""

    tokens: np.ndarray
    inputs: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class DatumOutput:
    logprobs: np.ndarray  # (N,) float32: log p(target_tokens[i] | tokens[: i + 1])
    elementwise_loss: np.ndarray  # (N,) float32: the loss of each position (summed into the loss)


DatumLossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, Mapping[str, float]], torch.Tensor]


@dataclass(frozen=True)
class DatumLoss:
    """A loss of the registry: the function, the per-token inputs it reads besides ``target_tokens``, the
    settings ``loss_fn_config`` may give (with their defaults), and ``trains``: the input whose zeros make a
    token's loss gradient exactly zero (a weight or an advantage), so the pass differentiates only the others."""

    fn: DatumLossFn
    inputs: tuple[str, ...]
    settings: Mapping[str, float]
    trains: str


def cross_entropy(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor, settings: Mapping[str, float]
) -> torch.Tensor:
    """Weighted negative log-likelihood of the targets."""
    return -(inputs[WEIGHTS] * target_logprobs) * mask


def _ratio(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    # padding is masked before the exponent: a ratio of garbage never reaches the loss or its gradient
    return torch.exp((target_logprobs - inputs[SAMPLER_LOGPROBS]) * mask)


def importance_sampling(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor, settings: Mapping[str, float]
) -> torch.Tensor:
    """REINFORCE with the trainer/sampler importance ratio on each token."""
    return -(_ratio(target_logprobs, inputs, mask) * inputs[ADVANTAGES]) * mask


def ppo(
    target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor, settings: Mapping[str, float]
) -> torch.Tensor:
    """The clipped surrogate, token by token; the thresholds bound the ratio itself (0.8 and 1.2 by default)."""
    ratio = _ratio(target_logprobs, inputs, mask)
    advantages = inputs[ADVANTAGES]
    clipped = torch.clamp(ratio, settings[PPO_CLIP_LOW], settings[PPO_CLIP_HIGH])
    return -torch.minimum(ratio * advantages, clipped * advantages) * mask


DATUM_LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(cross_entropy, (WEIGHTS,), {}, trains=WEIGHTS),
    "importance_sampling": DatumLoss(importance_sampling, (SAMPLER_LOGPROBS, ADVANTAGES), {}, trains=ADVANTAGES),
    "ppo": DatumLoss(ppo, (SAMPLER_LOGPROBS, ADVANTAGES), PPO_DEFAULTS, trains=ADVANTAGES),
}


def loss_settings(name: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's settings: its defaults updated by ``given``; ValueError naming a setting it does not have or a
    ppo pair that is not low <= 1 <= high."""
    loss = DATUM_LOSSES[name]
    given = dict(given or {})
    unknown = sorted(set(given) - set(loss.settings))
    if unknown:
        known = sorted(loss.settings) or "none"
        raise ValueError(f"loss_fn_config {unknown} is not a setting of {name} (its settings: {known})")
    settings = {**loss.settings, **{key: float(value) for key, value in given.items()}}
    if name == "ppo" and not settings[PPO_CLIP_LOW] <= 1.0 <= settings[PPO_CLIP_HIGH]:
        raise ValueError(
            f"ppo needs {PPO_CLIP_LOW} <= 1 <= {PPO_CLIP_HIGH} (bounds on the ratio, e.g. 0.8 and 1.2), "
            f"got {settings[PPO_CLIP_LOW]} and {settings[PPO_CLIP_HIGH]}"
        )
    return settings
