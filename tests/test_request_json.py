"""The services' JSON reader: what Python's json takes and a service must refuse (deep nesting, numbers that are
not finite, lone surrogates), each refused with its reason, and every other JSON value read as json reads it."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.request_json import MAX_DEPTH, RequestJsonError, check_json_value, read_request_json


def refused(body: bytes) -> str:
    with pytest.raises(RequestJsonError) as error:
        read_request_json(body)
    return str(error.value)


def test_nesting_past_the_interpreters_limit_is_a_refusal_not_a_recursion_error():
    assert "nested too deeply" in refused(b"[" * 100_000 + b"]" * 100_000)
    assert "nested too deeply" in refused(b'{"a":' * 5_000 + b"1" + b"}" * 5_000)


def test_the_depth_bound_counts_arrays_and_objects():
    read_request_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    assert "at body" + "[0]" * MAX_DEPTH in refused(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999", b"1" + b"0" * 400])
def test_numbers_must_be_finite(number):
    assert "finite" in refused(b'{"temperature": ' + number + b"}")


def test_a_lone_surrogate_is_named_where_it_is():
    message = refused(b'{"messages": [{"content": "ab\\udc00"}]}')
    assert message.startswith("body.messages[0].content is not valid Unicode: a lone UTF-16 surrogate (0xdc00)")
    assert "a key of body" in refused(b'{"\\ud800": 1}')
    assert read_request_json(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}  # a pair is one character


def test_other_bad_bodies_say_why():
    assert "not UTF-8" in refused(b"\xff\xfe")
    assert "not valid JSON" in refused(b'{"a": 1')
    assert "too many digits" in refused(b"1" * 5_000)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(JSON)
def test_any_finite_json_value_reads_as_json_reads_it(value):
    body = json.dumps(value).encode()
    assert read_request_json(body) == json.loads(body)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_read_or_are_refused_with_the_reason(body):
    try:
        read_request_json(body)
    except RequestJsonError as error:
        assert str(error)


def test_a_value_built_in_python_is_checked_the_same_way():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(RequestJsonError, match="nested too deeply"):
        check_json_value(deep)
