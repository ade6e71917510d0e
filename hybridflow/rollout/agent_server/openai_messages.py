"""Chat messages and function tools as the endpoint takes them, in either API: checked (every refusal an `ApiError`
naming the parameter) and normalised to what the model sees, so that equal conversations compare equal."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from hybridflow.request_json import RequestJsonError, read_request_json
from hybridflow.rollout.agent_server.errors import bad_request

SCHEMAS_REMEMBERED = 256  # distinct tool schemas whose check is kept (remembered_schema_problem)

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def text_of(content: Any, where: str) -> str:
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
        normal: dict[str, Any] = {"role": role, "content": text_of(message.get("content"), where)}
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
        problem = remembered_schema_problem(json.dumps(parameters, sort_keys=True))  # parsed from JSON: it dumps
    if problem:
        raise bad_request(f"{where}: the parameters of {name!r} {problem}", param=where, code="invalid_tool")


@functools.lru_cache(maxsize=SCHEMAS_REMEMBERED)
def remembered_schema_problem(schema_json: str) -> str | None:
    """What is wrong with a JSON Schema (given as canonical JSON: sorted keys) against the metaschema of its dialect,
    None if nothing; remembered: an agent sends the same tools with every request, and checking the calculator's
    took 430 us of the endpoint's 1-1.2 ms a request, 5 us remembered (docs/log/rollout.md §42)."""
    parameters = json.loads(schema_json)
    try:
        validator_for(parameters, default=Draft202012Validator).check_schema(parameters)
    except SchemaError as error:
        at = "".join(f"[{p!r}]" for p in error.absolute_path)
        return f"is not a valid JSON Schema: at parameters{at}: {error.message[:300]}"
    return None


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
