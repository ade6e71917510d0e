"""The built-in multi-turn task `calculator`: arithmetic a small model cannot do in its head, with a calculator.

    "What is 734 * 58?"  ->  <tool_call>{"name": "calculator", "arguments": {"expression": "734 * 58"}}</tool_call>
                         <-  42572   (the tool's message)
                         ->  42572

Three kinds of question in equal shares: a three-digit times a two-digit number (mul), the sum of
two four-digit numbers (add), and a product plus a number (mix: "What is 56 * 37 + 418?"). The
prompt's system message says how to call the tool and one worked exchange (a multiplication: user
question, tool call, tool message, answer, as chat messages) shows it. On 60 test rows
(`hybridflow measure calculator --n 60 --tools examples/tools/calculator.yaml
--max-new-tokens 96 [--sample]`) SmolLM2-135M-Instruct, greedy, answers 0.25 (mul 0.60, add 0.05,
mix 0.10) and, sampled at temperature 1, 0.03; it calls the tool for 42 % (sampled: 17 %) of the
questions and answers none of the others right (0 of 35; sampled 0 of 50). So the tool is needed,
and RL has to teach when and how to call it beyond the one example. Rows run the `tool_agent` loop; the tools file is
examples/tools/calculator.yaml. The scorer (`hybridflow.reward.scorers.calculator`) reads the final
number of the model's last turn. ``--gold`` writes each row's correct conversation (``gold_messages``: the call,
the tool's message, the answer) for ``hybridflow sft``, the warm start before RL.
"""

from __future__ import annotations

import random
from typing import Any

from hybridflow.batch_keys import AGENT_NAME
from hybridflow.data.tasks.base import make_row, split_rng

DATA_SOURCE = "calculator"
LEVELS = ("mul", "add", "mix")
SYSTEM = (
    "You are a helpful assistant with a calculator. To use it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
    "and its result comes back to you. Then answer with just the number."
)


def _call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def _worked_example(question: str, expression: str, result: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": _call(expression)},
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": str(result)},
    ]


EXAMPLES = _worked_example("What is 482 * 37?", "482 * 37", 482 * 37)


def draw_expression(level: str, rng: random.Random) -> str:
    if level == "mul":
        return f"{rng.randint(100, 999)} * {rng.randint(11, 99)}"
    if level == "add":
        return f"{rng.randint(1000, 9999)} + {rng.randint(1000, 9999)}"
    if level == "mix":
        return f"{rng.randint(11, 99)} * {rng.randint(11, 99)} + {rng.randint(100, 999)}"
    raise ValueError(f"unknown calculator level {level!r}; known: {LEVELS}")


def evaluate(expression: str) -> int:
    """The value of a task expression (products of integers plus integers), computed without eval."""
    return sum(_product(term) for term in expression.split("+"))


def _product(term: str) -> int:
    value = 1
    for factor in term.split("*"):
        value *= int(factor)
    return value


def gold_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's conversation done right, for supervised fine-tuning: its prompt (the worked example's assistant
    turns marked untrained: they are part of the prompt), then the tool call, the tool's message and the answer,
    as the ``tool_agent`` loop would produce them."""
    expression = row["extra_info"]["expression"]
    result = str(evaluate(expression))
    prompt = [{**m, "train": False} if m["role"] == "assistant" else dict(m) for m in row["prompt"]]
    return [
        *prompt,
        {"role": "assistant", "content": _call(expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def make_rows(count: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`count` rows of `split`, the same for the same (split, seed)."""
    rng = split_rng(DATA_SOURCE, split, seed)
    rows = []
    for index in range(count):
        level = LEVELS[index % len(LEVELS)]
        expression = draw_expression(level, rng)
        extra = {"split": split, "index": index, "level": level, "expression": expression}
        row = make_row(DATA_SOURCE, f"What is {expression}?", str(evaluate(expression)), extra)
        row["prompt"] = [{"role": "system", "content": SYSTEM}, *EXAMPLES, *row["prompt"]]
        row[AGENT_NAME] = "tool_agent"
        rows.append(row)
    return rows
