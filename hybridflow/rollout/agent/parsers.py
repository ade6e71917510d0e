"""Tool calls in a model's output, by the format of its chat template (``multi_turn.format``).

``hermes`` is the format of Hermes, Qwen2.5/Qwen3 and SmolLM's function-calling data:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "482 * 37"}}
    </tool_call>

One tag may hold a JSON list of such objects (SmolLM2 writes several calls that way): each is a call.
A call that cannot be read (broken JSON, JSON nested too deeply to read, no name, arguments that are not an object,
an empty list, a tag never closed) becomes a `MalformedCall` whose message goes back to the model as the tool's
answer, so it can learn from it; it never stops the trajectory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    text: str  # what the model wrote
    problem: str  # shown to the model


ParsedCall = ToolCall | MalformedCall
ToolCallParser = Callable[[str], list[ParsedCall]]

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call_of(call: Any, text: str) -> ParsedCall:
    """One call from its decoded JSON (``text``: what the model wrote for it)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MalformedCall(text, 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return MalformedCall(text, f"the arguments of {call['name']!r} must be a JSON object")
    return ToolCall(call["name"], arguments)


def _read_calls(body: str) -> list[ParsedCall]:
    """The calls of one tag: a JSON object, or a JSON list of them (SmolLM2 writes several calls so)."""
    try:
        value = json.loads(body)
        if not isinstance(value, list):
            return [_call_of(value, body)]
        if not value:
            return [MalformedCall(body, "the tool call is an empty list")]
        return [_call_of(item, json.dumps(item)) for item in value]
    except json.JSONDecodeError as error:
        return [MalformedCall(body, f"the tool call is not valid JSON ({error.msg} at character {error.pos})")]
    except RecursionError:  # JSON nested deeper than the interpreter reads
        return [MalformedCall(body, "the tool call's JSON is nested too deeply")]


def parse_hermes(text: str) -> list[ParsedCall]:
    """Every call of every ``<tool_call>...</tool_call>`` in ``text``, in order; an opening tag never closed is
    malformed."""
    calls = [call for body in _HERMES_CALL.findall(text) for call in _read_calls(body.strip())]
    unclosed = _HERMES_CALL.sub("", text)
    if "<tool_call>" in unclosed:
        tail = unclosed[unclosed.index("<tool_call>") :]
        calls.append(MalformedCall(tail, "a <tool_call> was not closed with </tool_call>"))
    return calls


TOOL_CALL_FORMATS: dict[str, ToolCallParser] = {"hermes": parse_hermes}


def register_tool_call_format(name: str, parser: ToolCallParser) -> None:
    """Make ``name`` usable as ``multi_turn.format``: ``parser(text)`` returns the calls found in a turn."""
    if name in TOOL_CALL_FORMATS:
        raise ValueError(f"tool-call format {name!r} is already registered")
    TOOL_CALL_FORMATS[name] = parser
