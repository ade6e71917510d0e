"""The Tinker REST API over the training service (FastAPI): each route reads its body (bounded, parsed, checked),
calls the service, and answers JSON, or the protobuf the SDK asks for. Every request but the health check needs
an API key (``X-API-Key``); every refusal is JSON ``{"error", "category"}`` with a 4xx status, and a client's
error never reaches another's state (hybridflow/serve/service.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from hybridflow.serve import messages as m
from hybridflow.serve.futures import USER, ServiceError
from hybridflow.serve.service import TrainingService
from hybridflow.serve.wire import PROTOBUF, BadRequest, decode_forward_backward

log = logging.getLogger("hybridflow.serve")
API = "/api/v1"
EXPIRY_CHECK_S = 5.0
NO_RETRY = {"x-should-retry": "false"}  # the SDK's HTTP client retries some codes unless told not to

RequestT = TypeVar("RequestT", bound=BaseModel)


def refusal(status: int, message: str, category: str = USER) -> JSONResponse:
    headers = NO_RETRY if status < 500 and status not in (408, 429) else None
    return JSONResponse({"error": message, "category": category, "detail": message}, status, headers=headers)


def build_app(service: TrainingService, api_keys: dict[str, str]) -> FastAPI:
    """The API over ``service``; ``api_keys``: owner name -> key."""

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

    app = FastAPI(title="hybridflow training service (Tinker API)", lifespan=lifespan, openapi_url=None)
    max_bytes = service.limits.max_body_bytes

    def owner_of(request: Request) -> str:
        key = request.headers.get("x-api-key") or ""
        found = None
        for owner, known in api_keys.items():  # every key compared, in constant time
            if hmac.compare_digest(key.encode(), known.encode()):
                found = owner
        if found is None:
            raise ServiceError("a valid API key is required in the X-API-Key header", 401)
        return found

    async def body_bytes(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ServiceError(f"the body is {declared} bytes; at most {max_bytes} (limits.max_body_bytes)", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise ServiceError(f"the body is over {max_bytes} bytes (limits.max_body_bytes)", 413)
        return bytes(body)

    async def parsed(request: Request, model: type[RequestT]) -> RequestT:
        body = await body_bytes(request)
        if request.headers.get("content-encoding"):
            raise ServiceError(f"content-encoding {request.headers['content-encoding']!r} is not taken; send it plain")
        try:
            return model.model_validate(json.loads(body or b"{}"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ServiceError(f"the body is not valid JSON: {error}") from None
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()[:5])
            raise ServiceError(f"{model.__name__}: {problems}") from None

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return refusal(error.status, str(error), "server" if error.status >= 500 else USER)

    @app.exception_handler(404)
    async def not_found(request: Request, error: Exception) -> JSONResponse:
        return refusal(404, f"no endpoint {request.method} {request.url.path} in this service")

    @app.exception_handler(405)
    async def wrong_method(request: Request, error: Exception) -> JSONResponse:
        return refusal(405, f"{request.url.path} does not take {request.method}")

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return refusal(500, f"the service failed on this request: {type(error).__name__}", "server")

    @app.get(f"{API}/healthz")
    async def healthz():
        if service.worker_lost is not None:
            return refusal(503, service.worker_lost, "server")
        return {"status": "ok"}

    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict:
        owner_of(request)
        await body_bytes(request)
        return service.client_config()

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict:
        owner_of(request)
        await body_bytes(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        owner_of(request)
        return service.capabilities()

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request) -> dict:
        owner_of(request)
        await body_bytes(request)  # read and dropped: this service keeps no client telemetry
        return {"status": "accepted"}

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict:
        owner = owner_of(request)
        return service.create_session(owner, await parsed(request, m.CreateSession))

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        owner = owner_of(request)
        return service.heartbeat(owner, (await parsed(request, m.SessionRef)).session_id)

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict:
        owner = owner_of(request)
        await body_bytes(request)
        service.end_session(service.session(owner, session_id))
        return {}

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict:
        owner = owner_of(request)
        return service.create_model(owner, await parsed(request, m.CreateModel))

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict:
        owner = owner_of(request)
        return service.get_info(owner, (await parsed(request, m.ModelRef)).model_id)

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict:
        owner = owner_of(request)
        body = await body_bytes(request)
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

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict:
        owner = owner_of(request)
        return service.optim_step(owner, await parsed(request, m.OptimStep))

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict:
        owner = owner_of(request)
        return service.save_weights(owner, await parsed(request, m.SaveWeights))

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        owner = owner_of(request)
        return service.save_weights_for_sampler(owner, await parsed(request, m.SaveWeightsForSampler))

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict:
        owner = owner_of(request)
        return service.load_weights(owner, await parsed(request, m.LoadWeights))

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        owner = owner_of(request)
        return service.create_sampling_session(owner, await parsed(request, m.CreateSamplingSession))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        return service.get_sampler(owner_of(request), sampler_id)

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict:
        owner = owner_of(request)
        return service.sample(owner, await parsed(request, m.Sample))

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        owner = owner_of(request)
        call = await parsed(request, m.RetrieveFuture)
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

    return app
