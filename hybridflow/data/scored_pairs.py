"""Preference pairs from scored samples: for each prompt, answers the scorer rated higher chosen over ones it rated
lower (how ``hybridflow distill-data --format pairs`` makes DPO and reward-model data from a model's own samples).

The samples are SFT rows as ``distill-data`` writes them: ``messages`` (the prompt's, then the answer as the last,
assistant, message) and ``extra_info`` with the scorer's ``score`` and the prompt's ``source_index``. A pair row has
``prompt`` (the messages before the answer), ``chosen`` and ``rejected`` (the answers' text), ``margin`` (the
difference of their scores, for ``data.margin_key``), ``data_source`` and ``extra_info`` (the prompt's index and both
scores).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO


def pairs_from_samples(samples: list[dict[str, Any]], per_prompt: int = 1) -> list[dict[str, Any]]:
    """Up to ``per_prompt`` pairs per prompt, in the prompts' order: its best-scored answer over its worst, then the
    second best over the second worst, ... while the first scores higher (each answer in one pair at most; among
    equal scores the earlier sample first). A prompt whose answers all score the same gives none."""
    if per_prompt < 1:
        raise ValueError(f"per_prompt must be at least 1, got {per_prompt}")
    by_prompt: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for sample in samples:
        by_prompt[int(sample[EXTRA_INFO]["source_index"])].append(sample)
    rows = []
    for source_index, answers in by_prompt.items():
        ranked = sorted(answers, key=lambda s: -float(s[EXTRA_INFO]["score"]))  # stable: ties keep sample order
        for rank in range(min(per_prompt, len(ranked) // 2)):
            better, worse = ranked[rank], ranked[-1 - rank]
            high, low = float(better[EXTRA_INFO]["score"]), float(worse[EXTRA_INFO]["score"])
            if high <= low:
                break
            rows.append(
                {
                    "prompt": better["messages"][:-1],
                    "chosen": better["messages"][-1]["content"],
                    "rejected": worse["messages"][-1]["content"],
                    "margin": high - low,
                    DATA_SOURCE: better[DATA_SOURCE],
                    EXTRA_INFO: {"source_index": source_index, "chosen_score": high, "rejected_score": low},
                }
            )
    return rows
