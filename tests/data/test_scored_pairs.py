"""Preference pairs from scored samples, by hand: the best answer over the worst, then the next ones, each answer
once, no pair between equal scores, the margin the scores' difference."""

import pytest

from hybridflow.data.scored_pairs import pairs_from_samples


def sample(source: int, answer: str, score: float) -> dict:
    return {
        "messages": [{"role": "user", "content": f"q{source}"}, {"role": "assistant", "content": answer}],
        "data_source": "arithmetic",
        "extra_info": {"source_index": source, "score": score, "acc": score},
    }


SAMPLES = [
    sample(0, "a", 0.0),
    sample(0, "b", 1.0),
    sample(0, "c", 0.0),
    sample(0, "d", 1.0),
    sample(1, "e", 0.0),
    sample(1, "f", 0.0),  # all the same: no pair
    sample(2, "g", 0.5),
    sample(2, "h", 1.0),
    sample(2, "i", 0.5),
]


def test_one_pair_per_prompt_is_its_best_answer_over_its_worst():
    got = pairs_from_samples(SAMPLES)
    assert [(r["chosen"], r["rejected"], r["margin"]) for r in got] == [("b", "c", 1.0), ("h", "i", 0.5)]
    assert got[0]["prompt"] == [{"role": "user", "content": "q0"}]
    assert got[0]["extra_info"] == {"source_index": 0, "chosen_score": 1.0, "rejected_score": 0.0}
    assert got[0]["data_source"] == "arithmetic"


def test_more_pairs_per_prompt_use_each_answer_once_and_stop_at_equal_scores():
    got = pairs_from_samples(SAMPLES, per_prompt=3)
    # prompt 0: b over c, then d over a; prompt 2: h over i, then g against g's equal: stop
    assert [(r["chosen"], r["rejected"]) for r in got] == [("b", "c"), ("d", "a"), ("h", "i")]
    with pytest.raises(ValueError, match="at least 1"):
        pairs_from_samples(SAMPLES, per_prompt=0)
