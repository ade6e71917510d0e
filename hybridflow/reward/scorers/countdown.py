"""Scorer of the built-in `countdown` task: reach the target with each given number once.

The response must put its equation in <answer>...</answer> tags (the last pair counts):

  1.0            the equation uses each given number exactly once and equals the target;
  FORMAT_SCORE   the tags hold a well-formed equation (only the given operations and
                 integers), but it misses the target, uses other numbers, reuses or skips
                 one, or divides by zero: a small reward for the format, as in TinyZero;
  0.0            no tags, or anything that is not such an equation.

The equation is never passed to `eval`: it is parsed with `ast` and only integer literals,
parentheses and + - * / are accepted (no unary minus, no **, no names or calls), then
evaluated exactly with fractions. Checking the numbers before evaluating bounds the work.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from hybridflow.reward.registry import register_scorer

FORMAT_SCORE = 0.1
MAX_EQUATION_CHARS = 200  # far longer than any honest answer; caps parse and evaluation cost

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def parse_ground_truth(ground_truth: str | Mapping) -> tuple[int, list[int]]:
    """(target, numbers) from the JSON string the task writes, or from a dict with those keys."""
    data = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    return int(data["target"]), [int(n) for n in data["numbers"]]


def parse_equation(text: str) -> ast.expr | None:
    """The syntax tree of an equation made only of integers, parentheses and + - * /, else None."""
    text = text.strip().replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    if "=" in text:  # "3 + 4 = 7": judge the left side; the right side is the model's claim
        text = text.split("=", 1)[0]
    if not text or len(text) > MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _OPERATORS:
                return None
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                return None
        elif not isinstance(node, ast.operator):
            return None
    return tree


def used_numbers(tree: ast.expr) -> list[int]:
    """The integer literals of the equation, sorted."""
    return sorted(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))


def evaluate(tree: ast.expr) -> Fraction | None:
    """The exact value of a parsed equation; None on division by zero."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    left, right = evaluate(tree.left), evaluate(tree.right)
    if left is None or right is None or (isinstance(tree.op, ast.Div) and right == 0):
        return None
    return _OPERATORS[type(tree.op)](left, right)


@register_scorer("countdown")
def score_countdown(solution_str: str, ground_truth: str | Mapping, extra_info: dict | None = None) -> dict[str, Any]:
    """See the module docstring for the three score levels."""
    target, numbers = parse_ground_truth(ground_truth)
    answers = _ANSWER.findall(solution_str)
    tree = parse_equation(answers[-1]) if answers else None
    if tree is None:
        return {"score": 0.0, "acc": 0.0, "pred": answers[-1].strip() if answers else ""}
    pred = ast.unparse(tree)
    correct = used_numbers(tree) == sorted(numbers) and evaluate(tree) == target
    return {"score": 1.0 if correct else FORMAT_SCORE, "acc": float(correct), "pred": pred}
