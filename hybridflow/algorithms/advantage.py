"""The advantage-estimator registry, its config, and the group statistics estimators share.

Config key: `algorithm.adv_estimator`. The estimators themselves live in `estimators.py`
(registered on import of `hybridflow.algorithms`). Every estimator has one signature:

    estimator(token_level_rewards, response_mask, index, config,
              values=None, reward_baselines=None) -> (advantages, returns)

    token_level_rewards: (B, T) float   per-token rewards (outcome rewards sit on the last token)
    response_mask:       (B, T) 0/1     1 on real response tokens
    index:               (B,) numpy     group id (`uid`) shared by the n samples of one prompt
    config:              AdvantageConfig
    values:              (B, T) float   critic values (estimators with needs_values)
    reward_baselines:    (B,) float     greedy-rollout scores (estimators with needs_baseline)
    returns (advantages, returns), both (B, T) and 0 outside the mask.

Outcome-reward estimators use the sequence score s_i = Σ_t m_it·r_it.
Users add an estimator with `@register_adv_estimator("name")` on a function of that signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.masked import masked_sum
from hybridflow.algorithms.registry import Registry
from hybridflow.validation import require, require_positive

AdvantageOutput = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True)
class AdvantageConfig:
    """Settings of the advantage estimators: the `algorithm.*` keys they read (``AlgorithmConfig``
    extends this class). Defaults are written once, in hybridflow/config/ppo_trainer.yaml."""

    gamma: float  # discount factor γ (gae, reinforce_plus_plus)
    lam: float  # GAE λ (gae)
    norm_adv_by_std_in_grpo: bool  # divide by the group std (grpo, grpo_passk, pass_at_k); false: Dr.GRPO
    epsilon: float  # added to a standard deviation before dividing by it
    gae_whiten: bool  # whiten GAE advantages over the batch's response tokens (PPO practice)
    pass_k: int  # k of the pass@k objective (pass_at_k), below the group size
    gpg_norm_by_std: bool  # GPG's F_norm: group std instead of 1 (gpg)

    def __post_init__(self) -> None:
        require(0.0 <= self.gamma <= 1.0, "gamma", f"must be in [0, 1], got {self.gamma}")
        require(0.0 <= self.lam <= 1.0, "lam", f"must be in [0, 1], got {self.lam}")
        require(self.pass_k >= 1, "pass_k", f"must be >= 1, got {self.pass_k}")
        require_positive(self.epsilon, "epsilon")


EstimatorFn = Callable[..., AdvantageOutput]
SignalCheck = Callable[["AdvantageConfig", int], "str | None"]


class AdvantageEstimator:
    """A registered estimator: checks its inputs, then calls the function without autograd."""

    def __init__(
        self,
        name: str,
        fn: EstimatorFn,
        needs_values: bool,
        needs_baseline: bool,
        needs_groups: bool,
        signal_check: SignalCheck | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.needs_values = needs_values  # the trainer must run a critic to get `values`
        self.needs_baseline = needs_baseline  # the trainer must run a greedy rollout for `reward_baselines`
        self.needs_groups = needs_groups  # compares the samples of one prompt: a group of one gives 0 advantages
        self.signal_check = signal_check  # (config, group size) -> why every advantage would be 0, or None
        functools.update_wrapper(self, fn)

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray | Any,
        config: AdvantageConfig,
        values: torch.Tensor | None = None,
        reward_baselines: torch.Tensor | None = None,
    ) -> AdvantageOutput:
        _check_inputs(self, token_level_rewards, response_mask, index, values, reward_baselines)
        with torch.no_grad():
            return self.fn(token_level_rewards, response_mask, index, config, values, reward_baselines)

    def __repr__(self) -> str:
        flags = (
            f"needs_values={self.needs_values}, needs_baseline={self.needs_baseline}, needs_groups={self.needs_groups}"
        )
        return f"AdvantageEstimator({self.name!r}, {flags})"


_ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(
    name: str,
    *,
    needs_values: bool = False,
    needs_baseline: bool = False,
    needs_groups: bool = False,
    signal_check: SignalCheck | None = None,
) -> Callable[[EstimatorFn], AdvantageEstimator]:
    """Decorator: register an estimator function under `name` (duplicate names are rejected).

    The decorated name is bound to the registry entry, so direct calls check inputs too.
    ``signal_check(config, group_size)``: a reason when those settings give every advantage 0
    (the config check refuses them), else None.
    """
    return _ADV_ESTIMATORS.decorator(
        name, lambda fn: AdvantageEstimator(name, fn, needs_values, needs_baseline, needs_groups, signal_check)
    )


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    return _ADV_ESTIMATORS.get(name)


def list_adv_estimators() -> list[str]:
    """Registered estimator names, sorted."""
    return _ADV_ESTIMATORS.names()


def _check_inputs(
    est: AdvantageEstimator,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    values: torch.Tensor | None,
    baselines: torch.Tensor | None,
) -> None:
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"token_level_rewards and response_mask must both be (B, T); got {tuple(rewards.shape)} "
            f"and {tuple(mask.shape)}"
        )
    if len(index) != rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for a batch of {rewards.shape[0]}")
    if est.needs_values and values is None:
        raise ValueError(f"adv_estimator {est.name!r} needs `values` from a critic; none were given")
    if values is not None and values.shape != rewards.shape:
        raise ValueError(f"values must be (B, T) = {tuple(rewards.shape)}, got {tuple(values.shape)}")
    if est.needs_baseline and baselines is None:
        raise ValueError(
            f"adv_estimator {est.name!r} needs `reward_baselines` (B,) from a greedy rollout; none were given"
        )
    if baselines is not None and baselines.shape != rewards.shape[:1]:
        raise ValueError(f"reward_baselines must be (B,) = ({rewards.shape[0]},), got {tuple(baselines.shape)}")


# ---- helpers shared by the estimators -------------------------------------------------


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each sequence: (B, T) → (B,), the sum of rewards over the mask."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def group_ids(index: np.ndarray | Any) -> tuple[torch.Tensor, int]:
    """Map group ids (any hashables, length B) to dense ints: ((B,) long tensor, number of groups)."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()  # tensors hash by identity; use their values
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in np.asarray(index, dtype=object).tolist()]
    return torch.tensor(ids, dtype=torch.long), len(dense)


@dataclass
class GroupStats:
    """Per-sample statistics of the sample's group, each (B,) float64."""

    mean: torch.Tensor  # group mean of the scores
    std: torch.Tensor  # unbiased group std; 0 for a group of one
    size: torch.Tensor  # number of samples in the group
    constant: torch.Tensor  # bool: every score in the group is equal (includes groups of one)


def group_stats(scores: torch.Tensor, index: np.ndarray | Any) -> GroupStats:
    """Group mean / std / size of `scores` (B,), broadcast back to each sample, in float64."""
    gid, n_groups = group_ids(index)
    gid = gid.to(scores.device)
    s = scores.to(torch.float64)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=s.device)
    size = zeros.index_add(0, gid, torch.ones_like(s))
    mean = zeros.index_add(0, gid, s) / size
    sq_dev = zeros.index_add(0, gid, (s - mean[gid]) ** 2)
    var = torch.where(size > 1, sq_dev / (size - 1).clamp_min(1.0), zeros)
    g_max = zeros.scatter_reduce(0, gid, s, reduce="amax", include_self=False)
    g_min = zeros.scatter_reduce(0, gid, s, reduce="amin", include_self=False)
    return GroupStats(mean[gid], var.sqrt()[gid], size[gid], (g_max == g_min)[gid])


def to_tokens(seq_values: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Broadcast one value per sequence (B,) onto its response tokens: (B, T), 0 outside the mask."""
    tokens = seq_values.to(dtype)[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), tokens, torch.zeros((), dtype=dtype, device=tokens.device))
