"""The per-token losses of the Tinker API (``forward_backward(data, loss_fn)``), as pure functions.

Each datum brings its own inputs (``target_tokens`` and, by loss, ``weights``, ``logprobs`` of the sampler,
``advantages``); the trainer's log-probs of the targets are ``target_logprobs``. Every loss is a *sum* over all
tokens of all datums, not a mean: that is the API's contract (the client chooses the normalisation through the
weights or advantages it sends), and it makes a batch split into chunks give the same gradient as one request.

    cross_entropy        -(weights · target_logprobs)
    importance_sampling  -(ratio · advantages),                      ratio = exp(target_logprobs - logprobs)
    ppo                  -min(ratio · A, clip(ratio, low, high) · A)  low, high: clip_low/high_threshold

Tensors are (B, T) with a 0/1 ``mask`` of each datum's real tokens (padding contributes nothing). A loss returns
the per-token loss (B, T), zero on padding, and its sum is the loss that is differentiated. Each is an objective of
the registry (objectives/datum.py: its inputs, its settings and their defaults).
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
