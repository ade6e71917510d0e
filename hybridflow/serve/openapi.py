"""The training service's OpenAPI description: each route's request body (the pydantic models of messages.py, or the
SDK's protobuf), its answers (the replies below, and every refusal as ``ErrorBody`` with the statuses it can have),
the API key it needs (``X-API-Key``), and the links from one answer to the next request (a session's id to the models
made in it, a future's id to its result). The bounds that come from the service's config (``limits.*``, the model's
vocabulary and LoRA rank) are written into the schema, so that what it describes is what the service takes.

The service serves it at ``GET /api/v1/openapi.json`` (with a key); tests/serve/test_service_fuzz.py fuzzes the
service from it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from hybridflow.serve import messages as m
from hybridflow.serve.config import LimitsConfig
from hybridflow.serve.wire import PROTOBUF

REF = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}  # every model a route names, by name: written into the components


class ErrorBody(BaseModel):
    """A refusal: the reason, the SDK's error category, and the reason again as FastAPI clients read it."""

    error: str
    category: Literal["user", "server"]
    detail: str


class Health(BaseModel):
    status: Literal["ok"]


class ClientConfigReply(BaseModel):
    pjwt_auth_enabled: bool
    parallel_fwdbwd_chunks: bool
    proto_compress_fwdbwd: bool
    fwdbwd_max_chunk_len: int
    fwdbwd_max_chunk_bytes_count: int
    sample_use_retrieve_futures: bool
    custom_loss_server_side: bool
    sample_join_sampling_session: bool
    use_pyqwest_transport: bool


class DynamicConfigReply(BaseModel):
    refresh_interval_sec: int
    sample_cancel_enabled: bool


class SupportedModel(BaseModel):
    model_name: str
    max_context_length: int
    trainable: bool
    sampleable: bool


class CapabilitiesReply(BaseModel):
    supported_models: list[SupportedModel]


class TelemetryReply(BaseModel):
    status: Literal["accepted"]


class SessionReply(BaseModel):
    type: Literal["create_session"]
    session_id: str


class HeartbeatReply(BaseModel):
    type: Literal["session_heartbeat"]


class FinishReply(BaseModel):
    pass


class ModelFuture(BaseModel):
    """A model's request, answered at once: its result is fetched with ``retrieve_future``."""

    request_id: str
    model_id: str


class SampleFuture(BaseModel):
    request_id: str
    sample_sequence_ids: list[str]


class ModelData(BaseModel):
    arch: str
    model_name: str
    tokenizer_id: str


class InfoReply(BaseModel):
    type: Literal["get_info"]
    model_data: ModelData
    model_id: str
    is_lora: bool
    lora_rank: int
    model_name: str


class SamplingSessionReply(BaseModel):
    type: Literal["create_sampling_session"]
    sampling_session_id: str


class SamplerReply(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None


class TryAgain(BaseModel):
    type: Literal["try_again"]
    request_id: str
    queue_state: Literal["active"]


class FailedRequest(BaseModel):
    """A request that failed in its turn: the reason and its category (the SDK raises RequestFailedError)."""

    error: str
    category: Literal["user", "server"]


class ModelCreated(BaseModel):
    type: Literal["create_model"]
    model_id: str


class OptimStepResult(BaseModel):
    type: Literal["optim_step"]
    metrics: dict[str, float]


class WeightsSaved(BaseModel):
    type: Literal["save_weights"]
    path: str


class SamplerWeightsSaved(BaseModel):
    """Saved under a name (``path``), or as a snapshot that a new sampling session reads (``sampling_session_id``)."""

    type: Literal["save_weights_for_sampler"]
    path: str | None = None
    sampling_session_id: str | None = None


class WeightsLoaded(BaseModel):
    type: Literal["load_weights"]
    path: str
    model_id: str


# what retrieve_future answers as JSON: not ready yet, failed, or the result of a request of each kind (forward and
# sample results are protobuf)
FUTURE_RESULTS = (
    TryAgain,
    FailedRequest,
    ModelCreated,
    OptimStepResult,
    WeightsSaved,
    SamplerWeightsSaved,
    WeightsLoaded,
)


def ref(model: type[BaseModel]) -> dict:
    _MODELS[model.__name__] = model
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


ERRORS = {
    400: "the request is malformed or asks what the service does not do (the reason says which)",
    401: "no valid API key in X-API-Key",
    404: "no such session, model, sampler, request or saved path (or another key's)",
    406: "the result is protobuf: ask for it with Accept: application/x-protobuf",
    413: "the body is over limits.max_body_bytes",
    415: "forward_backward takes the SDK's protobuf body",
    429: "limits.max_queued_requests requests wait for the worker: try later",
    503: "the worker is gone: the service stops (saved weights and states survive)",
}


def route(
    operation_id: str,
    reply: type[BaseModel] | dict,
    *,
    body: type[BaseModel] | Literal["protobuf"] | None = None,
    errors: tuple[int, ...] = (400, 401, 413),
    links: dict[str, dict] | None = None,
    reply_protobuf: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of a route's decorator that describe it: ``reply`` answers 200 (a model, or a schema),
    each of ``errors`` is an ``ErrorBody``, ``links`` (name -> OpenAPI link) lead from the 200 answer to requests
    that use its ids."""
    ok: dict[str, Any] = {"description": "answered", "content": _json(ref(reply) if isinstance(reply, type) else reply)}
    if reply_protobuf:
        ok["content"][PROTOBUF] = {"schema": {"type": "string", "format": "binary"}}
    if links:
        ok["links"] = links
    responses: dict[int | str, Any] = {200: ok}
    for status in errors:
        responses[status] = {"description": ERRORS[status], "content": _json(ref(ErrorBody))}
    extra: dict[str, Any] = {}
    if body == "protobuf":
        schema = {"type": "string", "format": "binary"}
        extra["requestBody"] = {"required": True, "content": {PROTOBUF: {"schema": schema}}}
    elif body is not None:
        extra["requestBody"] = {"required": True, "content": _json(ref(body))}
    return {"operation_id": operation_id, "response_model": None, "responses": responses, "openapi_extra": extra}


def link(operation_id: str, **fields: str) -> dict:
    """A link to ``operation_id`` whose body takes each of ``fields`` from the answer's field of that name (or the
    path given): ``session_id="session_id"``."""
    body = {name: f"$response.body#/{source}" for name, source in fields.items()}
    return {"operationId": operation_id, "requestBody": body}


def path_link(operation_id: str, parameter: str, source: str) -> dict:
    return {"operationId": operation_id, "parameters": {f"path.{parameter}": f"$response.body#/{source}"}}


def schema_of(app: FastAPI, limits: LimitsConfig, served: str, vocab_size: int, max_lora_rank: int) -> dict:
    """The OpenAPI document of ``app``: its routes as FastAPI describes them, with the models they name and this
    service's bounds."""
    document = get_openapi(title=app.title, version="1", description=__doc__.split("\n\n")[0], routes=app.routes)
    _, defs = models_json_schema([(model, "validation") for model in _MODELS.values()], ref_template=REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which this service never answers
        schemas.pop(name, None)
    for operations in document["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    _bound(schemas, limits, served, vocab_size, max_lora_rank)
    return document


def _bound(schemas: dict, limits: LimitsConfig, served: str, vocab_size: int, max_lora_rank: int) -> None:
    """What this service takes, where the schema can say it: the config's bounds, the one base model, text chunks,
    and none of the Tinker API's fields that it does not serve (docs/serve.md)."""
    for model in (m.CreateModel, m.CreateSamplingSession, m.LoadWeights, m.Sample):
        field = schemas[model.__name__]["properties"]["base_model"]
        (field["anyOf"][0] if "anyOf" in field else field)["enum"] = [served]
    schemas[m.Chunk.__name__]["properties"]["type"]["enum"] = ["encoded_text"]
    schemas[m.OptimizerSettings.__name__]["properties"]["type"]["enum"] = ["adamw"]
    create = schemas[m.CreateModel.__name__]
    create["properties"]["lora_config"] = {"$ref": REF.format(model=m.LoraSettings.__name__)}  # LoRA only
    create["required"].append("lora_config")
    sample = schemas[m.Sample.__name__]["properties"]
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        sample[name]["maximum"] = 0
    sample["target_prompt_logprobs"] = {"type": "null", "default": None}
    sample["record_stability_info"] = {"enum": [False, None], "default": None}
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    chunk = schemas[m.Chunk.__name__]
    chunk["properties"]["tokens"] = {
        "type": "array",
        "items": token,
        "minItems": 1,
        "maxItems": limits.max_tokens_per_datum,
    }
    chunk["required"] = ["tokens"]
    schemas[m.Sample.__name__]["properties"]["num_samples"]["maximum"] = limits.max_samples_per_request
    max_tokens = schemas[m.SamplingSettings.__name__]["properties"]["max_tokens"]["anyOf"][0]
    max_tokens["maximum"] = limits.max_new_tokens
    schemas[m.LoraSettings.__name__]["properties"]["rank"]["maximum"] = max_lora_rank
