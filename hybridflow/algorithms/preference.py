"""Preference losses: DPO and its relatives on a policy's and a reference's log-probs of a chosen and a rejected
answer to one prompt, and the Bradley-Terry loss of a reward model's scores of the two.

A pair's implicit reward margin is

    h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))

with y_w the chosen answer, y_l the rejected one, and each log π the sum of the answer's token log-probs. The losses
of ``algorithm.loss_type`` (``hybridflow dpo``) (``PREFERENCE_LOSSES``):

- ``sigmoid`` (DPO, Rafailov et al. 2023): -log σ(β h). With label smoothing ε (conservative DPO, the chance that a
  label is flipped): -(1 - ε) log σ(β h) - ε log σ(-β h).
- ``ipo`` (Azar et al. 2023): (h - 1/(2β))², on log-probs averaged over each answer's tokens (as the paper's
  regulariser is per token, and as TRL computes it), so a long answer does not dominate the square.
- ``hinge`` (SLiC, Zhao et al. 2023): max(0, 1 - β h).

The implicit rewards β (log π(y) - log π_ref(y)) of each answer give the metrics: the reward accuracy is the share of
pairs whose chosen answer has the larger one. With β → 0 the sigmoid loss tends to log 2 for every pair, and a pair
whose two answers are identical has h = 0 and no gradient whatever β is.

The Bradley-Terry loss trains a scalar reward model r on the same pairs: -log σ(r(y_w) - r(y_l) - m), with an optional
per-pair margin m (Llama 2's, for pairs rated as clearly better).

Pairs are laid out as consecutive rows, chosen first (``pair_halves``), so that every split of a batch that keeps
even-sized runs of rows keeps a pair together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.algorithms.masked import masked_mean, masked_sum
from hybridflow.algorithms.registry import Registry
from hybridflow.validation import require, require_choice


@dataclass(frozen=True)
class PreferenceLoss:
    """One pair loss: ``fn(h, beta, label_smoothing) -> (P,)`` losses, and whether its log-probs are averaged over
    each answer's tokens instead of summed."""

    fn: Callable[[torch.Tensor, float, float], torch.Tensor]
    length_normalized: bool = False


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss", "algorithm.loss_type")


def register_preference_loss(name: str, length_normalized: bool = False):
    """Decorator: register ``fn(h, beta, label_smoothing) -> losses`` under ``name``."""

    def decorate(fn: Callable[[torch.Tensor, float, float], torch.Tensor]):
        PREFERENCE_LOSSES.add(name, PreferenceLoss(fn, length_normalized))
        return fn

    return decorate


@register_preference_loss("sigmoid")
def sigmoid_loss(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@register_preference_loss("ipo", length_normalized=True)
def ipo_loss(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)) ** 2


@register_preference_loss("hinge")
def hinge_loss(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * h)


@dataclass(kw_only=True)
class PreferenceConfig:
    """The DPO objective: ``hybridflow dpo``'s ``algorithm`` section."""

    loss_type: str  # sigmoid (DPO) | ipo | hinge (algorithms/preference.py PREFERENCE_LOSSES)
    beta: float  # strength of the pull towards the reference: the implicit reward's scale
    label_smoothing: float  # sigmoid only: the assumed chance a pair's label is wrong (conservative DPO); 0: off

    def __post_init__(self) -> None:
        require_choice(self.loss_type, PREFERENCE_LOSSES.names(), "loss_type")
        require(self.beta > 0, "beta", f"must be > 0, got {self.beta}", "the DPO paper's 0.1 is a common start")
        require(
            0 <= self.label_smoothing < 0.5,
            "label_smoothing",
            f"must be in [0, 0.5), got {self.label_smoothing}",
            "0 trusts every label; 0.5 would trust none",
        )
        require(
            self.label_smoothing == 0 or self.loss_type == "sigmoid",
            "label_smoothing",
            f"only the sigmoid loss smooths labels, and loss_type={self.loss_type}",
            "set label_smoothing=0, or loss_type=sigmoid",
        )


def pair_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0, 2, 4, ... (the chosen answers) and 1, 3, 5, ... (the rejected ones) of a (2P, ...) tensor."""
    if x.shape[0] % 2:
        raise ValueError(f"preference rows come in pairs (chosen, rejected), got {x.shape[0]} rows")
    return x[0::2], x[1::2]


def answer_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor, length_normalized: bool) -> torch.Tensor:
    """(B,) each row's answer log-prob: the sum of its masked token log-probs, or their mean."""
    if length_normalized:
        return masked_mean(token_log_probs, mask, dim=-1)
    return masked_sum(token_log_probs, mask, dim=-1)


@dataclass(frozen=True)
class PairOutput:
    """Per pair (P,): the loss, and the implicit rewards β (log π - log π_ref) of each answer (no gradient)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    config: PreferenceConfig,
) -> PairOutput:
    """The configured pair loss from the answers' log-probs (P,) each (sums, or means for a length-normalised
    loss: ``answer_log_probs``); the reference's carry no gradient."""
    chosen_ratio = policy_chosen - reference_chosen.detach()
    rejected_ratio = policy_rejected - reference_rejected.detach()
    entry = PREFERENCE_LOSSES.get(config.loss_type)
    losses = entry.fn(chosen_ratio - rejected_ratio, config.beta, config.label_smoothing)
    return PairOutput(
        losses=losses,
        chosen_rewards=config.beta * chosen_ratio.detach(),
        rejected_rewards=config.beta * rejected_ratio.detach(),
    )


def pair_metrics(output: PairOutput, prefix: str = "dpo") -> dict[str, float]:
    """Means over the pairs: the loss, the reward accuracy (a tie counts as wrong), the chosen and rejected implicit
    rewards, and their margin."""
    margins = output.chosen_rewards - output.rejected_rewards
    return {
        f"{prefix}/loss": float(output.losses.detach().mean()),
        f"{prefix}/reward_accuracy": float((margins > 0).float().mean()),
        f"{prefix}/chosen_reward": float(output.chosen_rewards.mean()),
        f"{prefix}/rejected_reward": float(output.rejected_rewards.mean()),
        f"{prefix}/reward_margin": float(margins.mean()),
    }


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """(P,) -log σ(r_chosen - r_rejected - margin): a reward model's loss on pairs (margin: (P,) or None)."""
    difference = chosen_scores - rejected_scores
    if margin is not None:
        difference = difference - margin
    return -F.logsigmoid(difference)


def score_pair_metrics(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None, prefix: str = "rm"
) -> dict[str, float]:
    """A reward model's means over pairs: the Bradley-Terry loss (with ``margin``), the accuracy (the chosen answer
    scored higher; a tie counts as wrong), the chosen and rejected scores, and their difference."""
    difference = chosen_scores - rejected_scores
    return {
        f"{prefix}/loss": float(bradley_terry_loss(chosen_scores, rejected_scores, margin).mean()),
        f"{prefix}/accuracy": float((difference > 0).float().mean()),
        f"{prefix}/chosen_score": float(chosen_scores.mean()),
        f"{prefix}/rejected_score": float(rejected_scores.mean()),
        f"{prefix}/score_margin": float(difference.mean()),
    }
