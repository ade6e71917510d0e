"""Agents the endpoint's tests run, written as users write them: against the OpenAI API, knowing nothing of
hybridflow but the base_url, the key and the row they are given."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai

from hybridflow.data.tasks.calculator import evaluate

SEEN: dict[int, tuple[str, str]] = {}  # bad_requests_agent: row -> (session id, key)
DONE = threading.Event()

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * ( ).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def calculator_agent(base_url: str, api_key: str, row: dict) -> dict:
    """The calculator task with the openai SDK: call the tool while the model asks for it, then read the answer."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    calls = 0
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls:
            calls += 1
            try:
                result = str(evaluate(json.loads(call.function.arguments)["expression"]))
            except Exception as error:  # noqa: BLE001  (the model sees its mistake)
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    truth = row["reward_model"]["ground_truth"]
    return {"reward": float(truth in answer), "calls": float(calls)}


def streaming_agent(base_url: str, api_key: str, row: dict) -> dict:
    """One streamed request: the text and the tool calls put together from the chunks."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    stream = client.chat.completions.create(
        model="policy",
        messages=row["raw_prompt"],
        tools=[CALCULATOR],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, names, finish, usage = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            names += [call.function.name for call in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    with open(row["extra_info"]["out"], "w") as file:
        json.dump(
            {
                "text": text,
                "names": names,
                "finish": finish,
                "completion_tokens": usage.completion_tokens,
                "url": base_url,
            },
            file,
        )
    return 1.0


def edited_history_agent(base_url: str, api_key: str, row: dict) -> float:
    """Three requests: a first turn, a continuation of it, then the first turn's reply edited (a new branch)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    call = first.choices[0].message.tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "42572"})
    client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    edited = [
        *row["raw_prompt"],
        {"role": "assistant", "content": "I think it is 42000."},
        {"role": "user", "content": "Check."},
    ]
    client.chat.completions.create(model="policy", messages=edited, tools=[CALCULATOR])
    return 0.5


def bad_requests_agent(base_url: str, api_key: str, row: dict) -> dict:
    """Bad requests of every kind, each status recorded in extra_info["out"]; then one good request."""
    root = base_url.split("/sessions/")[0]
    good = {"model": "policy", "messages": row["raw_prompt"]}
    auth = {"Authorization": f"Bearer {api_key}"}
    if row["index"] != 0:  # the other session: open until row 0 is done with it
        SEEN[row["index"]] = (base_url.split("/sessions/")[1].split("/")[0], api_key)
        DONE.wait(timeout=60)
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="policy", messages=row["raw_prompt"]
        )
        return 1.0
    for _ in range(600):
        if 1 in SEEN:
            break
        time.sleep(0.05)
    other_id, other_key = SEEN[1]
    statuses = {}
    with httpx.Client(timeout=30) as http:

        def post(name, body=None, url=f"{base_url}/chat/completions", headers=None, **kwargs):
            response = http.post(url, json=body, headers=auth if headers is None else headers, **kwargs)
            statuses[name] = [response.status_code, response.json()["error"]["code"]]

        post("no key", good, headers={})
        post("wrong key", good, headers={"Authorization": "Bearer hf-not-a-key"})
        post("another session's id", good, url=f"{root}/sessions/{other_id}/v1/chat/completions")
        post("another session's key", good, headers={"Authorization": f"Bearer {other_key}"})
        post("unknown session", good, url=f"{root}/sessions/nope/v1/chat/completions")
        post(
            "malformed JSON",
            content=b'{"model": "policy", "messages": [',
            headers={**auth, "Content-Type": "application/json"},
        )
        post("not an object", [1, 2])
        post("unknown model", {**good, "model": "gpt-4o"})
        post("no model", {"messages": row["raw_prompt"]})
        post("n > 1", {**good, "n": 2})
        post("context too long", {**good, "messages": [{"role": "user", "content": "word " * 5000}]})
        post("max_tokens over the budget", {**good, "max_tokens": 100000})
        post("unknown parameter", {**good, "frobnicate": True})
        post("invalid tool schema", {**good, "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
        post(
            "tool parameters not an object",
            {**good, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        )
        post("other temperature", {**good, "temperature": 0.3})
        post(
            "image content",
            {**good, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        )
        post("empty messages", {**good, "messages": []})
        post("bad role", {**good, "messages": [{"role": "wizard", "content": "x"}]})
        post("tool message without id", {**good, "messages": [*row["raw_prompt"], {"role": "tool", "content": "1"}]})
        post("forced tool choice", {**good, "tools": [CALCULATOR], "tool_choice": "required"})
        post("body too large", {**good, "padding": "x" * 2_000_000})
        post("not JSON content type", content=b"hello", headers={**auth, "Content-Type": "text/plain"})
        post("unknown route", good, url=f"{root}/v1/completions")
        response = http.get(f"{base_url}/chat/completions", headers=auth)
        statuses["wrong method"] = [response.status_code, response.json()["error"]["code"]]
        response = http.get(f"{base_url}/models", headers=auth)
        models = response.json()["data"][0]["id"]
        response = http.post(f"{base_url}/chat/completions", json=good, headers=auth)
        statuses["good"] = [response.status_code, response.json()["choices"][0]["finish_reason"]]
    with open(row["extra_info"]["out"], "w") as file:
        json.dump({"statuses": statuses, "model": models}, file)
    DONE.set()
    return 1.0


def failing_agent(base_url: str, api_key: str, row: dict) -> float:
    if row["index"] == 1:
        raise RuntimeError("the agent's own bug")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=row["raw_prompt"])
    return 1.0


async def agents_sdk_agent(base_url: str, api_key: str, row: dict) -> float:
    """An OpenAI Agents SDK `Agent` with a function tool, on its default API (Responses), run as a coroutine."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression of integers."""
        return str(evaluate(expression))

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="calculator agent",
        instructions="Use the calculator for arithmetic.",
        tools=[calculator],
        model=OpenAIResponsesModel(model="policy", openai_client=client),
    )
    result = await Runner.run(agent, row["raw_prompt"][-1]["content"], max_turns=4)
    return float(row["reward_model"]["ground_truth"] in str(result.final_output))


def three_turn_agent(base_url: str, api_key: str, row: dict) -> float:
    """Three turns of 8 tokens: the first answered by a tool message, the second by a user message."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    for follow_up in (
        {"role": "tool", "tool_call_id": "call_0", "content": "42572"},
        {"role": "user", "content": "Sure?"},
    ):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), follow_up]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0


def branching_agent(base_url: str, api_key: str, row: dict) -> float:
    """Two turns of 8 tokens (the second after a user message), then the first reply edited: a second branch of 8
    tokens. Needs no tool call from the model (a random one writes none)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    edited = [
        *row["raw_prompt"],
        {"role": "assistant", "content": "I think it is 42000."},
        {"role": "user", "content": "Check."},
    ]
    client.chat.completions.create(model="policy", messages=edited, max_tokens=8)
    return 1.0
