"""The training service fuzzed from its own OpenAPI description (``GET /api/v1/openapi.json``) by schemathesis, over
real HTTP with a valid key: every generated request, valid or not, is answered 2xx or 4xx (never a 5xx: the worker is
never lost here) as the schema says, in the status, content type and body shape it declares; a request that fails in
its turn on the worker fails as the client's (``category: user``), never as the service's.

The run has schemathesis's phases: boundary values of each body (coverage), requests generated per operation (fuzzing,
valid and invalid bodies) and sequences that follow the schema's links (stateful: a session's id into the models made
in it, a future's id into ``retrieve_future``). Seeded and deterministic; ``HYBRIDFLOW_FUZZ_EXAMPLES`` requests per
operation (60: the slow tier; ``make fuzz`` runs 1,000). The service has small bounds (``FUZZ_LIMITS``), written into
the schema, so that what is generated stays small and the tiny model answers fast.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from schemathesis.engine import events
from service_helpers import KEY, running_service

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

EXAMPLES = int(os.environ.get("HYBRIDFLOW_FUZZ_EXAMPLES", "60"))
SEED = 20240601
FUZZ_LIMITS = (
    "limits.max_body_bytes=262144",
    "limits.max_datums_per_request=4",
    "limits.max_tokens_per_datum=32",
    "limits.max_tokens_per_request=64",
    "limits.max_samples_per_request=3",
    "limits.max_new_tokens=6",
    "limits.max_models=32",
    "limits.max_sessions=100000",  # every stateful run opens sessions; none sends a heartbeat
    "service.session_timeout_s=20",
    "service.poll_timeout_s=0.2",
)
# forward_backward's body as generated (bytes) goes as it is: the service's decoder takes it or refuses it
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")


@schemathesis.check
def no_server_failure_in_a_future(ctx, response, case):
    """A request that failed on the worker is answered by retrieve_future as the client's error or not at all: a
    ``server`` category there is a 500 in disguise."""
    if case.operation.path.endswith("/retrieve_future") and response.status_code == 200:
        if "json" in response.headers.get("content-type", [""])[0]:
            body = response.json()
            if isinstance(body, dict) and body.get("category") == "server":
                raise AssertionError(f"a request failed in the service: {body.get('error')}")
    return None


CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    no_server_failure_in_a_future.__name__,
)


def fuzz_config(examples: int) -> schemathesis.Config:
    checks = {"enabled": False, **{name: {"enabled": True} for name in CHECKS}}
    generation = {"mode": "all", "max-examples": examples, "deterministic": True, "database": "none"}
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "headers": {"X-API-Key": KEY},
            "request-timeout": 60,
            "generation": generation,
            "checks": checks,
            "phases": {
                "examples": {"enabled": False},
                "stateful": {"enabled": True, "max-steps": 8},
            },
            "suppress-health-check": ["all"],
        }
    )


def fuzz(schema) -> tuple[Counter, list[str], list[str]]:
    """Runs schemathesis's phases on ``schema``: the statuses of the requests sent, the checks that failed, and the
    errors of the run itself."""
    statuses, failures, errors = Counter(), [], []
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            recorder = event.recorder
            statuses.update(i.response.status_code for i in recorder.interactions.values() if i.response is not None)
            for nodes in recorder.checks.values():
                failures += [f"{recorder.label}: {n.name}: {n.failure_info.failure}" for n in nodes if n.failure_info]
        elif isinstance(event, events.NonFatalError | events.FatalError):
            errors.append(str(event.info if isinstance(event, events.NonFatalError) else event.exception))
    return statuses, failures, errors


def test_every_generated_request_is_answered_as_the_schema_says(tmp_path):
    with running_service(tmp_path / "storage", tmp_path / "service.log", *FUZZ_LIMITS) as service:
        schema = schemathesis.openapi.from_url(
            f"{service.url}/api/v1/openapi.json", headers={"X-API-Key": KEY}, config=fuzz_config(EXAMPLES)
        )
        schema.config.update(base_url=service.url)
        statuses, failures, errors = fuzz(schema)
        server_errors = sum(count for status, count in statuses.items() if status >= 500)
        print(f"\nservice fuzz: {statuses.total()} requests, {server_errors} server errors, {len(failures)} failures")
        print(f"service fuzz: statuses {dict(sorted(statuses.items()))}")
        assert service.alive()
    assert not errors, "\n".join(errors[:10])
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(sorted(set(failures))[:30])
    assert statuses.total() > 0 and server_errors == 0
