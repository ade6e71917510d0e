"""The built-in rule-based scorers; importing this package registers them."""

from hybridflow.reward.scorers.arithmetic import score_arithmetic
from hybridflow.reward.scorers.calculator import score_calculator
from hybridflow.reward.scorers.countdown import score_countdown
from hybridflow.reward.scorers.gsm8k import score_gsm8k
from hybridflow.reward.scorers.math_boxed import score_math
from hybridflow.reward.scorers.reasoning_gym import score_reasoning_gym

__all__ = [
    "score_arithmetic",
    "score_calculator",
    "score_countdown",
    "score_gsm8k",
    "score_math",
    "score_reasoning_gym",
]
