"""A calculator agent written with the openai SDK, as it would be written for any OpenAI-compatible server. hybridflow
calls `run` once per sample with the run's endpoint (base_url, api_key) and the data row, and trains on what the
model generated; the number it returns is the sample's reward. It uses hybridflow's calculator and the task's scorer,
so that the run compares with the in-process `tool_agent` loop of examples/grpo_calculator_smollm2.yaml; any other
tool code and reward would do.

    hybridflow train --config examples/grpo_calculator_agent_smollm2.yaml
"""

from __future__ import annotations

import json

import httpx
import openai

from hybridflow.reward.scorers.calculator import score_calculator
from hybridflow.tools.calculator import calculate

HTTP = httpx.Client(timeout=600)  # one connection pool for every agent: a client per agent costs ~50 ms of CPU
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def run(base_url: str, api_key: str, row: dict) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)
    # the task's chat: its system message, a worked example (its tool message given the id the API asks for), the
    # question
    messages = [{**m, "tool_call_id": "example"} if m["role"] == "tool" else dict(m) for m in row["raw_prompt"]]
    calls = 0
    for _ in range(4):
        try:
            completion = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError as error:  # the trajectory's token budget is spent: score what there is
            if error.code in ("context_length_exceeded", "max_tokens_exceeded"):
                break
            raise
        choice = completion.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls:
            calls += 1
            try:
                result = calculate(str(json.loads(call.function.arguments)["expression"]))
            except (KeyError, TypeError, json.JSONDecodeError):
                result = 'Error: give the expression as {"expression": "..."}'
            except Exception as error:  # noqa: BLE001  (the model reads its mistake)
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    score = score_calculator(answer, row["reward_model"]["ground_truth"])
    return {"reward": score["score"], "tool_calls": float(calls)}
