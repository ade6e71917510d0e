"""Scorer of reasoning-gym tasks (hybridflow.data.tasks.reasoning_gym): the task's own verifier.

The ground truth names the entry (task, settings, dataset seed, index); the scorer regenerates that exact entry and
calls the dataset's ``score_answer`` on the answer: the text of the response's last ``<answer>...</answer>`` pair
(reasoning-gym's own extraction and convention), or, in a response without tags, the whole response, stripped: the
prompt asks for only the answer, which small models give without tags. A bare reply ending in a period is scored both
as written and with the period dropped, and keeps the better score: "42." is the answer 42 with a full stop, while a
sentence-answer task (sentence_reordering) needs its own final period. The score is the
task's (some give partial credit, e.g. for a reply that contains the answer); ``acc`` is 1 for a full score.
reasoning-gym is imported on first use, so the other scorers never need it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from hybridflow.reward.registry import register_scorer_family

INSTALL_FIX = "install it: pip install reasoning-gym==0.1.25 (the project's test extra has it)"


@lru_cache(maxsize=256)
def _dataset(task: str, config_json: str, seed: int, size: int):
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(f"scoring reasoning-gym rows needs the reasoning-gym package: {INSTALL_FIX}") from error
    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config_json))


def entry_of(ground_truth: str | dict) -> tuple[Any, dict[str, Any]]:
    """(dataset, entry) named by a row's ground truth."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    dataset = _dataset(
        truth["task"], json.dumps(truth["config"], sort_keys=True), int(truth["seed"]), int(truth["size"])
    )
    return dataset, dataset[int(truth["index"])]


@register_scorer_family("reasoning_gym")
def score_reasoning_gym(solution_str: str, ground_truth: str | dict, extra_info: dict | None = None) -> dict[str, Any]:
    """See the module docstring."""
    from reasoning_gym.utils import extract_answer

    dataset, entry = entry_of(ground_truth)
    pred = extract_answer(solution_str, "answer")
    candidates = [pred] if pred is not None else _bare_answers(solution_str)
    best_score, best = 0.0, candidates[0] if candidates else ""
    for candidate in candidates:
        score = float(dataset.score_answer(candidate, entry)) if candidate else 0.0
        if score > best_score:
            best_score, best = score, candidate
    return {"score": best_score, "acc": float(best_score >= 1.0), "pred": best or ""}


def _bare_answers(solution_str: str) -> list[str]:
    """A reply without tags as its answer: as written (stripped), then without a final period."""
    whole = solution_str.strip()
    without_period = whole.removesuffix(".").strip()
    return [whole, without_period] if without_period != whole else [whole]
