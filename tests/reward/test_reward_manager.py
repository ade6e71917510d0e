"""RewardManager: score placement at the last response token, extras, metrics, failures."""

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
from reward_configs import TOLERANT

from hybridflow.reward import RewardFailure, RewardManager, register_scorer


@register_scorer("test_manager_raises")
def _raises(solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("scorer bug")


@register_scorer("test_manager_nan")
def _nan(solution_str, ground_truth, extra_info=None):
    return math.nan


@register_scorer("test_manager_text")
def _text(solution_str, ground_truth, extra_info=None):
    return {"score": "high"}


@register_scorer("test_manager_numpy")
def _numpy(solution_str, ground_truth, extra_info=None):
    return {"score": np.float32(0.25), "acc": np.bool_(True)} if solution_str == "1" else torch.tensor(0.75)


@register_scorer("test_manager_extra")
def _extra(solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "length": len(solution_str), "tag": extra_info["tag"]}


def test_scores_sit_on_the_last_real_token(make_batch, tiny_tokenizer):
    tok = tiny_tokenizer
    digit = tok.convert_tokens_to_ids
    assert tok.encode("3+4=7", add_special_tokens=False) == [digit("3"), digit("+"), digit("4"), digit("="), digit("7")]
    # with the eos token: "12" is 3 tokens (last index 2), "7" is 2 (index 1), "3+4=7" is 6 (index 5)
    batch = make_batch(tok, ["12", "7", "3+4=7"], ["arithmetic"] * 3, ["12", "8", "7"])
    result = RewardManager(tok, TOLERANT)(batch)
    expected = torch.zeros(3, 8)
    expected[0, 2] = 1.0
    expected[2, 5] = 1.0  # row 1 ("7" for 8) is wrong: all zeros
    assert result.token_level_scores.dtype == torch.float32
    assert torch.equal(result.token_level_scores, expected)
    assert result.extra["score"] == [1.0, 0.0, 1.0]
    assert result.extra["acc"] == [1.0, 0.0, 1.0]
    assert result.extra["pred"] == ["12", "7", "7"]
    assert result.metrics["reward/arithmetic/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/scorer_failures"] == 0


def test_decoding_skips_special_tokens(make_batch, tiny_tokenizer):
    tok = tiny_tokenizer
    texts = []

    def custom(data_source, solution_str, ground_truth, extra_info):
        texts.append(solution_str)
        return 0.0

    ids = [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("hi", add_special_tokens=False)
    RewardManager(tok, TOLERANT, custom_fn=custom)(make_batch(tok, [ids + [tok.eos_token_id]], ["x"], ["y"]))
    assert texts == ["hi"]


def test_mixed_sources_and_per_source_means(make_batch, tiny_tokenizer):
    batch = make_batch(
        tiny_tokenizer,
        ["#### 5", "5", "#### 6", "4"],
        ["openai/gsm8k", "openai/gsm8k", "arithmetic", "arithmetic"],
        ["5", "5", "6", "6"],
    )
    result = RewardManager(tiny_tokenizer, TOLERANT)(batch)
    assert result.extra["score"] == [1.0, 0.0, 1.0, 0.0]  # strict gsm8k needs "####"
    assert result.metrics["reward/openai/gsm8k/mean"] == 0.5
    assert result.metrics["reward/arithmetic/mean"] == 0.5
    assert result.token_level_scores.sum(dim=1).tolist() == [1.0, 0.0, 1.0, 0.0]


def test_failures_score_zero_are_counted_and_logged_once(make_batch, tiny_tokenizer, caplog):
    sources = ["test_manager_raises", "arithmetic", "test_manager_raises", "test_manager_nan", "test_manager_text"]
    batch = make_batch(tiny_tokenizer, ["1", "2", "3", "4", "5"], sources, ["1", "2", "3", "4", "5"])
    manager = RewardManager(tiny_tokenizer, TOLERANT)
    with caplog.at_level(logging.WARNING, logger="hybridflow.reward.manager"):
        result = manager(batch)
        manager(batch)
    assert result.extra["score"] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert result.extra["failed"] == [True, False, True, True, True]
    assert result.metrics["reward/scorer_failures"] == 4
    assert result.metrics["reward/test_manager_raises/mean"] == 0.0
    assert result.token_level_scores.sum().item() == 1.0
    raised = [r for r in caplog.records if "test_manager_raises" in r.getMessage()]
    assert len(raised) == 1 and "scorer bug" in raised[0].getMessage() and raised[0].exc_info is not None
    assert len(caplog.records) == 3  # one per kind (raise, nan, non-number), not per sample or per call


def test_unknown_data_source_is_a_counted_failure(make_batch, tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["1"], ["no_such_source"], ["1"])
    result = RewardManager(tiny_tokenizer, TOLERANT)(batch)
    assert result.metrics["reward/scorer_failures"] == 1


def test_scorer_extras_become_per_sample_lists(make_batch, tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["ab", "7"], ["test_manager_extra", "arithmetic"], ["x", "7"])
    result = RewardManager(tiny_tokenizer, TOLERANT)(batch)
    assert result.extra["length"] == [2, None]
    assert result.extra["tag"] == [0, None]
    assert result.extra["acc"] == [0.5, 1.0]  # no acc from the scorer: its score stands in
    assert result.extra["pred"] == [None, "7"]
    assert result.token_level_scores[0, 2].item() == 0.5


def test_custom_function_scores_every_sample(make_batch, tiny_tokenizer):
    calls = []

    def custom(data_source, solution_str, ground_truth, extra_info):
        calls.append((data_source, solution_str, ground_truth, extra_info["tag"]))
        return float(len(solution_str))

    batch = make_batch(tiny_tokenizer, ["ab", "abc"], ["anything", "arithmetic"], ["g0", "g1"])
    result = RewardManager(tiny_tokenizer, TOLERANT, custom_fn=custom)(batch)
    assert calls == [("anything", "ab", "g0", 0), ("arithmetic", "abc", "g1", 1)]
    assert result.extra["score"] == [2.0, 3.0]


def test_empty_response_and_full_width_response(make_batch, tiny_tokenizer):
    tok = tiny_tokenizer
    seven = tok.encode("7", add_special_tokens=False)
    full = seven * 4  # no eos, fills the whole width: the last token is at index 3
    batch = make_batch(tok, [[], full], ["arithmetic", "arithmetic"], ["7", "7777"], width=4)
    result = RewardManager(tok, TOLERANT)(batch)
    assert result.extra["score"] == [0.0, 1.0]
    assert result.token_level_scores[1].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert result.token_level_scores[0].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_numpy_and_torch_scalars_are_numbers(make_batch, tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["1", "2"], ["test_manager_numpy"] * 2, ["", ""])
    result = RewardManager(tiny_tokenizer, TOLERANT)(batch)
    assert result.extra["score"] == [0.25, 0.75]
    assert result.metrics["reward/scorer_failures"] == 0


def test_too_many_failures_stop_with_the_first_traceback(make_batch, tiny_tokenizer):
    sources = ["arithmetic", "test_manager_raises", "arithmetic", "arithmetic"]
    batch = make_batch(tiny_tokenizer, ["1", "2", "3", "4"], sources, ["1", "2", "3", "4"])
    RewardManager(tiny_tokenizer, dataclasses.replace(TOLERANT, max_failure_rate=0.25))(batch)  # 1 of 4: allowed
    with pytest.raises(RewardFailure, match="1 of 4 samples failed") as caught:
        RewardManager(tiny_tokenizer, dataclasses.replace(TOLERANT, max_failure_rate=0.2))(batch)
    assert "ZeroDivisionError: scorer bug" in str(caught.value) and "in _raises" in str(caught.value)


def row(source: str, truth: str = "7") -> dict:
    return {"data_source": source, "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": {}}


def test_rows_without_a_scorer_are_found_before_training(tiny_tokenizer):
    manager = RewardManager(tiny_tokenizer, TOLERANT)
    manager.check_scorable([row("arithmetic"), row("gsm8k")])
    with pytest.raises(RewardFailure, match="no reward scorer for data_source 'my_task' \\(2 rows\\)"):
        manager.check_scorable([row("arithmetic"), row("my_task"), row("my_task")])


def good(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth)}


def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan


def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None


def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"


def raises(data_source, solution_str, ground_truth, extra_info=None):
    return 1 / 0


def too_few_arguments(solution_str):
    return 1.0


@pytest.mark.parametrize(
    "fn, message",
    [
        (returns_nan, "not a finite number"),
        (returns_none, "not a finite number"),
        (returns_text, "not a finite number"),
        (raises, "ZeroDivisionError"),
        (too_few_arguments, "TypeError"),
    ],
)
def test_a_custom_function_must_score_a_real_row_before_training(tiny_tokenizer, fn, message):
    RewardManager(tiny_tokenizer, TOLERANT, custom_fn=good).check_scorable([row("my_task")])  # any data source
    with pytest.raises(RewardFailure, match=message):
        RewardManager(tiny_tokenizer, TOLERANT, custom_fn=fn).check_scorable([row("my_task")])
