"""Reward shaping applied to training scores (not to validation): DAPO's soft overlong penalty."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.validation import require


@dataclass(kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025): a linear penalty over the last ``len`` tokens of
    the response budget (`reward.overlong_buffer.*`, verl's names)."""

    enable: bool  # add the penalty
    len: int  # the last this many tokens of rollout.response_length are the buffer
    penalty_factor: float  # the penalty at the full budget (it grows linearly through the buffer)

    def __post_init__(self) -> None:
        require(self.len >= 1, "len", f"must be >= 1, got {self.len}")
        require(self.penalty_factor >= 0, "penalty_factor", f"must be >= 0, got {self.penalty_factor}")


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """(B,) lengths -> (B,) penalties: 0 up to ``max_response_length - buffer_len`` tokens, then falling
    linearly to ``-penalty_factor`` at ``max_response_length``: min(-(L - (L_max - buf)) / buf · factor, 0)."""
    exceed = response_lengths.float() - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(
    token_level_scores: torch.Tensor, response_mask: torch.Tensor, config: OverlongBufferConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, R) scores with each response's penalty added on its last token (R is the budget), and the
    metrics ``reward/overlong_penalty/{mean,fraction}``. The input is not modified."""
    lengths = response_mask.sum(dim=1)
    penalty = overlong_penalty(lengths, token_level_scores.shape[1], config.len, config.penalty_factor)
    shaped = token_level_scores.clone()
    shaped[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] += penalty.to(shaped.dtype)
    metrics = {
        "reward/overlong_penalty/mean": penalty.mean().item(),
        "reward/overlong_penalty/fraction": (penalty < 0).float().mean().item(),
    }
    return shaped, metrics
