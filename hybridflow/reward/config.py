"""The user's own reward function (`custom_reward_function.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.reward.shaping import OverlongBufferConfig
from hybridflow.validation import require


@dataclass(kw_only=True)
class CustomRewardFunctionConfig:
    """Your own reward function in a Python file, instead of the built-in scorers."""

    path: str  # a Python file with the scoring function ("": built-in scorers by data_source)
    name: str  # the function's name: (data_source, solution_str, ground_truth, extra_info) -> float | dict

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "must name the function in custom_reward_function.path")


@dataclass(kw_only=True)
class RewardConfig:
    """How the reward manager scores responses and when scoring failures stop the run."""

    max_failure_rate: float  # stop when more than this fraction of a call's samples fail to score (0: any failure)
    num_examine: int  # print this many decoded responses per data source on each scoring call
    # DAPO's soft overlong penalty on training rewards (validation scores stay as scored)
    overlong_buffer: OverlongBufferConfig
    # multi-turn: weight of the tools' rewards (per call and per trajectory) added to the score (0: none)
    tool_reward_coef: float
    # multi-turn: each turn's tool rewards on that turn's last token (false: all on the response's last)
    turn_level: bool

    def __post_init__(self) -> None:
        require(0 <= self.max_failure_rate <= 1, "max_failure_rate", f"must be in [0, 1], got {self.max_failure_rate}")
        require(self.num_examine >= 0, "num_examine", f"must be >= 0, got {self.num_examine}")
