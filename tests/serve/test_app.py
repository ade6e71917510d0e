"""The service's HTTP layer without a worker (seconds): bodies it must refuse as the client's mistake (400 in the
Tinker error shape, never a 500), its OpenAPI description, and the forward_backward chunks the pinned SDK forms
from what ``client/config`` tells it."""

from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker.lib.public_interfaces.training_client import TrainingClient

from hybridflow.serve import messages as m
from hybridflow.serve.app import build_app
from hybridflow.serve.config import load_serve_config
from hybridflow.serve.service import ServedModel, TrainingService
from hybridflow.validation import ConfigError

KEY = "tml-hybridflow-test-key-a"


def make_service(tmp_path, *overrides: str) -> TrainingService:
    config = load_serve_config([f"service.storage_dir={tmp_path}", "model.path=tiny-llama", *overrides])
    served = ServedModel("tiny-llama", str(tmp_path), "llama", 512, 2048, frozenset())
    return TrainingService(config, backend=None, served=served, api_keys={"a": KEY})


@pytest.fixture
def http(tmp_path):
    """The app over a service whose worker is never reached (no lifespan: create_session needs none)."""
    service = make_service(tmp_path)
    return TestClient(build_app(service, {"a": KEY}), raise_server_exceptions=False)


def post(http, path: str, body: bytes) -> tuple[int, dict]:
    response = http.post(
        f"/api/v1/{path}", content=body, headers={"X-API-Key": KEY, "Content-Type": "application/json"}
    )
    return response.status_code, response.json()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"tags": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),  # was a RecursionError: 500
        (b'{"display_name": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"user_metadata": {"\\udfff": 1}}', "lone UTF-16 surrogate"),
        (b'{"user_metadata": {"x": NaN}}', "numbers must be finite"),
        (b'{"user_metadata": {"x": 1e400}}', "out of range"),
        (b'{"sdk_version": "\xff"}', "not UTF-8"),
    ],
)
def test_a_body_that_is_not_json_the_service_takes_is_the_client_s_400(http, body, reason):
    status, answer = post(http, "create_session", body)
    assert status == 400, answer
    assert reason in answer["error"] and answer["category"] == "user" and answer["detail"] == answer["error"]


def test_the_openapi_schema_describes_the_request_bodies_answers_and_key(http, tmp_path):
    assert http.get("/api/v1/openapi.json").status_code == 401  # behind the key, as every route but the health check
    schema = http.get("/api/v1/openapi.json", headers={"X-API-Key": KEY}).json()
    assert schema["components"]["securitySchemes"]["APIKey"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": "a key of the service",
    }
    operations = {op["operationId"]: op for ops in schema["paths"].values() for op in ops.values()}
    bodies = {
        "create_session": m.CreateSession,
        "create_model": m.CreateModel,
        "optim_step": m.OptimStep,
        "asample": m.Sample,
        "retrieve_future": m.RetrieveFuture,
    }
    for name, model in bodies.items():
        body = operations[name]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(schema["components"]["schemas"][model.__name__]["properties"]) == set(model.model_fields)
    fb = operations["forward_backward"]["requestBody"]["content"]
    assert list(fb) == ["application/x-protobuf"]
    for name, operation in operations.items():
        assert ("security" in operation) == (name != "healthz")
        for status, answer in operation["responses"].items():
            if status.startswith("4"):
                assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
        assert "422" not in operation["responses"]
    # the config's bounds are the schema's
    sample = schema["components"]["schemas"]["Sample"]["properties"]
    assert sample["num_samples"]["maximum"] == 64
    links = operations["create_session"]["responses"]["200"]["links"]
    assert links["create_model"]["requestBody"] == {"session_id": "$response.body#/session_id"}


def sdk_chunks(config: dict, data: list[types.Datum]) -> list[list[types.Datum]]:
    """The chunks the pinned SDK's TrainingClient cuts ``data`` into under ``config`` (client/config's answer)."""
    client = SimpleNamespace(holder=SimpleNamespace(_client_config=types.ClientConfigResponse(**config)))
    return [chunk.data for chunk in TrainingClient._chunked_requests_generator(client, data)]


def datums(count: int, tokens: int, loss_inputs: tuple[str, ...] = ("weights",)) -> list[types.Datum]:
    inputs = {"target_tokens": np.zeros(tokens, np.int64), **{k: np.zeros(tokens, np.float32) for k in loss_inputs}}
    return [types.Datum(model_input=types.ModelInput.from_ints([1] * tokens), loss_fn_inputs=inputs)] * count


@pytest.mark.parametrize("loss_inputs", [("weights",), ("logprobs", "advantages")])
def test_the_sdk_chunks_an_ordinary_large_batch_within_every_request_bound(tmp_path, loss_inputs):
    """66 datums of 4,000 tokens under the default limits: each chunk the SDK forms is within the datum, token and
    byte bounds (the SDK is told no token bound: the bytes it is told imply it)."""
    service = make_service(tmp_path)
    limits = service.limits
    chunks = sdk_chunks(service.client_config(), datums(66, 4000, loss_inputs))
    assert sum(len(c) for c in chunks) == 66
    for chunk in chunks:
        assert len(chunk) <= limits.max_datums_per_request
        assert sum(d.model_input.length for d in chunk) <= limits.max_tokens_per_request
    tight = make_service(tmp_path, "limits.max_tokens_per_request=4096")  # a datum at the request's bound goes alone
    assert [len(c) for c in sdk_chunks(tight.client_config(), datums(3, 4096, loss_inputs))] == [1, 1, 1]


def test_a_datum_over_the_request_s_tokens_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="max_tokens_per_datum"):
        make_service(tmp_path, "limits.max_tokens_per_datum=5000", "limits.max_tokens_per_request=4096")
