"""The built-in `countdown` task: reach a target with + - * / using each given number once.

Every question is built from a random solution, so it is always solvable: draw 3 or 4
numbers in 1..MAX_NUMBER, then combine two random items at a time with a random operation
until one value is left, which becomes the target. Subtraction keeps intermediate values
non-negative and division must be exact, so the reference solution only ever holds whole
numbers (the scorer accepts any correct equation, fractions on the way included). Targets
must land in 1..MAX_TARGET. The ground truth is the JSON string {"target": ..., "numbers":
[...]}; the reference solution is kept in `extra_info["solution"]`.
"""

from __future__ import annotations

import json
import random
from typing import Any

from hybridflow.data.tasks.base import make_row, split_rng

DATA_SOURCE = "countdown"
MAX_NUMBER = 50
MAX_TARGET = 200
QUESTION = (
    "Using the numbers {numbers}, write an equation that equals {target}. "
    "You may use + - * / and parentheses, and must use each number exactly once. "
    "Give the final equation in <answer> </answer> tags, for example <answer>(1 + 2) * 3</answer>."
)


def draw_puzzle(rng: random.Random) -> tuple[list[int], int, str]:
    """(numbers, target, solution) with the solution an equation over exactly those numbers."""
    while True:
        numbers = [rng.randint(1, MAX_NUMBER) for _ in range(rng.choice((3, 4)))]
        items = [(n, str(n)) for n in numbers]  # (value, expression)
        while len(items) > 1:
            (a, ea), (b, eb) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            op = rng.choice("+-*/")
            if op == "-" and a < b:
                (a, ea), (b, eb) = (b, eb), (a, ea)
            if op == "/" and (b == 0 or a % b):
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            items.append((value, f"({ea} {op} {eb})"))
        target, solution = items[0]
        if 1 <= target <= MAX_TARGET:
            return numbers, target, solution[1:-1]  # drop the outermost parentheses


def make_rows(count: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`count` rows of `split`, the same for the same (split, seed)."""
    rng = split_rng(DATA_SOURCE, split, seed)
    rows = []
    for index in range(count):
        numbers, target, solution = draw_puzzle(rng)
        question = QUESTION.format(numbers=numbers, target=target)
        ground_truth = json.dumps({"target": target, "numbers": numbers})
        extra = {"split": split, "index": index, "solution": solution}
        rows.append(make_row(DATA_SOURCE, question, ground_truth, extra))
    return rows
