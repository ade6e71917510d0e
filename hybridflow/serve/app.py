"""The Tinker REST API over the training service (FastAPI): each route reads its body (bounded, parsed, checked),
calls the service, and answers JSON, or the protobuf the SDK asks for. Every request but the health check needs
an API key (``X-API-Key``); every refusal is JSON ``{"error", "category"}`` with a 4xx status (a 5xx only when the
worker is gone), and a client's error never reaches another's state (hybridflow/serve/service.py). The routes'
OpenAPI description (serve/openapi.py) is served at ``/api/v1/openapi.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from hybridflow.request_json import RequestJsonError, read_request_json
from hybridflow.serve import messages as m
from hybridflow.serve import openapi as doc
from hybridflow.serve.futures import USER, ServiceError
from hybridflow.serve.service import TrainingService
from hybridflow.serve.wire import PROTOBUF, BadRequest, decode_forward_backward

log = logging.getLogger("hybridflow.serve")
API = "/api/v1"
EXPIRY_CHECK_S = 5.0
NO_RETRY = {"x-should-retry": "false"}  # the SDK's HTTP client retries some codes unless told not to

RequestT = TypeVar("RequestT", bound=BaseModel)


API_KEY = APIKeyHeader(name="X-API-Key", scheme_name="APIKey", auto_error=False, description="a key of the service")
QUEUED = (400, 401, 404, 413, 429, 503)  # the refusals of a request that waits for the worker
NOT_QUEUED = (400, 401, 404, 413)  # of a request about something that may not exist, answered at once
FUTURE_LINKS = {"retrieve_future": doc.link("retrieve_future", request_id="request_id")}
MODEL_LINKS = {  # where a model request's answer leads
    **FUTURE_LINKS,
    "get_info": doc.link("get_info", model_id="model_id"),
    "optim_step": doc.link("optim_step", model_id="model_id"),
    "save_weights": doc.link("save_weights", model_id="model_id"),
    "save_weights_for_sampler": doc.link("save_weights_for_sampler", model_id="model_id"),
    "load_weights": doc.link("load_weights", model_id="model_id"),
}


def refusal(status: int, message: str, category: str = USER) -> JSONResponse:
    headers = NO_RETRY if status < 500 and status not in (408, 429) else None
    return JSONResponse({"error": message, "category": category, "detail": message}, status, headers=headers)


class RequestReader:
    """What every route reads first: the caller's key (its owner) and the body, within the service's bounds."""

    def __init__(self, max_bytes: int, api_keys: dict[str, str]):
        self.max_bytes = max_bytes
        self.api_keys = api_keys  # owner name -> key

    async def owner_of(self, key: str | None = Security(API_KEY)) -> str:
        """The owner of the request's key; 401 without a key of this service."""
        found = None
        for owner, known in self.api_keys.items():  # every key compared, in constant time
            if hmac.compare_digest((key or "").encode(), known.encode()):
                found = owner
        if found is None:
            raise ServiceError("a valid API key is required in the X-API-Key header", 401)
        return found

    async def body_bytes(self, request: Request) -> bytes:
        max_bytes = self.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ServiceError(f"the body is {declared} bytes; at most {max_bytes} (limits.max_body_bytes)", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise ServiceError(f"the body is over {max_bytes} bytes (limits.max_body_bytes)", 413)
        return bytes(body)

    async def parsed(self, request: Request, model: type[RequestT]) -> RequestT:
        body = await self.body_bytes(request)
        if request.headers.get("content-encoding"):
            raise ServiceError(f"content-encoding {request.headers['content-encoding']!r} is not taken; send it plain")
        try:
            return model.model_validate(read_request_json(body or b"{}"))
        except RequestJsonError as error:
            raise ServiceError(str(error)) from None
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()[:5])
            raise ServiceError(f"{model.__name__}: {problems}") from None


def _lifespan(service: TrainingService) -> Callable:
    """The service's start and stop with the server's, and the expiry of silent sessions while it runs."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()

        async def expire() -> None:
            while True:
                await asyncio.sleep(EXPIRY_CHECK_S)
                service.expire_sessions()

        task = asyncio.create_task(expire())
        try:
            yield
        finally:
            task.cancel()
            service.stop()

    return lifespan


def build_app(service: TrainingService, api_keys: dict[str, str]) -> FastAPI:
    """The API over ``service``; ``api_keys``: owner name -> key."""
    app = FastAPI(
        title="hybridflow training service (Tinker API)",
        lifespan=_lifespan(service),
        openapi_url=None,  # served below, behind the key
        docs_url=None,
        redoc_url=None,
    )
    reader = RequestReader(service.limits.max_body_bytes, api_keys)
    _error_handlers(app)
    for routes in (_service_routes, _session_routes, _training_routes, _weights_routes, _sampling_routes):
        routes(app, service, reader)

    def openapi_schema() -> dict:
        if app.openapi_schema is None:
            rank = service.config.model.max_lora_rank
            served = service.served
            app.openapi_schema = doc.schema_of(app, service.limits, served.name, served.vocab_size, rank)
        return app.openapi_schema

    app.openapi = openapi_schema  # type: ignore[method-assign]
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every refusal in the one error shape, and any failure a 500 that names no more than its type."""

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return refusal(error.status, str(error), "server" if error.status >= 500 else USER)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            return refusal(404, f"no endpoint {request.method} {request.url.path} in this service")
        if error.status_code == 405:
            return refusal(405, f"{request.url.path} does not take {request.method}")
        return refusal(error.status_code, str(error.detail), "server" if error.status_code >= 500 else USER)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5])
        return refusal(400, f"the request is malformed: {problems}")

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return refusal(500, f"the service failed on this request: {type(error).__name__}", "server")


def _body_route(
    app: FastAPI,
    reader: RequestReader,
    name: str,
    body: type[RequestT],
    call: Callable[[str, RequestT], Any],
    reply: type[BaseModel],
    **described: Any,
) -> None:
    """The route of a call that takes one JSON ``body`` message: ``POST {API}/<name>`` answers ``call(owner, body)``;
    its OpenAPI operation is ``name``, its 200 answer ``reply`` (``described``: doc.route's errors and links)."""

    async def route(request: Request, owner: str = Security(reader.owner_of)):
        return call(owner, await reader.parsed(request, body))

    app.post(f"{API}/{name}", name=name, **doc.route(name, reply, body=body, **described))(route)


def _service_routes(app: FastAPI, service: TrainingService, reader: RequestReader) -> None:
    """The service itself: health, its OpenAPI document, the SDK's settings, capabilities, telemetry."""

    @app.get(f"{API}/healthz", **doc.route("healthz", doc.Health, errors=(503,)))
    async def healthz():
        if service.worker_lost is not None:
            return refusal(503, service.worker_lost, "server")
        return {"status": "ok"}

    @app.get(f"{API}/openapi.json", include_in_schema=False)
    async def openapi(owner: str = Security(reader.owner_of)) -> dict:
        return app.openapi()

    @app.post(f"{API}/client/config", **doc.route("client_config", doc.ClientConfigReply, errors=(401, 413)))
    async def client_config(request: Request, owner: str = Security(reader.owner_of)):
        await reader.body_bytes(request)
        return service.client_config()

    @app.post(
        f"{API}/client/dynamic_config", **doc.route("client_dynamic_config", doc.DynamicConfigReply, errors=(401, 413))
    )
    async def client_dynamic_config(request: Request, owner: str = Security(reader.owner_of)):
        await reader.body_bytes(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(
        f"{API}/get_server_capabilities", **doc.route("get_server_capabilities", doc.CapabilitiesReply, errors=(401,))
    )
    async def capabilities(owner: str = Security(reader.owner_of)):
        return service.capabilities()

    @app.post(f"{API}/telemetry", **doc.route("telemetry", doc.TelemetryReply, errors=(401, 413)))
    async def telemetry(request: Request, owner: str = Security(reader.owner_of)):
        await reader.body_bytes(request)  # read and dropped: this service keeps no client telemetry
        return {"status": "accepted"}


def _session_routes(app: FastAPI, service: TrainingService, reader: RequestReader) -> None:
    """Sessions: started, kept alive, finished."""
    session_links = {
        "create_model": doc.link("create_model", session_id="session_id"),
        "create_sampling_session": doc.link("create_sampling_session", session_id="session_id"),
        "session_heartbeat": doc.link("session_heartbeat", session_id="session_id"),
        "load_weights": doc.link("load_weights", session_id="session_id"),
        "finish_session": doc.path_link("finish_session", "session_id", "session_id"),
    }

    body_route = functools.partial(_body_route, app, reader)
    body_route("create_session", m.CreateSession, service.create_session, doc.SessionReply, links=session_links)

    @app.post(
        f"{API}/session_heartbeat",
        **doc.route("session_heartbeat", doc.HeartbeatReply, body=m.SessionRef, errors=NOT_QUEUED),
    )
    async def heartbeat(request: Request, owner: str = Security(reader.owner_of)):
        return service.heartbeat(owner, (await reader.parsed(request, m.SessionRef)).session_id)

    @app.post(
        f"{API}/sessions/{{session_id}}/finish",
        **doc.route("finish_session", doc.FinishReply, errors=(401, 404, 413, 503)),
    )
    async def finish_session(session_id: str, request: Request, owner: str = Security(reader.owner_of)):
        await reader.body_bytes(request)
        service.end_session(service.session(owner, session_id))
        return {}


def _training_routes(app: FastAPI, service: TrainingService, reader: RequestReader) -> None:
    """Training models: created, described, trained, saved and loaded (each a future)."""
    body_route = functools.partial(_body_route, app, reader)
    body_route("create_model", m.CreateModel, service.create_model, doc.ModelFuture, errors=QUEUED, links=MODEL_LINKS)

    @app.post(f"{API}/get_info", **doc.route("get_info", doc.InfoReply, body=m.ModelRef, errors=NOT_QUEUED))
    async def get_info(request: Request, owner: str = Security(reader.owner_of)):
        return service.get_info(owner, (await reader.parsed(request, m.ModelRef)).model_id)

    @app.post(
        f"{API}/forward_backward",
        **doc.route("forward_backward", doc.ModelFuture, body="protobuf", errors=(*QUEUED, 415), links=FUTURE_LINKS),
    )
    async def forward_backward(request: Request, owner: str = Security(reader.owner_of)):
        body = await reader.body_bytes(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type != PROTOBUF:
            raise ServiceError(f"forward_backward takes a {PROTOBUF} body (the SDK's), not {content_type!r}", 415)
        if request.headers.get("content-encoding"):
            raise ServiceError("compressed forward_backward bodies are not taken (client/config says so)")
        try:
            call = decode_forward_backward(body)
        except BadRequest as error:
            raise ServiceError(str(error)) from None
        return service.forward_backward(owner, call)

    body_route("optim_step", m.OptimStep, service.optim_step, doc.ModelFuture, errors=QUEUED, links=FUTURE_LINKS)


def _weights_routes(app: FastAPI, service: TrainingService, reader: RequestReader) -> None:
    """A model's weights saved (for training on, or for sampling) and loaded (each a future)."""
    weights = (
        ("save_weights", m.SaveWeights, service.save_weights, FUTURE_LINKS),
        ("save_weights_for_sampler", m.SaveWeightsForSampler, service.save_weights_for_sampler, FUTURE_LINKS),
        ("load_weights", m.LoadWeights, service.load_weights, MODEL_LINKS),
    )
    for name, body, call, links in weights:
        _body_route(app, reader, name, body, call, doc.ModelFuture, errors=QUEUED, links=links)


def _sampling_routes(app: FastAPI, service: TrainingService, reader: RequestReader) -> None:
    """Sampling sessions, samples, and the futures' results."""
    sampler_links = {
        "asample": doc.link("asample", sampling_session_id="sampling_session_id"),
        "get_sampler": doc.path_link("get_sampler", "sampler_id", "sampling_session_id"),
    }

    body_route = functools.partial(_body_route, app, reader)
    body_route(
        "create_sampling_session",
        m.CreateSamplingSession,
        service.create_sampling_session,
        doc.SamplingSessionReply,
        errors=NOT_QUEUED,
        links=sampler_links,
    )

    @app.get(f"{API}/samplers/{{sampler_id}}", **doc.route("get_sampler", doc.SamplerReply, errors=(401, 404)))
    async def get_sampler(sampler_id: str, owner: str = Security(reader.owner_of)):
        return service.get_sampler(owner, sampler_id)

    body_route("asample", m.Sample, service.sample, doc.SampleFuture, errors=QUEUED, links=FUTURE_LINKS)

    results = {"anyOf": [doc.ref(model) for model in doc.FUTURE_RESULTS]}

    @app.post(
        f"{API}/retrieve_future",
        **doc.route(
            "retrieve_future", results, body=m.RetrieveFuture, errors=(400, 401, 404, 406, 413), reply_protobuf=True
        ),
    )
    async def retrieve_future(request: Request, owner: str = Security(reader.owner_of)) -> Any:
        call = await reader.parsed(request, m.RetrieveFuture)
        outcome = await service.retrieve(owner, call.request_id)
        if outcome is None:
            return {"type": "try_again", "request_id": call.request_id, "queue_state": "active"}
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if isinstance(outcome.payload, bytes):
            if PROTOBUF not in request.headers.get("accept", ""):
                raise ServiceError(f"this result is protobuf: ask for it with 'Accept: {PROTOBUF}'", 406)
            return Response(outcome.payload, media_type=PROTOBUF)
        return outcome.payload
