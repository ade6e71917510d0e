"""Advantages of a batch whose sessions have several branches (rows): each session counted once.

An agent session that started several conversations (branches) is trained on each of them, one row per branch,
all with the session's reward. A group estimator (GRPO, RLOO, ...: ``needs_groups``) compares the samples of one
prompt, and a session with three branches must not weigh three times in its group's mean and spread: the estimator
runs on one row per session (its last branch, the one the reward was given for), and every other branch of the
session takes that row's advantage, the same number on each of its response tokens (the outcome estimators' advantage
is one number per sample). This is the "broadcast" of rLLM's step-wise advantage and of SkyRL's step-wise training.
An estimator without groups (GAE, REINFORCE++, ReMax) takes every branch as a trajectory of its own, the session's
reward at its end.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms.advantage import AdvantageConfig, AdvantageEstimator, AdvantageOutput
from hybridflow.algorithms.masked import masked_sum


def branch_advantages(
    estimator: AdvantageEstimator,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    config: AdvantageConfig,
    *,
    sessions: np.ndarray | None,
    last_branch: torch.Tensor | None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> AdvantageOutput:
    """(advantages, returns) (B, T) of rows of which ``last_branch`` (B,) marks one per session (``sessions``: (B,)
    the session of each row; a row whose session has no last branch, e.g. padding, gets 0). Without them (a batch
    of no agent sessions) every row is a sample of its own: the estimator's."""
    if last_branch is None or sessions is None or not estimator.needs_groups:
        return estimator(token_level_rewards, response_mask, index, config, values, reward_baselines)
    rows = torch.nonzero(last_branch, as_tuple=False).squeeze(1)
    picked = rows.cpu().numpy()

    def take(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows]

    last_adv, last_ret = estimator(
        token_level_rewards[rows],
        response_mask[rows],
        np.asarray(index)[picked],
        config,
        take(values),
        take(reward_baselines),
    )
    tokens = response_mask[rows].sum(dim=1).clamp_min(1.0)
    per_session_adv = dict(zip(sessions[picked], (masked_sum(last_adv, response_mask[rows], dim=1) / tokens).tolist()))
    per_session_ret = dict(zip(sessions[picked], (masked_sum(last_ret, response_mask[rows], dim=1) / tokens).tolist()))
    adv_of_row = torch.tensor([per_session_adv.get(s, 0.0) for s in sessions], dtype=last_adv.dtype)
    ret_of_row = torch.tensor([per_session_ret.get(s, 0.0) for s in sessions], dtype=last_ret.dtype)
    mask = response_mask.to(last_adv.dtype)
    advantages = adv_of_row.to(mask.device)[:, None] * mask
    returns = ret_of_row.to(mask.device)[:, None] * mask
    advantages[rows], returns[rows] = last_adv, last_ret
    return advantages, returns
