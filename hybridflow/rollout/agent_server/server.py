"""The endpoint's HTTP app (FastAPI) and its server (uvicorn), run as a task in the rollout's event loop: requests
are answered between the engine's steps, and turns of many sessions are decoded together.

    GET  /v1/models                          /sessions/{id}/v1/models
    POST /v1/chat/completions                /sessions/{id}/v1/chat/completions
    POST /v1/responses                       /sessions/{id}/v1/responses
    POST /inference/v1/generate              /sessions/{id}/inference/v1/generate   (token-level: ids in, ids out)
    POST /v1/sessions/claim                  (external agents, with the run's key) a waiting session and its row
    POST /sessions/{id}/reward               (external agents) the session's reward, which ends it

Every request carries a key (``Authorization: Bearer <key>``): a session's own key, which names the session on
the ``/v1`` routes and must match it on ``/sessions/{id}/v1`` routes. Every refusal is an OpenAI-style error body
with its status; no request can stop the server or another session's sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridflow.rollout.agent_server.config import AgentServerConfig
from hybridflow.rollout.agent_server.errors import ApiError, bad_request
from hybridflow.rollout.agent_server.generate_api import generate_reply, read_generate_request
from hybridflow.rollout.agent_server.openai_api import (
    TurnRequest,
    chat_chunks,
    chat_completion,
    models_list,
    read_chat_request,
    read_responses_request,
    response_object,
)
from hybridflow.rollout.agent_server.sessions import SessionTable
from hybridflow.rollout.agent_server.turns import TurnRunner

logger = logging.getLogger(__name__)


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


async def _json_body(request: Request, max_bytes: int) -> Any:
    """The request's JSON, refused before it is read whole when it is larger than ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(
            413,
            f"the body is {declared} bytes; at most {max_bytes} (rollout.agent.max_body_bytes)",
            code="body_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(
                413, f"the body is over {max_bytes} bytes (rollout.agent.max_body_bytes)", code="body_too_large"
            )
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if content_type != "application/json":
        raise ApiError(415, f"the body must be application/json, not {content_type!r}", code="unsupported_media_type")
    try:
        return json.loads(bytes(body))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the body is not valid JSON: {error}", code="invalid_json") from None


def build_app(
    config: AgentServerConfig,
    sessions: SessionTable,
    runner: TurnRunner,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    max_model_len: int,
    vocab_size: int,
) -> FastAPI:
    """The endpoint's routes over ``sessions`` and ``runner``."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    model = config.model_name

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = (
            f"{request.method} is not allowed on {request.url.path}"
            if error.status_code == 405
            else f"no endpoint {request.url.path!r}: use /v1/chat/completions, /v1/responses, /v1/models or "
            "/inference/v1/generate (or the same under /sessions/{id})"
        )
        return JSONResponse(ApiError(error.status_code, message, code="unknown_url").body(), error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.warning("agent endpoint: %s %s failed: %r", request.method, request.url.path, error)
        body = ApiError(500, f"the endpoint failed: {type(error).__name__}: {error}", code="server_error").body()
        return JSONResponse(body, status_code=500)

    async def turn(request: Request, session_id: str | None, read: Callable[..., Any], run: Callable[..., Any]):
        """(the request read by ``read``, what ``run`` generated for it), with the session's bounds and lock."""
        session = sessions.authorise(_bearer(request), session_id)
        turn_request = read(await _json_body(request, config.max_body_bytes))
        sessions.admit(session)
        async with session.lock:
            if session.closed:
                raise ApiError(410, f"session {session.id!r} has ended (its sample is done)", code="session_closed")
            return turn_request, await run(session, turn_request)

    def read_chat(body: Any) -> TurnRequest:
        return read_chat_request(body, model=model, temperature=temperature, top_p=top_p)

    def read_responses(body: Any) -> TurnRequest:
        return read_responses_request(body, model=model, temperature=temperature, top_p=top_p)

    def read_generate(body: Any):
        return read_generate_request(
            body, model=model, vocab_size=vocab_size, temperature=temperature, top_p=top_p, top_k=top_k
        )

    async def chat(request: Request, session_id: str | None = None):
        turn_request, reply = await turn(request, session_id, read_chat, runner.run)
        if not turn_request.stream:
            return JSONResponse(chat_completion(reply, model, turn_request.logprobs))
        chunks = chat_chunks(reply, model, turn_request.logprobs, turn_request.include_usage)

        async def events() -> AsyncIterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def responses(request: Request, session_id: str | None = None):
        turn_request, reply = await turn(request, session_id, read_responses, runner.run)
        return JSONResponse(response_object(reply, model, turn_request.tools))

    async def generate(request: Request, session_id: str | None = None):
        _, reply = await turn(request, session_id, read_generate, runner.run_tokens)
        return JSONResponse(generate_reply(reply))

    async def models(request: Request, session_id: str | None = None):
        key = _bearer(request)
        if session_id is not None:
            sessions.authorise(key, session_id)
        elif not sessions.known_key(key):
            raise ApiError(401, "a valid API key is required ('Authorization: Bearer <key>')", code="invalid_api_key")
        return JSONResponse(models_list(model, max_model_len))

    async def claim(request: Request):
        session = sessions.claim(_bearer(request))
        if session is None:
            return Response(status_code=204)  # none waits now: ask again
        base_url = f"{str(request.base_url).rstrip('/')}/sessions/{session.id}/v1"
        return JSONResponse(
            {"session_id": session.id, "base_url": base_url, "api_key": session.key, "row": session.row}
        )

    async def reward(request: Request, session_id: str):
        key = _bearer(request)
        sessions.authorise(key, session_id)
        sessions.finish(key, session_id, await _json_body(request, config.max_body_bytes))
        return JSONResponse({"session_id": session_id, "status": "closed"})

    app.add_api_route("/v1/sessions/claim", claim, methods=["POST"])
    app.add_api_route("/sessions/{session_id}/reward", reward, methods=["POST"])
    app.add_api_route("/inference/v1/generate", generate, methods=["POST"])
    app.add_api_route("/sessions/{session_id}/inference/v1/generate", generate, methods=["POST"])
    for prefix in ("/v1", "/sessions/{session_id}/v1"):
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/responses", responses, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
    return app


class AgentServer:
    """The endpoint of one generation call: ``async with server.running():`` serves it in the current event loop on
    ``config.host``; ``base_url`` is where agents reach it. Leaving the block stops it and closes its port."""

    def __init__(self, config: AgentServerConfig, app: FastAPI):
        self.config = config
        self.app = app
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"http://{host}:{self.port}"

    @asynccontextmanager
    async def running(self) -> AsyncIterator[AgentServer]:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as error:
            sock.close()
            raise OSError(
                f"the agent endpoint cannot listen on {self.config.host}:{self.config.port}: {error}; "
                "set rollout.agent.host / rollout.agent.port"
            ) from error
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
                h11_max_incomplete_event_size=64 * 1024,
            )
        )
        server.capture_signals = contextlib.nullcontext  # the run's own signal handlers stay in charge
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the agent endpoint stopped while starting")
                await asyncio.sleep(0.005)
            yield self
        finally:
            server.should_exit = True
            try:
                await asyncio.wait_for(task, timeout=10)
            except Exception as error:  # noqa: BLE001
                logger.warning("agent endpoint: stopping: %r", error)
            sock.close()
