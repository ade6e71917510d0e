"""A calculator agent written with the openai SDK, as it would be written for any OpenAI-compatible server. hybridflow
calls `run` once per sample with the run's endpoint (base_url, api_key) and the data row, and trains on what the
model generated; the number it returns is the sample's reward.

    hybridflow train --config examples/grpo_calculator_agent_smollm2.yaml
"""

from __future__ import annotations

import ast
import json
import operator

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """+ - * over integers, nothing else (no eval)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


def run(base_url: str, api_key: str, row: dict) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = row["raw_prompt"]  # the task's chat: its system message, a worked example, the question
    messages = [prompt[0], prompt[-1]]  # the tool comes as `tools`: the system message and the question suffice
    calls = 0
    for _ in range(3):
        choice = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls:
            calls += 1
            try:
                result = str(calculate(json.loads(call.function.arguments)["expression"]))
            except Exception as error:  # noqa: BLE001  (the model reads its mistake)
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
    truth = str(row["reward_model"]["ground_truth"])
    return {"reward": float(truth in answer.replace(",", "")), "tool_calls": float(calls)}
