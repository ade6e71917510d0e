"""The built-in `arithmetic` task: "What is 47 + 8? Answer with just the number."

Six kinds of question in equal shares (a round-robin over the rows), from easy to hard
for a 135M-parameter model:

  add1  a + b,  a, b in 0..9          add2  a + b,  a, b in 10..99
  sub1  a - b,  from 5..18 and 0..9   sub2  a - b,  a, b in 10..99
  mul1  a * b,  a, b in 2..9          mul2  a * b,  a in 10..99, b in 2..9

Subtraction puts the larger number first, so it never goes below zero. Greedy, with 32
new tokens, SmolLM2-135M-Instruct answers 40% of 100 test prompts correctly (see
`measure.py`): 0.6-0.8 of the single-digit questions, about a tenth of the two-digit ones,
so there is room to learn. The scorer
(`hybridflow.reward.scorers.arithmetic`) reads the last number of the response, which
matches how the model answers ("47 + 8 = 55", "The answer is 55.").
"""

from __future__ import annotations

import random
from typing import Any

from hybridflow.data.tasks.base import make_row, split_rng

DATA_SOURCE = "arithmetic"
QUESTION = "What is {a} {op} {b}? Answer with just the number."
LEVELS = ("add1", "sub1", "mul1", "add2", "sub2", "mul2")


def draw_question(level: str, rng: random.Random) -> tuple[int, str, int]:
    """(a, op, b) of one question of `level`."""
    if level == "add1":
        return rng.randint(0, 9), "+", rng.randint(0, 9)
    if level == "add2":
        return rng.randint(10, 99), "+", rng.randint(10, 99)
    if level == "sub1":
        a, b = rng.randint(5, 18), rng.randint(0, 9)
    elif level == "sub2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    elif level == "mul1":
        return rng.randint(2, 9), "*", rng.randint(2, 9)
    elif level == "mul2":
        return rng.randint(10, 99), "*", rng.randint(2, 9)
    else:
        raise ValueError(f"unknown arithmetic level {level!r}; known: {LEVELS}")
    return max(a, b), "-", min(a, b)


def answer(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def make_rows(count: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`count` rows of `split`, the same for the same (split, seed)."""
    rng = split_rng(DATA_SOURCE, split, seed)
    rows = []
    for index in range(count):
        level = LEVELS[index % len(LEVELS)]
        a, op, b = draw_question(level, rng)
        question = QUESTION.format(a=a, op=op, b=b)
        extra = {"split": split, "index": index, "level": level, "expression": f"{a} {op} {b}"}
        rows.append(make_row(DATA_SOURCE, question, str(answer(a, op, b)), extra))
    return rows
