"""The arithmetic and gsm8k scorers on hand-written responses."""

import pytest

from hybridflow.reward import get_scorer, score_arithmetic, score_gsm8k
from hybridflow.reward.scorers.numbers import find_numbers, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5-4 = 1", ["5", "4", "1"]),  # binary minus is not a sign
        ("it is -4.", ["-4"]),
        ("\u22127", ["-7"]),  # Unicode minus
        ("$1,234.50 and 1,2,3", ["1234.50", "1", "2", "3"]),
        ("no digits here", []),
        ("(3)-2", ["3", "2"]),
    ],
)
def test_find_numbers(text, expected):
    assert find_numbers(text) == expected


def test_parse_number_rejects_non_numbers_and_huge_runs():
    assert parse_number("12.0") == 12
    assert parse_number("1/2") is None
    assert parse_number("1" * 500) is None


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("55", "55", 1.0),
        ("47 + 8 = 55", "55", 1.0),
        ("The answer is 55.", "55", 1.0),
        ("The answer is 55.0", "55", 1.0),
        ("#### 55", "55", 1.0),
        ("#### 55 because 47 + 8 = 56", "55", 1.0),  # "####" wins over the last number
        ("55 is what you get from 47 + 8", "55", 0.0),  # the last number is 8
        ("47 + 8 = 54", "55", 0.0),
        ("I don't know", "55", 0.0),
        ("", "55", 0.0),
        ("93 - 18 = 75", "75", 1.0),
        ("5 - 9 = -4", "-4", 1.0),
        ("the result is 1,085", "1085", 1.0),
    ],
)
def test_arithmetic(response, truth, score):
    result = score_arithmetic(response, truth)
    assert result["score"] == score and result["acc"] == score


def test_arithmetic_reports_its_prediction():
    assert score_arithmetic("so 3 + 4 = 8", "7")["pred"] == "8"
    assert score_arithmetic("nothing", "7")["pred"] == ""


@pytest.mark.parametrize(
    "response, truth, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),
        ("#### 1,000", "1000", 1.0, 1.0),
        ("#### $18", "18", 1.0, 1.0),
        ("The answer is 18.00", "18", 0.0, 1.0),  # no "####": strict gives nothing
        ("#### 17\nWait, no: 18", "18", 0.0, 1.0),
        ("#### 18\nso 18 it is, not 17", "18", 1.0, 0.0),
        ("#### eighteen", "18", 0.0, 0.0),
        ("", "18", 0.0, 0.0),
        ("#### -3", "-3", 1.0, 1.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert score_gsm8k(response, truth)["score"] == strict
    assert score_gsm8k(response, truth, method="flexible")["score"] == flexible


def test_gsm8k_is_registered_under_both_names():
    assert get_scorer("gsm8k") is score_gsm8k
    assert get_scorer("openai/gsm8k") is score_gsm8k


def test_gsm8k_unknown_method():
    with pytest.raises(ValueError, match="strict"):
        score_gsm8k("#### 1", "1", method="lenient")
