"""What every built-in task shares: the row layout and a seeded generator per split."""

from __future__ import annotations

import random
from typing import Any

from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO, REWARD_MODEL


def make_row(data_source: str, question: str, ground_truth: str, extra_info: dict[str, Any]) -> dict[str, Any]:
    """One dataset row: a single user message, the rule-based ground truth, extras."""
    return {
        DATA_SOURCE: data_source,
        "prompt": [{"role": "user", "content": question}],  # the default data.prompt_key
        REWARD_MODEL: {"ground_truth": ground_truth, "style": "rule"},
        EXTRA_INFO: extra_info,
    }


def split_rng(task: str, split: str, seed: int) -> random.Random:
    """A generator for one (task, split, seed): train and test draw independent streams.

    A string seed is hashed with SHA-512 by `random`, so it is the same in every process
    (unlike `hash()`, which PYTHONHASHSEED randomises).
    """
    return random.Random(f"{task}:{split}:{seed}")
