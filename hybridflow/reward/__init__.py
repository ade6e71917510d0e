"""Rewards: rule-based scorers by data source, the reward manager, user reward functions.

from hybridflow.reward import RewardManager, register_scorer

@register_scorer("my_task")
def score(solution_str, ground_truth, extra_info=None): ...

result = RewardManager(tokenizer)(rollout_batch)  # result.token_level_scores: (B, R)
"""

from hybridflow.reward.config import CustomRewardFunctionConfig, RewardConfig
from hybridflow.reward.custom import load_custom_reward_fn
from hybridflow.reward.manager import RewardFailure, RewardManager, RewardResult, check_scorable
from hybridflow.reward.registry import (
    UnknownDataSourceError,
    get_scorer,
    list_scorers,
    register_scorer,
    register_scorer_family,
)
from hybridflow.reward.scorers import score_arithmetic, score_countdown, score_gsm8k, score_math

__all__ = [
    "CustomRewardFunctionConfig",
    "RewardConfig",
    "RewardFailure",
    "RewardManager",
    "RewardResult",
    "UnknownDataSourceError",
    "check_scorable",
    "get_scorer",
    "list_scorers",
    "load_custom_reward_fn",
    "register_scorer",
    "register_scorer_family",
    "score_arithmetic",
    "score_countdown",
    "score_gsm8k",
    "score_math",
]
