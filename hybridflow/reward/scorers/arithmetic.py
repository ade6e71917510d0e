"""Scorer of the built-in `arithmetic` task (hybridflow.data.tasks.arithmetic).

The prompt asks for just the number. A small model often answers "7 + 5 = 12" or "The
answer is 12.", so the prediction is the number after the last "####" when there is one,
else the last number in the response. Rewarding the last number teaches the model to end
with its answer; it never rewards a number that is merely mentioned earlier.
"""

from __future__ import annotations

from typing import Any

from hybridflow.reward.registry import register_scorer
from hybridflow.reward.scorers.numbers import find_numbers, same_number


def extract_final_number(solution_str: str) -> str | None:
    """The number after the last "####", else the last number in the text; None if there is none."""
    if "####" in solution_str:
        after = find_numbers(solution_str.rsplit("####", 1)[1])
        if after:
            return after[0]
    numbers = find_numbers(solution_str)
    return numbers[-1] if numbers else None


@register_scorer("arithmetic")
def score_arithmetic(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict[str, Any]:
    """1.0 if the final number equals the ground truth (exactly, as a fraction), else 0.0."""
    pred = extract_final_number(solution_str)
    correct = same_number(pred, ground_truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
