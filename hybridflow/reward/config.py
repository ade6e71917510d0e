"""The user's own reward function (`custom_reward_function.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require


@dataclass(kw_only=True)
class CustomRewardFunctionConfig:
    path: str  # a Python file with the scoring function ("": built-in scorers by data_source)
    name: str  # the function's name: (data_source, solution_str, ground_truth, extra_info) -> float | dict

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "must name the function in custom_reward_function.path")
