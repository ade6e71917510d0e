"""Scorer of GSM8K: the number after "#### ", as the dataset writes its answers.

`strict` (the default, used for training) takes the number after the last "#### " and gives
nothing without it, so RL learns the format; `flexible` takes the last number in the text
(useful to evaluate a model that was never taught the format). Commas and "$" are stripped
and values compare exactly ("1,000.00" equals "1000").
"""

from __future__ import annotations

import re
from typing import Any, Literal

from hybridflow.reward.registry import register_scorer
from hybridflow.reward.scorers.numbers import find_numbers, same_number

_STRICT = re.compile(r"#### *\$?(-?[\d,]*\.?\d+)")


def extract_gsm8k_answer(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The predicted answer, or None when the text has none in the required form."""
    if method == "strict":
        matches = _STRICT.findall(solution_str.replace("\u2212", "-"))
        return matches[-1].replace(",", "") if matches else None
    if method == "flexible":
        numbers = find_numbers(solution_str)
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")


@register_scorer("gsm8k", "openai/gsm8k")
def score_gsm8k(
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: Literal["strict", "flexible"] = "strict",
) -> dict[str, Any]:
    """1.0 for the right number, 0.0 for a wrong or missing one."""
    pred = extract_gsm8k_answer(solution_str, method)
    correct = same_number(pred, ground_truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
