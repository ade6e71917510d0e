"""Messages and tools to token ids, with every text a client sent tokenised as text (it can never become a control
token), through the model's chat template (rollout/agent/chat.py).

A template that renders ``tools`` (and assistant ``tool_calls``) is given them. One that ignores them (SmolLM2's, and
any plain ChatML template) gets the fallback format, in the hermes style the parser reads:

    system message  <its text>, a blank line, "# Tools", the functions' JSON schemas between <tools> and
                    </tools> (one per line), and how to call one: <tool_call>{"name": ..., "arguments": ...}</tool_call>
    assistant turn  <its text>, then <tool_call>{"name": ..., "arguments": ...}</tool_call> per call
    tool message    the template's own rendering of role ``tool`` (or ``multi_turn.tool_role``)

(a system message is added first when the conversation has none).
"""

from __future__ import annotations

import json
from typing import Any

from hybridflow.request_json import RequestJsonError, read_request_json
from hybridflow.rollout.agent.chat import ChatFormat

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_name", "description": "", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_CALL = {"id": "c", "type": "function", "function": {"name": "probe_call_name", "arguments": {}}}


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The fallback format's description of ``tools`` (the part added to the system message)."""
    lines = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The functions are described "
        f"in JSON schema within <tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call a function, write "
        '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}</tool_call>'
    )


def call_text(call: dict[str, Any]) -> str:
    """One tool call as the fallback format (and the hermes parser) writes it."""
    arguments = _as_object(call["function"]["arguments"])
    body = json.dumps({"name": call["function"]["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


class MessageRenderer:
    """Token ids of conversations (a new branch's prompt) and of tails (what follows a generated turn)."""

    def __init__(self, chat: ChatFormat):
        self.chat = chat
        render = chat.tokenizer.apply_chat_template
        probe = [{"role": "user", "content": "x"}]
        self.native_tools = render(probe, tools=[_PROBE_TOOL], tokenize=False) != render(probe, tokenize=False)
        with_call = [*probe, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]
        try:
            self.native_calls = "probe_call_name" in render(with_call, tokenize=False)
        except Exception:  # noqa: BLE001  (a template may refuse the field: it has no native calls then)
            self.native_calls = False

    def conversation_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The whole conversation and the next assistant header."""
        if self.native_tools and tools:
            return self.chat.conversation_ids(self._template_messages(messages), tools=tools)
        return self.chat.conversation_ids(self._template_messages(self._with_tools_text(messages, tools)))

    def tail_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after a generated turn's end token that add ``messages`` (tool, user or system messages) and
        open the next assistant turn."""
        return self.chat.continuation_ids(self._template_messages(messages))

    def _with_tools_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not tools:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_text(tools)}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": tools_text(tools)}, *messages]

    def _template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template takes them: a tool message in the configured tool role; an assistant's calls
        as the template's own field, or in the fallback format after its text."""
        out = []
        for message in messages:
            if message["role"] == "tool":
                out.append({**message, "role": self.chat.tool_role})
            elif message.get("tool_calls") and not self.native_calls:
                text = message["content"] + "".join(call_text(call) for call in message["tool_calls"])
                out.append({"role": "assistant", "content": text})
            elif message.get("tool_calls"):
                calls = [
                    {**call, "function": {**call["function"], "arguments": _as_object(call["function"]["arguments"])}}
                    for call in message["tool_calls"]
                ]
                out.append({**message, "tool_calls": calls})
            else:
                out.append(message)
        return out


def _as_object(arguments: Any) -> Any:
    """A call's arguments (JSON text) as their value; text that is not JSON (or nests too deeply), as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return read_request_json(arguments.encode("utf-8"))
    except RequestJsonError:
        return arguments  # what the model wrote, as it was
