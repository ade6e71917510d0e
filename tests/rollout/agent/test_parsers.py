"""The hermes tool-call format: calls as the model writes them, one per tag or a JSON list in one tag, and every
way a call can be malformed becoming a MalformedCall (never an exception)."""

import pytest

from hybridflow.rollout.agent.parsers import MalformedCall, ToolCall, parse_hermes

ADD = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
MUL = '{"name": "calculator", "arguments": {"expression": "4 * 5"}}'


def test_one_call_and_calls_in_several_tags_in_order():
    assert parse_hermes(f"Let me compute.\n<tool_call>\n{ADD}\n</tool_call>") == [
        ToolCall("calculator", {"expression": "2 + 3"})
    ]
    assert parse_hermes(f"<tool_call>{ADD}</tool_call> and <tool_call>{MUL}</tool_call>") == [
        ToolCall("calculator", {"expression": "2 + 3"}),
        ToolCall("calculator", {"expression": "4 * 5"}),
    ]
    assert parse_hermes("The answer is 5.") == []


def test_a_json_list_in_one_tag_is_each_of_its_calls():
    """SmolLM2-135M-Instruct writes parallel calls as one list."""
    calls = parse_hermes(f"<tool_call>\n[{ADD}, {MUL}]\n</tool_call>")
    assert calls == [ToolCall("calculator", {"expression": "2 + 3"}), ToolCall("calculator", {"expression": "4 * 5"})]


def test_a_bad_element_of_a_list_is_malformed_and_the_others_stand():
    calls = parse_hermes(f'<tool_call>[{ADD}, {{"arguments": {{}}}}]</tool_call>')
    assert calls[0] == ToolCall("calculator", {"expression": "2 + 3"})
    assert isinstance(calls[1], MalformedCall) and '{"arguments": {}}' == calls[1].text
    assert "JSON object" in calls[1].problem


def test_arguments_written_as_a_json_string_are_read():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1 + 1\\"}"}</tool_call>'
    assert parse_hermes(text) == [ToolCall("calculator", {"expression": "1 + 1"})]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not valid JSON"),
        ("<tool_call>[]</tool_call>", "empty list"),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ("<tool_call>42</tool_call>", "JSON object"),
        (f"<tool_call>{ADD}", "not closed"),
    ],
)
def test_each_malformed_call_is_named_not_raised(text, problem):
    (call,) = parse_hermes(text)
    assert isinstance(call, MalformedCall) and problem in call.problem
