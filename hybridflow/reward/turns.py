"""Where the rewards of a multi-turn trajectory go: the outcome score and its tools' rewards, on tokens.

A trajectory earns a score from the reward function (on its last generated token) and, from its tools,
a reward per assistant turn (its calls' rewards: ``turn_scores``) and one per tool for the whole
trajectory (``tool_rewards``). ``coef`` weighs the tools' rewards (0: only the reward function's score).
With ``turn_level`` each turn's reward sits on that turn's last token, so estimators with token-level
returns (GAE, REINFORCE++) credit a turn with what it and later turns earned, not earlier ones;
without it every reward is summed on the last generated token (all an outcome estimator such as GRPO
reads anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def place_rewards(
    width: int,
    scores: torch.Tensor,
    last_generated: torch.Tensor,
    turn_ends: Sequence[Sequence[int]],
    turn_scores: Sequence[Sequence[float]],
    tool_rewards: Sequence[dict[str, float]],
    *,
    coef: float,
    turn_level: bool,
) -> torch.Tensor:
    """Token-level scores (B, width) float32.

    scores (B,): the reward function's score per row; last_generated (B,): the index of each row's last
    generated token (-1: none, then its rewards go to index 0, which no loss reads); turn_ends[i][k]: the
    index of row i's turn k's last token; turn_scores[i][k]: that turn's tool-call rewards;
    tool_rewards[i]: row i's per-tool trajectory rewards.
    """
    b = scores.shape[0]
    out = torch.zeros(b, width, dtype=torch.float32)
    last = last_generated.clamp(min=0)
    out[torch.arange(b), last] = scores.float()
    for i in range(b):
        final = coef * sum(tool_rewards[i].values()) if tool_rewards[i] else 0.0
        for end, turn_score in zip(turn_ends[i], turn_scores[i]):
            at = min(end, int(last[i])) if turn_level else int(last[i])
            out[i, at] += coef * turn_score
        out[i, last[i]] += final
    return out
