"""The OpenAI wire formats the endpoint speaks: requests read into a `TurnRequest` (checked, every refusal an
`ApiError` naming the parameter), and a generated `Reply` written as a chat completion (whole or streamed) or a
response (the Responses API, which the OpenAI Agents SDK uses by default).

Sampling belongs to the run: the trainer's importance weights assume the tokens were drawn at the run's
temperature and top_p, so a request may omit them or repeat the run's values, not choose others. ``seed`` is
accepted and has no effect: a session's samples already come from the run's counter-based stream.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from hybridflow.request_json import RequestJsonError, read_request_json
from hybridflow.rollout.agent_server.errors import bad_request
from hybridflow.rollout.agent_server.fields import (
    boolean,
    check_model,
    integer,
    mapping,
    number,
    only,
    refuse_unknown,
    string,
    strings,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# accepted and without effect on generation (bookkeeping fields clients send by default)
_IGNORED_CHAT = {"user", "metadata", "store", "parallel_tool_calls", "stream_options", "seed", "prompt_cache_key"}
_CHAT_KEYS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "n",
    "frequency_penalty",
    "presence_penalty",
} | _IGNORED_CHAT
_IGNORED_RESPONSES = {"metadata", "store", "parallel_tool_calls", "user", "truncation", "include", "prompt_cache_key"}
_RESPONSES_KEYS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_output_tokens",
    "stream",
    "top_logprobs",
    "text",
    "reasoning",
    "previous_response_id",
    "conversation",
    "service_tier",
} | _IGNORED_RESPONSES


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


@dataclass
class Reply:
    """What one turn produced, ready to be written in either API."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # chat-completions tool_call objects
    finish_reason: str  # stop | length | tool_calls
    tokens: list[str]  # each generated token's text (for logprobs)
    log_probs: list[float]
    prompt_tokens: int  # the conversation's tokens before the turn
    cached_tokens: int  # of those, already computed in the session (a continued branch)
    completion_tokens: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        """The assistant message as the client will send it back."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


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


def _text_of(content: Any, where: str) -> str:
    """A message content as text: a string, or a list of text parts (input_text / output_text / text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}: content parts of type {kind!r} are not supported; send text",
                    param=where,
                    code="unsupported_content",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: a text part needs a 'text' string", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", param=where)


def _canonical_arguments(arguments: Any, where: str) -> str:
    """A tool call's arguments (JSON text, or the object itself) as canonical JSON text (so that a client's
    re-serialisation compares equal)."""
    if arguments is not None and not isinstance(arguments, str | dict):
        raise bad_request(f"{where}: the function's 'arguments' must be a JSON string", param=where)
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = {}
        else:
            try:
                arguments = read_request_json(arguments.encode("utf-8"))
            except RequestJsonError:
                return arguments  # kept as written: the model may have produced it so (or it nests too deeply)
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(
            f"{where}: a tool call is {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
        )
    function = call["function"]
    if not isinstance(function.get("name"), str):
        raise bad_request(f"{where}: the function's 'name' must be a string", param=where)
    if not isinstance(call.get("id", ""), str | None):
        raise bad_request(f"{where}: a tool call's 'id' must be a string", param=where)
    return {
        "id": call.get("id") or "",
        "type": "function",
        "function": {"name": function["name"], "arguments": _canonical_arguments(function.get("arguments"), where)},
    }


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with only what the model sees: role (developer read as system), content text, an assistant's
    tool calls (arguments as canonical JSON), a tool message's tool_call_id. Equal conversations compare equal."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"{where}: a message is an object with a role in {list(ROLES)}", param=where)
        role = "system" if message["role"] == "developer" else message["role"]
        normal: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), where)}
        calls = message.get("tool_calls")
        if not isinstance(calls, list | None):
            raise bad_request(f"{where}: tool_calls must be a list", param=where)
        calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls or [])]
        if not isinstance(message.get("tool_call_id", ""), str | None):
            raise bad_request(f"{where}: 'tool_call_id' must be a string", param=where)
        if not isinstance(message.get("name", ""), str | None):
            raise bad_request(f"{where}: 'name' must be a string", param=where)
        if role == "assistant" and calls:  # (another role's calls are checked and not shown to the model)
            normal["tool_calls"] = calls
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise bad_request(f"{where}: a tool message needs the 'tool_call_id' it answers", param=where)
            normal["tool_call_id"] = message["tool_call_id"]
        out.append(normal)
    return out


def check_parameters_schema(parameters: Any, where: str, name: str) -> None:
    """The ``parameters`` of the function ``name`` (the tool at ``where``): a JSON Schema of type object, valid
    against the metaschema of its ``$schema`` dialect (Draft 2020-12 when it names none)."""
    problem = None
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        problem = "must be a JSON Schema of type 'object'"
    elif not isinstance(parameters.get("$schema", ""), str):
        problem = "names its dialect ('$schema') with a URI"
    else:
        try:
            validator_for(parameters, default=Draft202012Validator).check_schema(parameters)
        except SchemaError as error:
            at = "".join(f"[{p!r}]" for p in error.absolute_path)
            problem = f"is not a valid JSON Schema: at parameters{at}: {error.message[:300]}"
    if problem:
        raise bad_request(f"{where}: the parameters of {name!r} {problem}", param=where, code="invalid_tool")


def check_tools(tools: Any, param: str = "tools", *, flat: bool = False) -> list[dict[str, Any]]:
    """Tools as chat-completions function tools, each checked: a name of letters, digits, _ and - (64 at most), an
    optional description, parameters a JSON Schema of an object. flat: the Responses API's tools, which hold the
    function's fields themselves (chat tools hold them in ``function``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", param=param, code="invalid_tool")
    out = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported", param=where, code="invalid_tool")
        function = tool if flat else tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = "a 'name'" if flat else "a 'function' object with a 'name'"
            raise bad_request(f"{where}: a function tool needs {shape}", param=where, code="invalid_tool")
        name = function["name"]
        if not _TOOL_NAME.fullmatch(name):
            raise bad_request(
                f"{where}: the name {name!r} must be 1-64 letters, digits, _ or -", param=where, code="invalid_tool"
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        check_parameters_schema(parameters, where, name)
        description = function.get("description")
        if not isinstance(description, str | None):
            raise bad_request(f"{where} ({name!r}): 'description' must be a string", param=where, code="invalid_tool")
        if not isinstance(function.get("strict"), bool | None):
            raise bad_request(f"{where} ({name!r}): 'strict' must be a boolean", param=where, code="invalid_tool")
        entry = {"name": name, "description": description or "", "parameters": parameters}
        out.append({"type": "function", "function": entry})
    names = [tool["function"]["name"] for tool in out]
    if len(set(names)) != len(names):
        raise bad_request(f"'{param}' names a function twice: {names}", param=param, code="invalid_tool")
    return out


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
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), where)})
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
            text = output if isinstance(output, str) else _text_of(output, where)
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
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad_request(
                f"{name!r} is not supported: this endpoint stores no responses; send the whole input",
                param=name,
                code="unsupported_value",
            )
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


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def _logprobs(reply: Reply) -> dict[str, Any]:
    return {
        "content": [
            {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            for token, lp in zip(reply.tokens, reply.log_probs)
        ]
    }


def chat_completion(reply: Reply, model: str, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion",
        "created": reply.created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": reply.message(),
                "finish_reason": reply.finish_reason,
                "logprobs": _logprobs(reply) if logprobs else None,
            }
        ],
        "usage": _usage(reply),
    }


def chat_chunks(reply: Reply, model: str, logprobs: bool, include_usage: bool) -> list[dict[str, Any]]:
    """The turn as chat.completion.chunk events: the role, the content, the tool calls, the finish (and usage).
    The engines hand a turn over whole, so the events come together when it is done."""
    head = {"id": f"chatcmpl-{reply.id}", "object": "chat.completion.chunk", "created": reply.created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    # every generated token's log-prob (tool-call markup and the end token included, as unstreamed) goes with the
    # first chunk after the role: the content's, else the tool calls', else the finish's
    pending = {"logprobs": _logprobs(reply)} if logprobs else {}
    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}, **pending))
        pending = {}
    if reply.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(reply.tool_calls)]
        chunks.append(chunk({"tool_calls": calls}, **pending))
        pending = {}
    chunks.append(chunk({}, reply.finish_reason, **pending))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    return chunks


def response_object(reply: Reply, model: str, request_tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn as a Responses API ``response``: a message item for the text, a function_call item per call."""
    output: list[dict[str, Any]] = []
    if reply.content:
        output.append(
            {
                "type": "message",
                "id": f"msg_{reply.id}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}],
            }
        )
    for i, call in enumerate(reply.tool_calls):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{reply.id}_{i}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    incomplete = reply.finish_reason == "length"
    return {
        "id": f"resp_{reply.id}",
        "object": "response",
        "created_at": reply.created,
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{"type": "function", **tool["function"], "strict": False} for tool in request_tools],
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
    }


def models_list(model: str, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "hybridflow", "max_model_len": max_model_len}
        ],
    }
