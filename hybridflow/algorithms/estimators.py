"""The built-in advantage estimators (config: `algorithm.adv_estimator`).

All share the signature documented in `advantage.py`; all outputs are (B, T) and 0
outside the response mask. Notation: s_i is sample i's sequence score (sum of its
token rewards), G(i) its group (same `uid`), mean/std are over G(i), std unbiased.
A group of one sample, or a group whose scores are all equal, gets advantage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.advantage import (
    AdvantageConfig,
    AdvantageEstimator,
    AdvantageOutput,
    SignalCheck,
    group_ids,
    group_stats,
    register_adv_estimator,
    sequence_scores,
    to_tokens,
)
from hybridflow.algorithms.masked import masked_whiten


@dataclass(frozen=True)
class EstimatorInputs:
    """The tensors of one estimator call, as advantage.py documents them (values and reward_baselines may be None)."""

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: np.ndarray | Any
    values: torch.Tensor | None
    reward_baselines: torch.Tensor | None

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of the advantages: the rewards', or float32 for integer rewards."""
        rewards = self.token_level_rewards
        return rewards.dtype if rewards.is_floating_point() else torch.float32

    def scores(self) -> torch.Tensor:
        """The sequence scores s_i: (B,)."""
        return sequence_scores(self.token_level_rewards, self.response_mask)


BuiltinEstimatorFn = Callable[[EstimatorInputs, AdvantageConfig], AdvantageOutput]
OutcomeEstimatorFn = Callable[[EstimatorInputs, AdvantageConfig], torch.Tensor]


def _named_like(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> None:
    """Give ``wrapper`` the name and docstring of ``fn`` (not ``__wrapped__``: callers use the wrapper's signature)."""
    for attribute in ("__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attribute, getattr(fn, attribute))


def _estimator(name: str, **needs: Any) -> Callable[[BuiltinEstimatorFn], AdvantageEstimator]:
    """``register_adv_estimator(name, **needs)`` for a function of (EstimatorInputs, config): the registry's
    signature is spelled once, here, instead of on every built-in estimator."""

    def decorator(fn: BuiltinEstimatorFn) -> AdvantageEstimator:
        def estimator(token_level_rewards, response_mask, index, config, values=None, reward_baselines=None):
            return fn(EstimatorInputs(token_level_rewards, response_mask, index, values, reward_baselines), config)

        _named_like(estimator, fn)
        return register_adv_estimator(name, **needs)(estimator)

    return decorator


def _outcome_estimator(
    name: str, *, whiten: bool = False, signal_check: SignalCheck | None = None
) -> Callable[[OutcomeEstimatorFn], AdvantageEstimator]:
    """Register a group estimator given as its advantage per sequence, fn(inputs, config) -> (B,).

    That advantage is put on every response token (and whitened over the batch's response tokens with ``whiten``);
    the returns are the advantages.
    """

    def decorator(fn: OutcomeEstimatorFn) -> AdvantageEstimator:
        def estimator(inputs: EstimatorInputs, config: AdvantageConfig) -> AdvantageOutput:
            per_sequence = fn(inputs, config).to(inputs.token_level_rewards.device)
            advantages = to_tokens(per_sequence, inputs.response_mask, inputs.float_dtype)
            if whiten:
                advantages = masked_whiten(advantages, inputs.response_mask)
            return advantages, advantages

        _named_like(estimator, fn)
        return _estimator(name, needs_groups=True, signal_check=signal_check)(estimator)

    return decorator


def _reverse_scan(step: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """y_t = step_t + decay · y_next over the response tokens, right to left.

    step, mask: (B, T) → (B, T). Masked-out positions are skipped: they neither add to the
    running sum nor reset it (so tokens inserted between turns, e.g. tool output, do not cut
    the return), and their output is 0.
    """
    keep = mask.bool()
    running = step.new_zeros(step.shape[0])
    out = []
    for t in reversed(range(step.shape[1])):
        candidate = step[:, t] + decay * running
        running = torch.where(keep[:, t], candidate, running)
        out.append(torch.where(keep[:, t], candidate, torch.zeros_like(candidate)))
    return torch.stack(out[::-1], dim=1) if out else torch.zeros_like(step)


@_estimator("gae", needs_values=True)
def compute_gae_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> AdvantageOutput:
    """Generalized Advantage Estimation (Schulman et al. 2015), PPO with a critic.

    δ_t = r_t + γ V_{t+1} - V_t,  A_t = δ_t + γλ A_{t+1},  returns R_t = A_t + V_t,
    with V and A taken as 0 after the last response token. Masked-out tokens are skipped.
    With `gae_whiten` the advantages are whitened over all response tokens of the batch
    (returns are not). rewards, mask, values: (B, T) → advantages, returns: (B, T).
    """
    assert inputs.values is not None  # checked by the registry entry
    dtype = inputs.float_dtype
    keep = inputs.response_mask.bool()
    rewards = torch.where(keep, inputs.token_level_rewards.to(dtype), 0.0)
    values = torch.where(keep, inputs.values.to(dtype), 0.0)
    next_value = rewards.new_zeros(rewards.shape[0])
    last_adv = rewards.new_zeros(rewards.shape[0])
    adv_cols = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        adv_t = delta + config.gamma * config.lam * last_adv
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        last_adv = torch.where(keep[:, t], adv_t, last_adv)
        adv_cols.append(adv_t)
    raw = torch.stack(adv_cols[::-1], dim=1) if adv_cols else torch.zeros_like(rewards)
    advantages = torch.where(keep, raw, 0.0)
    returns = torch.where(keep, advantages + values, 0.0)
    if config.gae_whiten:
        advantages = masked_whiten(advantages, inputs.response_mask)
    return advantages, returns


@_outcome_estimator("grpo")
def compute_grpo_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (s_i - mean_G) / (std_G + ε) on every token.

    With `norm_adv_by_std_in_grpo=False`, A_i = s_i - mean_G (Dr.GRPO, Liu et al. 2025).
    (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores()
    stats = group_stats(scores, inputs.index)
    adv = scores.to(torch.float64) - stats.mean
    if config.norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + config.epsilon)
    return torch.where(stats.constant, 0.0, adv)


@_outcome_estimator("rloo")
def compute_rloo_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j in G(i), j != i} s_j = n/(n-1)·(s_i - mean_G).

    (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores()
    stats = group_stats(scores, inputs.index)
    n = stats.size
    adv = (scores.to(torch.float64) - stats.mean) * n / (n - 1).clamp_min(1.0)
    return torch.where(stats.constant, 0.0, adv)


@_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): discounted return G_t = Σ_{u>=t} γ^{u-t} r_u, whitened over the batch.

    returns = G: (B, T); advantages = whiten(G) over all response tokens: (B, T).
    """
    rewards = inputs.token_level_rewards.to(inputs.float_dtype)
    returns = _reverse_scan(rewards, inputs.response_mask, config.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@_outcome_estimator("reinforce_plus_plus_baseline", whiten=True)
def compute_reinforce_plus_plus_baseline_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): s_i - mean_G on every token, then whitened over the batch.

    (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores()
    stats = group_stats(scores, inputs.index)
    return torch.where(stats.constant, 0.0, scores.to(torch.float64) - stats.mean)


@_estimator("remax", needs_baseline=True)
def compute_remax_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> AdvantageOutput:
    """ReMax (Li et al. 2023): A_t = Σ_{u>=t} r_u - b, b the score of the greedy response.

    rewards, mask: (B, T); reward_baselines: (B,). returns = Σ_{u>=t} r_u: (B, T);
    advantages = returns - b on the response tokens: (B, T).
    """
    assert inputs.reward_baselines is not None  # checked by the registry entry
    dtype = inputs.float_dtype
    returns = _reverse_scan(inputs.token_level_rewards.to(dtype), inputs.response_mask, 1.0)
    baselines = inputs.reward_baselines.to(dtype)[:, None]
    advantages = torch.where(inputs.response_mask.bool(), returns - baselines, 0.0)
    return advantages, returns


@_outcome_estimator("opo")
def compute_opo_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """OPO (Hao et al. 2025): A_i = s_i - b_G, b_G = Σ_j L_j s_j / Σ_j L_j (L_j = response length).

    The length-weighted baseline is the optimal one for sequence-level rewards.
    (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores().to(torch.float64)
    lengths = inputs.response_mask.bool().sum(dim=-1).to(torch.float64)
    gid, n_groups = group_ids(inputs.index)
    gid = gid.to(scores.device)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=scores.device)
    weighted = zeros.index_add(0, gid, lengths * scores)
    total_len = zeros.index_add(0, gid, lengths)
    baseline = (weighted / total_len.clamp_min(1.0))[gid]
    return torch.where(group_stats(scores, inputs.index).constant, 0.0, scores - baseline)


@_outcome_estimator("gpg")
def compute_gpg_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """GPG (Chu et al. 2025): A_i = α (s_i - mean_G) / F_norm, α = B / (B - M).

    M counts the samples whose group has all-equal scores (they carry no gradient), so α
    rescales the batch gradient to the informative samples. F_norm is 1, or the group std
    with `gpg_norm_by_std`. (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores()
    stats = group_stats(scores, inputs.index)
    batch = float(scores.shape[0])
    n_invalid = float(stats.constant.sum().item())
    alpha = batch / max(batch - n_invalid, 1.0)
    adv = scores.to(torch.float64) - stats.mean
    if config.gpg_norm_by_std:
        adv = adv / (stats.std + config.epsilon)
    return torch.where(stats.constant, 0.0, alpha * adv)


def _pass_at_k_values(group_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one group of n scores (n,), the k-subset statistics of Pass@k training.

    Returns (E[max of a random k-subset], E[max²] of it, per-sample E[max of a random k-subset
    that contains that sample]) with k clamped to n; the last is (n,) in the input order.
    """
    n = group_scores.numel()
    k = min(k, n)
    order = torch.argsort(group_scores)
    s = group_scores[order]  # ascending
    # P(the j-th smallest, j = 1..n, is the max of a random k-subset) = C(j-1, k-1) / C(n, k)
    p_max = torch.tensor([math.comb(j - 1, k - 1) / math.comb(n, k) for j in range(1, n + 1)], dtype=s.dtype)
    mean_max = (p_max * s).sum()
    mean_max_sq = (p_max * s * s).sum()
    if k == 1:
        per_sample_sorted = s.clone()
    else:
        # Subsets containing sample i: i plus a random (k-1)-subset of the other n-1 samples.
        p_other = torch.tensor([math.comb(j - 1, k - 2) / math.comb(n - 1, k - 1) for j in range(1, n)], dtype=s.dtype)
        off_diag = ~torch.eye(n, dtype=torch.bool)
        others = s.expand(n, n)[off_diag].view(n, n - 1)  # row i: the others, still ascending
        per_sample_sorted = (torch.maximum(s[:, None], others) * p_other).sum(dim=-1)
    per_sample = torch.empty_like(per_sample_sorted)
    per_sample[order] = per_sample_sorted
    return mean_max, mean_max_sq, per_sample


@_outcome_estimator("grpo_passk")
def compute_grpo_passk_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """Pass@k GRPO as verl defines ``grpo_passk``: only the best sample of each group is pushed.

    A = (s_best - s_second) / (std_G + ε) for the group's best sample (the first of equal bests),
    0 for the others; no std division when `norm_adv_by_std_in_grpo` is false. A group of one
    gets 0 (verl raises). (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores().to(torch.float64).cpu()
    gid, n_groups = group_ids(inputs.index)
    stats = group_stats(scores, inputs.index)
    adv = torch.zeros_like(scores)
    for g in range(n_groups):
        members = (gid == g).nonzero(as_tuple=True)[0]
        if len(members) < 2:
            continue
        top = torch.topk(scores[members], 2)
        gap = top.values[0] - top.values[1]
        if config.norm_adv_by_std_in_grpo:
            gap = gap / (stats.std[members[0]] + config.epsilon)
        adv[members[top.indices[0]]] = gap
    return adv


def _pass_at_k_signal(config: AdvantageConfig, group_size: int) -> str | None:
    if config.pass_k >= group_size:
        return (
            f"algorithm.pass_k={config.pass_k} is not below rollout.n={group_size}: every k-subset is the whole "
            "group and every advantage is 0; set pass_k below rollout.n"
        )
    return None


@_outcome_estimator("pass_at_k", signal_check=_pass_at_k_signal)
def compute_pass_at_k_outcome_advantage(inputs: EstimatorInputs, config: AdvantageConfig) -> torch.Tensor:
    """Pass@k advantage (Chen et al. 2025, "Pass@k Training"), analytical form.

    The reward of a k-subset of a group is its best score (pass@k for 0/1 rewards). Over all
    k-subsets of the group: R̄ = E[max], σ = std[max]; sample i's advantage is
    (E[max of the k-subsets containing i] - R̄) / (σ + ε). For 0/1 rewards with N samples of
    which N_neg fail this is the paper's closed form: R̄ = 1 - C(N_neg,k)/C(N,k),
    σ = sqrt(R̄(1-R̄)), A_pos = (1-R̄)/σ, A_neg = (1 - R̄ - C(N_neg-1,k-1)/C(N-1,k-1))/σ.
    k = `pass_k`, clamped to the group size; no σ division when `norm_adv_by_std_in_grpo`
    is false. (B, T) → advantages = returns: (B, T).
    """
    scores = inputs.scores().to(torch.float64).cpu()
    gid, n_groups = group_ids(inputs.index)
    adv = torch.zeros_like(scores)
    for g in range(n_groups):
        members = (gid == g).nonzero(as_tuple=True)[0]
        mean_max, mean_max_sq, per_sample = _pass_at_k_values(scores[members], config.pass_k)
        group_adv = per_sample - mean_max
        if config.norm_adv_by_std_in_grpo:
            std_max = (mean_max_sq - mean_max**2).clamp_min(0.0).sqrt()
            group_adv = group_adv / (std_max + config.epsilon)
        if bool((scores[members] == scores[members][0]).all()):
            group_adv = torch.zeros_like(group_adv)
        adv[members] = group_adv
    return adv
