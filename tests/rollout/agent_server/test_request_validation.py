"""The endpoint's request readers and the tool-call parser over generated input (hypothesis, derandomized): a reader
returns a request or refuses with a 4xx `ApiError`, never anything else, and what it accepts its published schema
(schemas.py, the OpenAPI document's) accepts too; the hermes parser reads any text into calls or malformed calls."""

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hybridflow.rollout.agent.parsers import MalformedCall, ToolCall, parse_hermes
from hybridflow.rollout.agent_server import schemas
from hybridflow.rollout.agent_server.errors import ApiError
from hybridflow.rollout.agent_server.generate_api import _KEYS, read_generate_request
from hybridflow.rollout.agent_server.openai_api import (
    _CHAT_KEYS,
    _RESPONSES_KEYS,
    ROLES,
    Reply,
    chat_chunks,
    chat_completion,
    read_chat_request,
    read_responses_request,
)
from hybridflow.rollout.agent_server.openai_messages import check_tools, remembered_schema_problem

MODEL, TEMPERATURE, TOP_P, TOP_K, VOCAB, BUDGET = "policy", 1.0, 1.0, -1, 1000, 64
FAST = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "auto", "none", "function", "policy", "text", "x"])
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)
text_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "output_text", "image_url"]) | json_values},
    optional={"text": st.text(max_size=8) | json_values},
)
content = st.none() | st.text(max_size=12) | st.text(max_size=12) | st.lists(text_part, max_size=2) | json_values
tool_call = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=4) | json_values,
        "type": st.just("function") | json_values,
        "function": st.fixed_dictionaries(
            {}, optional={"name": st.text(max_size=6) | json_values, "arguments": st.text(max_size=12) | json_values}
        )
        | json_values,
    },
)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), st.sampled_from(ROLES), json_values)},
    optional={
        "content": content,
        "tool_calls": st.lists(tool_call, max_size=2) | json_values,
        "tool_call_id": st.text(max_size=4) | json_values,
        "name": st.text(max_size=4) | json_values,
    },
)
parameters = (
    st.fixed_dictionaries(
        {"type": st.just("object") | json_values},
        optional={
            "properties": st.dictionaries(
                st.text(max_size=4), st.fixed_dictionaries({"type": st.sampled_from(["string", "nope"]) | json_values})
            ),
            "required": st.lists(st.text(max_size=3), max_size=2) | json_values,
            "$schema": st.sampled_from(["http://json-schema.org/draft-07/schema#", "x"]) | json_values,
        },
    )
    | json_values
)
function = st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True) | json_values},
    optional={"description": st.text(max_size=6) | json_values, "parameters": parameters, "strict": json_values},
)
chat_tool = st.fixed_dictionaries({"type": st.just("function") | json_values}, optional={"function": function})
responses_tool = st.builds(
    lambda tool, f: {**f, **tool}, st.fixed_dictionaries({"type": st.just("function")}), function
)
input_item = (
    message
    | st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"call_id": st.text(max_size=3) | json_values, "name": json_values, "arguments": json_values},
    )
    | st.fixed_dictionaries(
        {"type": st.just("function_call_output")}, optional={"call_id": json_values, "output": content}
    )
    | st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search"]) | json_values})
)


def bodies(known: set[str], fixed: dict, plausible: dict) -> st.SearchStrategy:
    """Objects of known fields (some unknown), each a plausible value or any JSON; sometimes not an object."""
    field = st.sampled_from(sorted(known) + ["frobnicate"])
    value_of = {
        name: st.one_of(*[plausible.get(name, st.nothing())] * 3, json_values) for name in [*known, "frobnicate"]
    }
    fields = st.lists(field, max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: value_of[name] for name in names})
    )
    objects = st.builds(lambda f, extra: {**f, **extra}, st.fixed_dictionaries(fixed), fields)
    return st.one_of(objects, objects, objects, json_values)


numbers = st.sampled_from([0, 1, 1.0, 0.5, -1, 2, 8, 64, 65, 10**400]) | st.booleans()
flags = st.booleans() | st.sampled_from([0, 1, "true", "false"])
chat_bodies = bodies(
    _CHAT_KEYS,
    {
        "model": st.sampled_from([MODEL, MODEL, MODEL, "other", 5]),
        "messages": st.lists(message, min_size=1, max_size=3),
    },
    {
        "tools": st.lists(chat_tool, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "temperature": numbers,
        "top_p": numbers,
        "max_tokens": numbers,
        "max_completion_tokens": numbers,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
        "logprobs": flags,
        "stream": flags,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": flags, "other": flags}),
        "n": numbers,
        "top_logprobs": numbers,
        "frequency_penalty": numbers,
        "seed": numbers,
        "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3) | json_values, max_size=2),
    },
)
responses_bodies = bodies(
    _RESPONSES_KEYS,
    {"model": st.just(MODEL), "input": st.text(max_size=6) | st.lists(input_item, max_size=3)},
    {
        "tools": st.lists(responses_tool, max_size=2),
        "instructions": st.text(max_size=6),
        "max_output_tokens": numbers,
        "stream": flags,
        "temperature": numbers,
        "text": st.just({"format": {"type": "text"}}),
        "include": st.lists(st.text(max_size=3), max_size=2),
    },
)
token_ids = st.lists(st.integers(-1, VOCAB) | json_values, max_size=4)
sampling = st.fixed_dictionaries(
    {},
    optional={
        **{name: numbers | json_values for name in ("temperature", "top_p", "top_k", "max_tokens", "n", "logprobs")},
        "stop": st.just([]) | json_values,
        "stop_token_ids": token_ids,
        "min_tokens": numbers,
        "repetition_penalty": numbers,
        "skip_special_tokens": flags,
        "frobnicate": json_values,
    },
)
generate_bodies = bodies(
    _KEYS,
    {"model": st.just(MODEL), "token_ids": token_ids},
    {"sampling_params": sampling, "priority": numbers, "request_id": st.text(max_size=3)},
)


def _refused_or_read(read, body, schema):
    """What ``read`` makes of ``body``: a 4xx ApiError (returned), or a request that ``schema`` also accepts."""
    try:
        request = read(body)
    except ApiError as error:
        assert 400 <= error.status < 500 and error.body()["error"]["message"], error
        return error
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    return request


@FAST
@given(chat_bodies)
@example({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": float("nan")})
@example({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 10**400})
@example(
    {
        "model": MODEL,
        "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]}],
    }
)
def test_the_chat_reader_reads_or_refuses_with_a_4xx(body):
    schema = schemas.chat_request(MODEL, TEMPERATURE, TOP_P, BUDGET)
    request = _refused_or_read(
        lambda b: read_chat_request(b, model=MODEL, temperature=TEMPERATURE, top_p=TOP_P), body, schema
    )
    if not isinstance(request, ApiError):
        assert isinstance(request.stream, bool) and isinstance(request.logprobs, bool)
        assert request.max_tokens is None or (type(request.max_tokens) is int and request.max_tokens >= 1)
        assert all(isinstance(m["content"], str) for m in request.messages)


@FAST
@given(responses_bodies)
def test_the_responses_reader_reads_or_refuses_with_a_4xx(body):
    schema = schemas.responses_request(MODEL, TEMPERATURE, TOP_P, BUDGET)
    _refused_or_read(
        lambda b: read_responses_request(b, model=MODEL, temperature=TEMPERATURE, top_p=TOP_P), body, schema
    )


@FAST
@given(generate_bodies)
def test_the_token_reader_reads_or_refuses_with_a_4xx(body):
    schema = schemas.generate_request(MODEL, TEMPERATURE, TOP_P, TOP_K, BUDGET, VOCAB)
    request = _refused_or_read(
        lambda b: read_generate_request(
            b, model=MODEL, vocab_size=VOCAB, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K
        ),
        body,
        schema,
    )
    if not isinstance(request, ApiError):
        assert request.token_ids and all(type(t) is int and 0 <= t < VOCAB for t in request.token_ids)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": True}, "n"),  # True == 1 in Python
        ({"n": 1.0}, "n"),
        ({"top_logprobs": False}, "top_logprobs"),
        ({"frequency_penalty": False}, "frequency_penalty"),
        ({"max_tokens": "abc", "max_completion_tokens": 8}, "max_tokens"),  # both are checked
        ({"seed": "42"}, "seed"),
        ({"store": "yes"}, "store"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 0}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f\n"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools[0]"),  # the Responses API's shape
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]}, "tools[0]"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"x": {"pattern": "("}}}},
                    }
                ]
            },
            "tools[0]",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": "none"}]}, "messages[0]"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0]",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_the_chat_reader_checks_types_and_does_not_coerce(change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(ApiError) as refused:
        read_chat_request(body, model=MODEL, temperature=TEMPERATURE, top_p=TOP_P)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.body()


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": 0}, "stream"),
        ({"instructions": 0}, "instructions"),
        ({"text": "json"}, "text"),
        ({"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]}, "input[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),  # the chat API's shape
    ],
)
def test_the_responses_reader_checks_types_and_does_not_coerce(change, param):
    body = {"model": MODEL, "input": "hi", **change}
    with pytest.raises(ApiError) as refused:
        read_responses_request(body, model=MODEL, temperature=TEMPERATURE, top_p=TOP_P)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.body()


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"sampling_params": []}, "sampling_params"),  # an empty list is not an object
        ({"sampling_params": {"top_k": -1.0}}, "sampling_params.top_k"),
        ({"sampling_params": {"n": True}}, "sampling_params.n"),
        ({"sampling_params": {"logprobs": 1.0}}, "sampling_params.logprobs"),
        ({"sampling_params": {"min_tokens": 0.0}}, "sampling_params.min_tokens"),
        ({"sampling_params": {"stop": ""}}, "sampling_params.stop"),
        ({"sampling_params": {"temperature": 10**400}}, "sampling_params.temperature"),
        ({"sampling_params": {"seed": "1"}}, "sampling_params.seed"),
        ({"priority": True}, "priority"),
    ],
)
def test_the_token_reader_checks_types_and_does_not_coerce(change, param):
    body = {"model": MODEL, "token_ids": [1, 2], **change}
    with pytest.raises(ApiError) as refused:
        read_generate_request(body, model=MODEL, vocab_size=VOCAB, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.body()


def test_a_temperature_of_nan_is_refused_even_from_a_reader_that_lets_it_through():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}
    with pytest.raises(ApiError) as refused:
        read_chat_request(body, model=MODEL, temperature=TEMPERATURE, top_p=TOP_P)
    assert refused.value.param == "temperature"


@FAST
@given(
    st.builds(
        lambda tokens, content, calls: (tokens, content, calls),
        st.integers(1, 5),
        st.sampled_from(["", "hi"]),
        st.integers(0, 2),
    )
)
def test_streamed_chunks_carry_the_log_probs_of_the_whole_completion(shape):
    n, text, calls = shape
    reply = Reply(
        content=text or None,
        tool_calls=[
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(calls)
        ],
        finish_reason="tool_calls" if calls else "stop",
        tokens=[f"t{k}" for k in range(n)],
        log_probs=[-k / 10 for k in range(n)],
        prompt_tokens=3,
        cached_tokens=0,
        completion_tokens=n,
    )
    whole = chat_completion(reply, MODEL, logprobs=True)["choices"][0]["logprobs"]["content"]
    streamed = [
        entry
        for chunk in chat_chunks(reply, MODEL, logprobs=True, include_usage=True)
        for choice in chunk["choices"]
        for entry in (choice.get("logprobs") or {"content": []})["content"]
    ]
    assert streamed == whole and len(whole) == n


hermes_pieces = st.sampled_from(
    ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"f"', "1", "NaN", "null",
     '"{\\"a\\": 1}"', " ", "\n", "\\", '"'],
)  # fmt: skip


@FAST
@given(st.lists(hermes_pieces | st.text(max_size=4), max_size=30).map("".join))
@example("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>")
@example('<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>")
@example('<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>')
def test_the_hermes_parser_reads_any_text_into_calls_or_malformed_calls(text):
    calls = parse_hermes(text)
    assert all(isinstance(call, ToolCall | MalformedCall) for call in calls)
    for call in calls:
        if isinstance(call, ToolCall):
            assert isinstance(call.name, str) and isinstance(call.arguments, dict)
    assert bool(calls) == ("<tool_call>" in text)


def test_a_tool_schema_checked_once_is_remembered_with_its_verdict():
    valid = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    invalid = {"type": "function", "function": {"name": "g", "parameters": {"properties": {"x": {"pattern": "("}}}}}
    remembered_schema_problem.cache_clear()
    for _ in range(2):
        assert check_tools([valid])[0]["function"]["name"] == "f"
        with pytest.raises(ApiError) as refused:
            check_tools([invalid])
        assert refused.value.param == "tools[0]" and "not a valid JSON Schema" in str(refused.value.body())
    info = remembered_schema_problem.cache_info()
    assert (info.misses, info.hits) == (2, 2)  # each schema checked once, then its verdict reused
