"""The agent endpoint fuzzed from its own OpenAPI document (schemathesis over real HTTP, scripted engine).

For every operation, HYBRIDFLOW_FUZZ_EXAMPLES (default 60; `make fuzz`: 1000) generated requests that the schema
allows and as many that it does not, each with a valid key (a session's, the run's to claim, a fresh external
session's to post a reward). Every answer must be no server error, of a documented status and content type, and of
its documented schema; every request the schema does not allow must get a 4xx. Derandomized: a failure repeats.
"""

import os
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from endpoint_helpers import EOS, LiveEndpoint
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from hybridflow.models import load_tokenizer

EXAMPLES = int(os.environ.get("HYBRIDFLOW_FUZZ_EXAMPLES", "60"))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
# the engine's turns, in turn: text, a tool call, only the end token, broken markup, cut by the budget (no end)
TURNS = [f"Hello there{EOS}", f"{CALL}{EOS}", EOS, f"<tool_call>{{broken{EOS}", "and on " * 20]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
CONFIG = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": ["4XX"]}}})


class Fuzzer:
    """Sends an operation's generated requests to the endpoint, each with a valid key, and keeps what failed."""

    def __init__(self, endpoint: LiveEndpoint):
        self.endpoint = endpoint
        self.session = endpoint.open_session()  # the chat and token routes' session
        endpoint.open_session(external=True)  # waiting: a claim gets it
        self.http = requests.Session()
        self.sent, self.failures, self.statuses = 0, [], Counter()

    def key_and_session(self, path: str) -> tuple[str, str | None]:
        if path == "/v1/sessions/claim":
            return self.endpoint.run_key, None
        if path.endswith("/reward"):  # a reward ends its session: each goes to a fresh external one
            fresh = self.endpoint.open_session(external=True)
            return fresh.key, fresh.id
        return self.session.key, self.session.id

    def run(self, operation, mode: GenerationMode) -> None:
        fixed = {"session_id": self.session.id} if "{session_id}" in operation.path else None
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed, headers={"Authorization": "-"})
        route = operation.path.removeprefix("/sessions/{session_id}")

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def fuzz(case):
            key, session_id = self.key_and_session(operation.path)
            if session_id is not None:
                case.path_parameters = {**case.path_parameters, "session_id": session_id}
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
            response = None
            try:
                response = case.call(base_url=self.endpoint.base_url, session=self.http, timeout=30)
                self.sent += 1
                self.statuses[f"{route} {response.status_code}"] += 1
                case.validate_response(response, checks=CHECKS)
            except (AssertionError, BaseExceptionGroup, requests.RequestException) as error:
                self.failures.append(_failure(case, response, error))

        fuzz()


def _failure(case, response, error: BaseException) -> str:
    status = response.status_code if response is not None else "no answer"
    answer = response.text[:300] if response is not None else ""
    return (
        f"{case.operation.label} {status}: {str(error).strip()[:600]}\n  body sent: {str(case.body)[:300]}\n"
        f"  answer: {answer}"
    )


@pytest.mark.slow
def test_the_endpoint_answers_generated_requests_as_its_schema_says():
    turns = TURNS * (EXAMPLES * 20 // len(TURNS) + 1)
    limits = dict(
        max_requests_per_session=10**9,
        max_requests_per_second=1e9,
        max_branches_per_session=10**7,
        max_sessions=10**6,
        max_prompt_tokens=256,
    )
    with LiveEndpoint(load_tokenizer("tiny-llama"), {0: turns}, response_length=32, **limits) as endpoint:
        fuzzer = Fuzzer(endpoint)
        schema = schemathesis.openapi.from_dict(endpoint.app.openapi(), config=CONFIG)
        for result in schema.get_all_operations():
            operation = result.ok()
            fuzzer.run(operation, GenerationMode.POSITIVE)
            if operation.body:  # requests the schema does not allow: their bodies
                fuzzer.run(operation, GenerationMode.NEGATIVE)
        # and the endpoint still answers a plain client
        session = fuzzer.session
        answer = httpx.post(
            f"{endpoint.session_url(session)}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {session.key}"},
            timeout=30,
        )
        assert answer.status_code == 200
    sent, failures = fuzzer.sent, fuzzer.failures
    print(f"\nendpoint fuzz: {sent} requests, {len(failures)} failures ({EXAMPLES} examples per operation and mode)")
    print("answers:", ", ".join(f"{k}: {n}" for k, n in sorted(fuzzer.statuses.items())))
    for failure in failures[:20]:
        print(failure)
    assert not failures, f"{len(failures)} of {sent} requests failed their checks:\n" + "\n".join(failures[:5])
