"""The countdown scorer: correct equations, the format score, and inputs that must never be run."""

import json
import time

import pytest

from hybridflow.reward import score_countdown
from hybridflow.reward.scorers.countdown import FORMAT_SCORE

TRUTH = json.dumps({"target": 24, "numbers": [2, 3, 4, 6]})


def answer(equation: str) -> str:
    return f"Let me try. <answer>{equation}</answer>"


@pytest.mark.parametrize(
    "response, score",
    [
        (answer("(6 - 2) * 3 + 0 * 4"), FORMAT_SCORE),  # 0 is not a given number
        (answer("6 * 4 * (3 - 2)"), 1.0),
        (answer("(3 - 2) * 4 * 6"), 1.0),
        (answer("6 / (3 - 2) * 4"), 1.0),
        (answer("4 * 6 / (3 - 2) = 24"), 1.0),  # a right-hand side is tolerated
        (answer("2 * 3 * 4"), FORMAT_SCORE),  # 6 unused
        (answer("6 * 4 * (3 - 2) * 2"), FORMAT_SCORE),  # 2 reused
        (answer("6 * 4 + 3 - 2"), FORMAT_SCORE),  # right numbers, wrong value (25)
        (answer("6 * 4 * 1"), FORMAT_SCORE),  # wrong numbers
        (answer("6 / (3 - 3) + 4 * 2"), FORMAT_SCORE),  # division by zero: no value
        (answer("2 ** 3 * 3 + 0"), 0.0),  # ** is not allowed
        (answer("-2 + 6 * 4 + 3 - 1"), 0.0),  # no unary minus
        (answer("2.0 * 3 * 4 * 1"), 0.0),  # integers only
        (answer("__import__('os').system('true')"), 0.0),
        (answer("six times four"), 0.0),
        (answer(""), 0.0),
        ("6 * 4 * (3 - 2)", 0.0),  # no tags
        ("<answer>6 * 4 * (3 - 2)", 0.0),  # unclosed tag
        (answer("1 + 1") + answer("6 * 4 * (3 - 2)"), 1.0),  # the last answer counts
        (answer("6 * 4 * (3 - 2)") + answer("1 + 1"), FORMAT_SCORE),
        (answer("6 \u00d7 4 \u00d7 (3 \u2212 2)"), 1.0),  # Unicode operators
    ],
)
def test_countdown(response, score):
    assert score_countdown(response, TRUTH)["score"] == pytest.approx(score)


def test_fractions_on_the_way_are_exact():
    truth = json.dumps({"target": 24, "numbers": [1, 3, 4, 6]})
    assert score_countdown(answer("6 / (1 - 3 / 4)"), truth)["score"] == 1.0


def test_accepts_a_dict_ground_truth():
    assert score_countdown(answer("6 * 4 * (3 - 2)"), {"target": 24, "numbers": [2, 3, 4, 6]})["acc"] == 1.0


def test_hostile_inputs_are_fast_and_score_zero():
    start = time.perf_counter()
    hostile = [
        "9 ** 9 ** 9 ** 9",
        "9" * 100000,
        "(" * 5000 + "1" + ")" * 5000,
        "1" + " * 999999999" * 30,
        "\x00",
    ]
    for equation in hostile:
        assert score_countdown(answer(equation), TRUTH)["score"] == 0.0
    assert time.perf_counter() - start < 1.0


def test_many_huge_products_of_given_numbers_are_bounded():
    numbers = [99] * 60
    truth = json.dumps({"target": 1, "numbers": numbers})
    result = score_countdown(answer(" * ".join(["99"] * 60)), truth)  # over the length cap: not evaluated
    assert result["score"] == 0.0
