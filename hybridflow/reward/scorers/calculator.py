"""Scorer of the built-in multi-turn `calculator` task (hybridflow.data.tasks.calculator).

The answer is the final number of the model's last turn (``extra_info["final_response"]``, which the
reward manager adds for multi-turn rows), so a number that only the tool printed earlier in the
conversation never counts: the model has to state it. Without that fact (one-shot generation) it
reads the whole response, like the `arithmetic` scorer.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch_keys import FINAL_RESPONSE
from hybridflow.reward.registry import register_scorer
from hybridflow.reward.scorers.arithmetic import extract_final_number
from hybridflow.reward.scorers.numbers import same_number


@register_scorer("calculator")
def score_calculator(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict[str, Any]:
    """1.0 if the last turn's final number equals the ground truth, else 0.0."""
    answer = (extra_info or {}).get(FINAL_RESPONSE, solution_str)
    pred = extract_final_number(answer)
    correct = same_number(pred, ground_truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
