"""The OpenAI requests the endpoint takes: a chat completion's or a response's body (the Responses API, which the
OpenAI Agents SDK uses by default) read into a `TurnRequest`, checked, every refusal an `ApiError` naming the
parameter. Their messages and tools: openai_messages.py; the replies written back: openai_replies.py.

Sampling belongs to the run: the trainer's importance weights assume the tokens were drawn at the run's
temperature and top_p, so a request may omit them or repeat the run's values, not choose others. ``seed`` is
accepted and has no effect: a session's samples already come from the run's counter-based stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.rollout.agent_server.errors import bad_request
from hybridflow.rollout.agent_server.fields import (
    boolean,
    check_model,
    integer,
    mapping,
    number,
    only,
    refuse_given,
    refuse_unknown,
    string,
    strings,
)
from hybridflow.rollout.agent_server.openai_messages import ROLES, check_tools, normalise_messages, text_of
from hybridflow.rollout.agent_server.openai_replies import (
    Reply,
    chat_chunks,
    chat_completion,
    models_list,
    response_object,
)

__all__ = [  # the endpoint's names in the OpenAI formats, its messages' and replies' among them
    "ROLES",
    "SAMPLING_TOLERANCE",
    "Reply",
    "TurnRequest",
    "chat_chunks",
    "chat_completion",
    "check_sampling",
    "check_tools",
    "models_list",
    "normalise_messages",
    "read_chat_request",
    "read_responses_request",
    "response_object",
]

_TURN_KEYS = {"model", "tools", "tool_choice", "temperature", "top_p", "top_logprobs", "stream"}  # both APIs take
# accepted and without effect on generation: fields clients send by default (_check_bookkeeping)
_BOOKKEEPING = {"user", "metadata", "store", "parallel_tool_calls", "prompt_cache_key"}
_CHAT_SAMPLING = {"n", "frequency_penalty", "presence_penalty", "seed"}  # only at the run's values (seed: no effect)
_CHAT_OWN = {"messages", "max_tokens", "max_completion_tokens", "stop", "logprobs", "stream_options"}
_CHAT_KEYS = _TURN_KEYS | _BOOKKEEPING | _CHAT_SAMPLING | _CHAT_OWN
_STORED = ("previous_response_id", "conversation")  # refused: this endpoint stores no responses
_RESPONSES_OWN = {
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "reasoning",
    "service_tier",
    "truncation",
    "include",
}
_RESPONSES_KEYS = _TURN_KEYS | _BOOKKEEPING | _RESPONSES_OWN | set(_STORED)


@dataclass
class TurnRequest:
    """One request for an assistant turn, in the endpoint's terms."""

    messages: list[dict[str, Any]]  # normalised chat messages (see `normalise_messages`)
    tools: list[dict[str, Any]]  # chat-completions tool objects {"type": "function", "function": {...}}
    parse_tools: bool  # tool_choice is not "none": tool calls in the output are parsed
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool = False


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


SAMPLING_TOLERANCE = 1e-6  # how far a request's temperature or top_p may be from the run's


def check_sampling(body: dict[str, Any], temperature: float, top_p: float, where: str = "") -> None:
    """temperature and top_p: omitted, or the run's values (finite numbers: NaN compares unequal to nothing)."""
    for name, run_value in (("temperature", temperature), ("top_p", top_p)):
        value = number(body, name, where)
        if value is not None and not abs(value - run_value) <= SAMPLING_TOLERANCE:
            raise bad_request(
                f"{where}{name}={value}: the run samples at {name}={run_value} (its importance weights assume it); "
                f"omit {name!r} or pass {run_value}",
                param=f"{where}{name}",
                code="unsupported_value",
            )


def _check_chat_sampling(body: dict[str, Any], temperature: float, top_p: float) -> None:
    check_sampling(body, temperature, top_p)
    for name in ("frequency_penalty", "presence_penalty"):
        only(body, name, 0.0, "the run's sampling is fixed")
    if integer(body, "n") not in (None, 1):
        raise bad_request(
            "n > 1 is not supported: each request is one turn of one trajectory; send n requests",
            param="n",
            code="unsupported_value",
        )
    if integer(body, "top_logprobs") not in (None, 0):
        raise bad_request(
            "top_logprobs is not supported (the sampled token's log-prob is: logprobs=true)",
            param="top_logprobs",
            code="unsupported_value",
        )
    integer(body, "seed")  # accepted, without effect


def _check_bookkeeping(body: dict[str, Any]) -> None:
    """Fields clients send by default that change nothing here: checked for their types only."""
    string(body, "user")
    string(body, "prompt_cache_key")
    boolean(body, "store")
    boolean(body, "parallel_tool_calls")
    metadata = mapping(body, "metadata")
    if metadata is not None and not all(isinstance(value, str) for value in metadata.values()):
        raise bad_request("'metadata' maps names to strings", param="metadata")


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether tool calls are parsed: tool_choice "auto" (the default with tools) or "none". Forcing a call
    ("required", or one named function) needs constrained decoding, which the engines here do not do."""
    if value in (None, "auto"):
        return bool(tools)
    if value == "none":
        return False
    raise bad_request(
        f"tool_choice={value!r} is not supported: forcing a tool call needs constrained decoding; use 'auto' or 'none'",
        param="tool_choice",
        code="unsupported_value",
    )


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad_request("'stop' is a non-empty string or a list of at most 4 of them", param="stop")
    return stops


def read_chat_request(body: Any, *, model: str, temperature: float, top_p: float) -> TurnRequest:
    """A /chat/completions body, checked."""
    body = _require_object(body)
    refuse_unknown(body, _CHAT_KEYS)
    check_model(body, model)
    _check_chat_sampling(body, temperature, top_p)
    _check_bookkeeping(body)
    tools = check_tools(body.get("tools"))
    options = mapping(body, "stream_options") or {}
    refuse_unknown(options, {"include_usage", "include_obfuscation"}, "stream_options.")
    include_usage = boolean(options, "include_usage", "stream_options.")
    boolean(options, "include_obfuscation", "stream_options.")
    max_completion_tokens = integer(body, "max_completion_tokens", minimum=1)
    max_tokens = integer(body, "max_tokens", minimum=1)
    return TurnRequest(
        messages=normalise_messages(body.get("messages")),
        tools=tools,
        parse_tools=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        stop=_stop(body.get("stop")),
        logprobs=bool(boolean(body, "logprobs")),
        stream=bool(boolean(body, "stream")),
        include_usage=bool(include_usage),
    )


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's instructions and input items as chat messages: function_call items join the assistant
    message before them (one turn's text and calls), function_call_output items become tool messages."""
    messages: list[dict[str, Any]] = []
    if string(body, "instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": text_of(item.get("content"), where)})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise bad_request(f"{where}: a function_call item needs the string {name!r}", param=where)
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output item needs the string 'call_id'", param=where)
            output = item.get("output")
            text = output if isinstance(output, str) else text_of(output, where)
            messages.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            continue  # this endpoint's models write no separate reasoning items; nothing to show the model
        else:
            raise bad_request(
                f"{where}: input items of type {kind!r} are not supported", param=where, code="unsupported_value"
            )
    return messages


def read_responses_request(body: Any, *, model: str, temperature: float, top_p: float) -> TurnRequest:
    """A /responses body, checked (non-streaming; no stored state: the whole input each time)."""
    body = _require_object(body)
    refuse_unknown(body, _RESPONSES_KEYS)
    check_model(body, model)
    if boolean(body, "stream"):
        raise bad_request(
            "stream=true is not supported on /responses; use /chat/completions to stream",
            param="stream",
            code="unsupported_value",
        )
    refuse_given(body, _STORED, "{name} is not supported: this endpoint stores no responses; send the whole input")
    check_sampling(body, temperature, top_p)
    if integer(body, "top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs is not supported", param="top_logprobs", code="unsupported_value")
    _check_bookkeeping(body)
    for name in ("text", "reasoning"):
        mapping(body, name)
    for name in ("service_tier", "truncation"):
        string(body, name)
    strings(body, "include")
    tools = check_tools(body.get("tools"), flat=True)
    return TurnRequest(
        messages=normalise_messages(_responses_messages(body)),
        tools=tools,
        parse_tools=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=integer(body, "max_output_tokens", minimum=1),
        stop=[],
        logprobs=False,
        stream=False,
    )
