"""The endpoint with real clients (the openai SDK, httpx) over a scripted engine: tool calls parsed, streaming,
token-exact records, branches, and every kind of bad request answered with its status while the run goes on."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from endpoint_helpers import EOS, LiveEndpoint, params, rows, scripted_rollout
from user_agents import CALCULATOR

from hybridflow.batch_keys import (
    AGENT_BRANCHES,
    AGENT_FAILURE,
    AGENT_METRICS,
    AGENT_PARSE_FAILURES,
    AGENT_REQUESTS,
    AGENT_REWARD,
    ATTENTION_MASK,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.models import load_tokenizer
from hybridflow.rollout.agent_server.rendering import tools_text

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "734 * 58"}}</tool_call>'
LIST_CALL = '<tool_call>[{"name": "calculator", "arguments": {"expression": "734 * 58"}}]</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def response_of(batch, row):
    n = int(batch.batch[ATTENTION_MASK][row, batch.batch[PROMPTS].shape[1] :].sum())
    return (
        batch.batch[RESPONSES][row, :n].tolist(),
        batch.batch[RESPONSE_MASK][row, :n].tolist(),
        batch.batch[ROLLOUT_LOG_PROBS][row, :n].tolist(),
    )


def test_an_openai_sdk_agent_calls_the_tool_and_is_rewarded(tokenizer):
    scripts = {
        0: [f"Let me compute. {CALL}{EOS}", f"The answer is 42572.{EOS}"],
        1: [f"{LIST_CALL}{EOS}", f"It is 42572{EOS}"],  # SmolLM2's list form
        2: [f"<tool_call>{{broken{EOS}", f"42572{EOS}"],  # does not parse: returned as text, counted
        3: [f"It is 40000.{EOS}"],
    }
    rollout = scripted_rollout(tokenizer, "calculator_agent", scripts)
    batch = rollout.generate_sequences(rows(["What is 734 * 58?"] * 4, ["42572"] * 4), params())
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == [""] * 4
    assert batch.non_tensor_batch[AGENT_REWARD].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert [m["calls"] for m in batch.non_tensor_batch[AGENT_METRICS]] == [1.0, 1.0, 0.0, 0.0]
    assert batch.batch[AGENT_REQUESTS].tolist() == [2, 2, 1, 1]
    assert batch.batch[AGENT_PARSE_FAILURES].tolist() == [0, 0, 1, 0]
    assert batch.batch[AGENT_BRANCHES].tolist() == [1, 1, 1, 1]

    # row 0, token for token: the prompt the endpoint rendered (the tools in the fallback format), the first turn
    # as generated, the tool message's tail as the template renders it, the second turn as generated
    engine = rollout.engine
    (first_request, prompt), (second_request, tail) = [c for c in engine.calls if c[0] // 4 == 0]
    assert first_request == second_request == 0  # the same engine request: the cached prefix is reused
    messages = [
        {"role": "system", "content": tools_text([CALCULATOR])},
        {"role": "user", "content": "What is 734 * 58?"},
    ]
    assert prompt == rollout.renderer.chat.conversation_ids(messages)
    assert tail == rollout.renderer.chat.tool_response_ids(["42572"])
    turn1 = tokenizer.encode(f"Let me compute. {CALL}{EOS}", add_special_tokens=False)
    turn2 = tokenizer.encode(f"The answer is 42572.{EOS}", add_special_tokens=False)
    tokens, mask, log_probs = response_of(batch, 0)
    assert tokens == turn1 + tail + turn2
    assert mask == [1] * len(turn1) + [0] * len(tail) + [1] * len(turn2)
    expected = [-(k + 1) / 100 for k in range(len(turn1))] + [0.0] * len(tail)
    expected += [-(len(turn1) + k + 1) / 100 for k in range(len(turn2))]
    assert log_probs == pytest.approx(expected)
    row_prompt = batch.batch[PROMPTS][0][batch.batch[ATTENTION_MASK][0, : batch.batch[PROMPTS].shape[1]].bool()]
    assert row_prompt.tolist() == prompt


def test_streaming_gives_the_same_turn(tokenizer, tmp_path):
    out = tmp_path / "stream.json"
    rollout = scripted_rollout(tokenizer, "streaming_agent", {0: [f"Computing {CALL}{EOS}"]})
    batch = rollout.generate_sequences(rows(["What is 734 * 58?"], extra=[{"out": str(out)}]), params())
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == [""]
    streamed = json.loads(out.read_text())
    url = streamed.pop("url")
    turn = tokenizer.encode(f"Computing {CALL}{EOS}", add_special_tokens=False)
    assert streamed == {
        "text": "Computing",
        "names": ["calculator"],
        "finish": "tool_calls",
        "completion_tokens": len(turn),
    }
    # the endpoint listened on loopback and stopped with the call: its port is closed
    host, port = url.split("//")[1].split("/")[0].split(":")
    assert host == "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)


def test_an_edited_history_starts_a_new_branch(tokenizer):
    scripts = {0: [f"{CALL}{EOS}", f"So 42572.{EOS}", f"Checked: 42000 is wrong.{EOS}"]}
    rollout = scripted_rollout(tokenizer, "edited_history_agent", scripts)
    batch = rollout.generate_sequences(rows(["What is 734 * 58?"]), params())
    assert batch.batch[AGENT_BRANCHES].tolist() == [2] and batch.batch[AGENT_REQUESTS].tolist() == [3]
    requests = [request for request, _ in rollout.engine.calls]
    assert requests == [0, 0, 1]  # continued on engine request 0; the edit started request 1 from its whole context
    # the sample is the latest branch: its prompt holds the edited history (never trained), then its one turn
    edited_prompt = rollout.engine.calls[2][1]
    assert "I think it is 42000." in tokenizer.decode(edited_prompt)
    tokens, mask, _ = response_of(batch, 0)
    assert tokens == tokenizer.encode(f"Checked: 42000 is wrong.{EOS}", add_special_tokens=False)
    assert mask == [1] * len(tokens)
    assert rollout.engine.released == {0, 1}


def test_bad_requests_get_their_status_and_the_run_goes_on(tokenizer, tmp_path):
    out = tmp_path / "statuses.json"
    scripts = {0: [f"fine{EOS}"], 1: [f"fine too{EOS}"]}
    rollout = scripted_rollout(tokenizer, "bad_requests_agent", scripts, max_prompt_tokens=512)
    rollout.function.__globals__["SEEN"].clear()  # the agents' file as the rollout loaded it
    rollout.function.__globals__["DONE"].clear()
    batch = rollout.generate_sequences(rows(["Hi", "Hello"], extra=[{"out": str(out)}, {}]), params(64))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    recorded = json.loads(out.read_text())
    assert recorded["model"] == "policy"
    assert recorded["statuses"] == {
        "no key": [401, "missing_api_key"],
        "wrong key": [401, "invalid_api_key"],
        "another session's id": [403, "wrong_session"],
        "another session's key": [403, "wrong_session"],
        "unknown session": [404, "session_not_found"],
        "malformed JSON": [400, "invalid_json"],
        "not an object": [400, "invalid_value"],
        "unknown model": [404, "model_not_found"],
        "no model": [400, "missing_required_parameter"],
        "n > 1": [400, "unsupported_value"],
        "context too long": [400, "context_length_exceeded"],
        "max_tokens over the budget": [400, "max_tokens_exceeded"],
        "unknown parameter": [400, "unknown_parameter"],
        "invalid tool schema": [400, "invalid_tool"],
        "tool parameters not an object": [400, "invalid_tool"],
        "other temperature": [400, "unsupported_value"],
        "image content": [400, "unsupported_content"],
        "empty messages": [400, "invalid_value"],
        "bad role": [400, "invalid_value"],
        "tool message without id": [400, "invalid_value"],
        "forced tool choice": [400, "unsupported_value"],
        "body too large": [413, "body_too_large"],
        "not JSON content type": [415, "unsupported_media_type"],
        "unknown route": [404, "unknown_url"],
        "wrong method": [405, "unknown_url"],
        "good": [200, "stop"],
    }
    # none of the refused requests reached the engine or the record: each session holds its one good turn
    assert batch.batch[AGENT_REQUESTS].tolist() == [1, 1]
    assert [tokens for tokens, _, _ in (response_of(batch, 0), response_of(batch, 1))] == [
        tokenizer.encode(f"fine{EOS}", add_special_tokens=False),
        tokenizer.encode(f"fine too{EOS}", add_special_tokens=False),
    ]


def test_a_failing_agent_leaves_only_its_sample(tokenizer):
    rollout = scripted_rollout(tokenizer, "failing_agent", {0: [f"a{EOS}"], 1: [], 2: [f"c{EOS}"]})
    batch = rollout.generate_sequences(rows(["x", "y", "z"]), params(32))
    failures = batch.non_tensor_batch[AGENT_FAILURE].tolist()
    assert failures[0] == failures[2] == "" and "the agent's own bug" in failures[1]
    assert batch.batch[RESPONSE_MASK][1].sum() == 0 and batch.batch[RESPONSE_MASK][0].sum() > 0
    assert torch.isnan(torch.tensor(batch.non_tensor_batch[AGENT_REWARD][1]))


def test_an_agents_sdk_agent_runs_its_tool_through_the_responses_api(tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "734 * 58"}}</tool_call>'
    scripts = {0: [f"{call}{EOS}", f"The answer is 42572.{EOS}"], 1: [f"Maybe 40000.{EOS}"]}
    rollout = scripted_rollout(tokenizer, "agents_sdk_agent", scripts)
    batch = rollout.generate_sequences(rows(["What is 734 * 58?"] * 2, ["42572"] * 2), params())
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    assert batch.non_tensor_batch[AGENT_REWARD].tolist() == [1.0, 0.0]
    assert batch.batch[AGENT_REQUESTS].tolist() == [2, 1] and batch.batch[AGENT_BRANCHES].tolist() == [1, 1]
    # the tool's answer went back as a function_call_output: the second turn continued the first branch
    (first, _), (second, tail) = [c for c in rollout.engine.calls if c[0] < 4]
    assert first == second == 0 and "42572" in tokenizer.decode(tail)


def test_external_agents_in_another_process_claim_sessions_and_post_rewards(tokenizer, tmp_path):
    endpoint_dir, out = tmp_path / "endpoint", tmp_path / "external.json"
    scripts = {0: [f"a{EOS}"], 1: [f"bb{EOS}"], 2: [f"ccc{EOS}"]}
    rollout = scripted_rollout(tokenizer, "", scripts, external=True, endpoint_dir=str(endpoint_dir))
    agent = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "external_agent.py"), str(endpoint_dir), "3", str(out)]
    )
    try:
        batch = rollout.generate_sequences(rows(["x", "y", "z"]), params(32))
    finally:
        agent.wait(timeout=120)
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", "", ""]
    assert batch.non_tensor_batch[AGENT_REWARD].tolist() == [0.01, 0.02, 0.03]
    assert [m["chars"] for m in batch.non_tensor_batch[AGENT_METRICS]] == [1.0, 2.0, 3.0]
    recorded = json.loads(out.read_text())
    assert sorted(d["row"] for d in recorded["done"]) == [0, 1, 2] and {d["status"] for d in recorded["done"]} == {200}
    assert recorded["checks"] == {
        "claim with a session key": 401,
        "reward not a number": 400,
        "reward without a key": 401,
        "reward after close": 410,
    }
    assert not list(endpoint_dir.glob("*.json"))  # the address went with the endpoint


GOOD = {"model": "policy", "messages": [{"role": "user", "content": "Hi"}]}


def _post_raw(http, url: str, key: str, body: bytes):
    return http.post(url, content=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_bodies_json_cannot_express_get_400_and_the_connection_stays_up(tokenizer):
    """JSON nested 50,000 deep (under the body bound), a lone surrogate in a message, NaN and 1e400: each a 400
    in the OpenAI error shape on the same connection, which then answers a good request."""
    deep = b'{"model": "policy", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    bodies = {
        "nested": deep,
        "lone surrogate": b'{"model": "policy", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "surrogate in a key": b'{"model": "policy", "messages": [{"role": "user", "content": "x", "\\udfff": 1}]}',
        "NaN": b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        "1e400": b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
    }
    with LiveEndpoint(tokenizer, {0: [f"fine{EOS}"]}) as endpoint, httpx.Client(timeout=30) as http:
        session = endpoint.open_session()
        url = f"{endpoint.session_url(session)}/chat/completions"
        for name, body in bodies.items():
            response = _post_raw(http, url, session.key, body)
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error", name
        response = http.post(url, json=GOOD, headers={"Authorization": f"Bearer {session.key}"})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "fine"
        root = f"{endpoint.base_url}/sessions/{session.id}"
        for route in ("/v1/responses", "/inference/v1/generate"):
            response = _post_raw(http, f"{root}{route}", session.key, deep)
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
                        },
                    }
                ]
            },
            "tools[0]",
            "'f'",
        ),  # noqa: E501
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "required": "x"}}}
                ]
            },
            "tools[0]",
            "'g'",
        ),  # noqa: E501
        ({"temperature": "1.0"}, "temperature", "number"),
        ({"stream": "false"}, "stream", "boolean"),
        ({"stream": 1}, "stream", "boolean"),
        ({"stream_options": "include_usage"}, "stream_options", "object"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
        ({"logprobs": "true"}, "logprobs", "boolean"),
        ({"n": True}, "n", "integer"),
        ({"max_tokens": 8.0}, "max_tokens", "integer"),
        ({"top_logprobs": False}, "top_logprobs", "integer"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_coerced(tokenizer, change, param, says):
    with LiveEndpoint(tokenizer, {}) as endpoint, httpx.Client(timeout=30) as http:
        session = endpoint.open_session()
        response = http.post(
            f"{endpoint.session_url(session)}/chat/completions",
            json={**GOOD, **change},
            headers={"Authorization": f"Bearer {session.key}"},
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
        assert endpoint.backend.engine.calls == []  # refused before anything was generated


@pytest.mark.parametrize("turn", [f"{CALL}{EOS}", EOS, f"Computing {CALL}{EOS}", f"plain text{EOS}"])
def test_streamed_log_probs_cover_every_token_as_unstreamed_ones_do(tokenizer, turn):
    """A turn of only tool calls, or of nothing but the end token, streams one log-prob per generated token: the
    same as the same turn unstreamed (the openai SDK reads both)."""
    with LiveEndpoint(tokenizer, {0: [turn], 1: [turn]}, response_length=128) as endpoint:
        streamed_session, whole_session = endpoint.open_session(), endpoint.open_session()
        kwargs = {"model": "policy", "messages": GOOD["messages"], "tools": [CALCULATOR], "logprobs": True}
        client = openai.OpenAI(base_url=endpoint.session_url(whole_session), api_key=whole_session.key, max_retries=0)
        whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
        client = openai.OpenAI(
            base_url=endpoint.session_url(streamed_session), api_key=streamed_session.key, max_retries=0
        )
        streamed = []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                streamed += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    n = len(tokenizer.encode(turn, add_special_tokens=False))
    assert len(whole) == n
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    assert [e.logprob for e in whole] == pytest.approx([-(k + 1) / 100 for k in range(n)])


def test_stopping_closes_kept_alive_connections_and_the_port(tokenizer):
    """Leaving ``running()`` (listener.py ``PromptStopServer``) closes a connection the client keeps alive after its
    answer (the client reads the end of the stream) and the listening port; the serving thread ends."""
    request = json.dumps(GOOD).encode()
    with LiveEndpoint(tokenizer, {0: [f"fine{EOS}"]}) as endpoint:
        session = endpoint.open_session()
        host, port = endpoint.base_url.removeprefix("http://").rsplit(":", 1)
        client = socket.create_connection((host, int(port)), timeout=10)
        head = (
            f"POST /sessions/{session.id}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {session.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(request)}\r\n\r\n"
        )
        client.sendall(head.encode() + request)
        answer = b""
        while b'"fine"' not in answer:  # the whole answer (HTTP/1.1: the connection stays open after it)
            answer += client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower()
    with client:
        assert not endpoint._thread.is_alive()
        assert client.recv(1) == b""  # closed by the server (a connection left open would time out here)
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), timeout=5):
        pass
