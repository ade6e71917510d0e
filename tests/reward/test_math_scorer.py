"""The MATH scorer: boxed-answer extraction and normalisation."""

import pytest

from hybridflow.reward import get_scorer, score_math
from hybridflow.reward.scorers.math_boxed import last_boxed, normalize_answer


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces still balance
        (r"\boxed{\frac{1}{2}", None),  # never closes
        (r"\boxed 7$", "7"),
        (r"\fbox{3}", "3"),
        ("no box", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "raw, normal",
    [
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\tfrac34", r"\frac{3}{4}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"5\text{ cm}", "5"),
        (r"\text{(B)}", "(B)"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        ("x = 3", "3"),
        ("12.0", "12"),
        (".5", "0.5"),
        ("1,000", "1000"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"3\!\cdot\!4", r"3\cdot4"),
    ],
)
def test_normalize(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    "response, truth, score",
    [
        (r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{1/2}", "0.5", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{10\text{ inches}}", "10", 1.0),
        (r"\boxed{ 2 \sqrt{3} }", r"2\sqrt{3}", 1.0),
        (r"\boxed{x=7.0}", "7", 1.0),
        (r"\boxed{(1,2)}", r"\left(1, 2\right)", 1.0),
        (r"\boxed{5}", r"The answer is \boxed{5}", 1.0),  # a boxed ground truth
        (r"\boxed{\frac{1}{3}}", "0.33", 0.0),  # not equal, however close
        (r"\boxed{2}", "3", 0.0),
        (r"\boxed{\frac{1}{0}}", "1", 0.0),
        (r"\boxed{}", "", 0.0),  # empty never counts
        ("the answer is 5", "5", 0.0),  # no box
        (r"\boxed{5", "5", 0.0),  # unbalanced
    ],
)
def test_score_math(response, truth, score):
    assert score_math(response, truth)["score"] == score


def test_registered_names():
    assert get_scorer("math") is score_math and get_scorer("lighteval/MATH") is score_math
