"""The endpoint's HTTP app (FastAPI); listener.py serves it (uvicorn) as a task in the rollout's event loop: requests
are answered between the engine's steps, and turns of many sessions are decoded together.

    GET  /v1/models                          /sessions/{id}/v1/models
    POST /v1/chat/completions                /sessions/{id}/v1/chat/completions
    POST /v1/responses                       /sessions/{id}/v1/responses
    POST /inference/v1/generate              /sessions/{id}/inference/v1/generate   (token-level: ids in, ids out)
    POST /v1/sessions/claim                  (external agents, with the run's key) a waiting session and its row
    POST /sessions/{id}/reward               (external agents) the session's reward, which ends it

Every request carries a key (``Authorization: Bearer <key>``): a session's own key, which names the session on
the ``/v1`` routes and must match it on ``/sessions/{id}/v1`` routes. Every refusal is an OpenAI-style error body
with its status (a 4xx: no request a client sends makes the endpoint fail; a 500 means a bug, and its connection
stays open); no request can stop the server or another session's sample.

``app.openapi()`` is the contract (schemas.py): every request body and answer, the statuses of each route and the
bearer key. It is not served (``openapi_url=None``); tests/rollout/agent_server/test_endpoint_fuzz.py fuzzes the
endpoint from it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridflow.request_json import RequestJsonError, read_request_json
from hybridflow.rollout.agent_server import schemas
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
    if content_type.lower() != "application/json":
        raise ApiError(415, f"the body must be application/json, not {content_type!r}", code="unsupported_media_type")
    try:
        return read_request_json(bytes(body))
    except RequestJsonError as error:
        raise bad_request(str(error), code="invalid_json") from None


_REWARD = Draft202012Validator(schemas.REWARD_REQUEST)


def _check_reward(body: Any) -> None:
    """An external agent's reward body as schemas.REWARD_REQUEST describes it (finite numbers, lists of ids)."""
    error = best_match(_REWARD.iter_errors(body))
    if error is not None:
        at = "".join(f"[{p!r}]" for p in error.absolute_path)
        raise bad_request(
            "the body is {'reward': number, 'metrics': {name: number}, 'branches': [...]} or {'abandon': true}: "
            f"at body{at}: {error.message[:300]}",
            param=".".join(map(str, error.absolute_path)) or None,
        )


def _answered(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` with what it raises answered: an `ApiError` with its status, anything else (a bug, or the engine
    lost) with a 500, on a connection that stays open (an exception left to Starlette closes it)."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        except Exception as error:  # noqa: BLE001
            logger.warning("agent endpoint: %s %s failed", request.method, request.url.path, exc_info=error)
            body = ApiError(500, f"the endpoint failed: {type(error).__name__}: {error}", code="server_error").body()
            return JSONResponse(body, status_code=500)

    return endpoint


class AgentEndpoint:
    """The endpoint's handlers over ``sessions`` and ``runner``: each reads its request within the session's bounds,
    runs the turn, and answers in its API's shape; the sampling defaults are the run's."""

    def __init__(
        self,
        config: AgentServerConfig,
        sessions: SessionTable,
        runner: TurnRunner,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        max_model_len: int,
        vocab_size: int,
    ):
        self.config, self.sessions, self.runner = config, sessions, runner
        self.model = config.model_name
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.response_length = max_model_len - config.max_prompt_tokens  # a branch's budget of response tokens

    async def turn(self, request: Request, read: Callable[..., Any], run: Callable[..., Any]):
        """(the request read by ``read``, what ``run`` generated for it), with the session's bounds and lock."""
        session = self.sessions.authorise(_bearer(request), request.path_params.get("session_id"))
        turn_request = read(await _json_body(request, self.config.max_body_bytes))
        self.sessions.admit(session)
        async with session.lock:
            if session.closed:
                raise ApiError(410, f"session {session.id!r} has ended (its sample is done)", code="session_closed")
            return turn_request, await run(session, turn_request)

    def read_chat(self, body: Any) -> TurnRequest:
        return read_chat_request(body, model=self.model, temperature=self.temperature, top_p=self.top_p)

    def read_responses(self, body: Any) -> TurnRequest:
        return read_responses_request(body, model=self.model, temperature=self.temperature, top_p=self.top_p)

    def read_generate(self, body: Any):
        return read_generate_request(
            body,
            model=self.model,
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )

    async def chat(self, request: Request) -> Response:
        turn_request, reply = await self.turn(request, self.read_chat, self.runner.run)
        if not turn_request.stream:
            return JSONResponse(chat_completion(reply, self.model, turn_request.logprobs))
        chunks = chat_chunks(reply, self.model, turn_request.logprobs, turn_request.include_usage)

        async def events() -> AsyncIterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def responses(self, request: Request) -> Response:
        turn_request, reply = await self.turn(request, self.read_responses, self.runner.run)
        return JSONResponse(response_object(reply, self.model, turn_request.tools))

    async def generate(self, request: Request) -> Response:
        _, reply = await self.turn(request, self.read_generate, self.runner.run_tokens)
        return JSONResponse(generate_reply(reply))

    async def models(self, request: Request) -> Response:
        key, session_id = _bearer(request), request.path_params.get("session_id")
        if session_id is not None:
            self.sessions.authorise(key, session_id)
        elif not self.sessions.known_key(key):
            raise ApiError(401, "a valid API key is required ('Authorization: Bearer <key>')", code="invalid_api_key")
        return JSONResponse(models_list(self.model, self.max_model_len))

    async def claim(self, request: Request) -> Response:
        session = self.sessions.claim(_bearer(request))
        if session is None:
            return Response(status_code=204)  # none waits now: ask again
        base_url = f"{str(request.base_url).rstrip('/')}/sessions/{session.id}/v1"
        return JSONResponse(
            {"session_id": session.id, "base_url": base_url, "api_key": session.key, "row": session.row}
        )

    async def reward(self, request: Request) -> Response:
        key, session_id = _bearer(request), request.path_params["session_id"]
        self.sessions.authorise(key, session_id)
        body = await _json_body(request, self.config.max_body_bytes)
        _check_reward(body)
        self.sessions.finish(key, session_id, body)
        return JSONResponse({"session_id": session_id, "status": "closed"})


def build_app(config: AgentServerConfig, sessions: SessionTable, runner: TurnRunner, **sampling: Any) -> FastAPI:
    """The endpoint's routes over ``sessions`` and ``runner``; ``sampling``: the run's temperature, top_p, top_k,
    max_model_len and vocab_size (``AgentEndpoint``)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    for path, handler, method, summary, body, answers, refusals in _routes(
        AgentEndpoint(config, sessions, runner, **sampling)
    ):
        _route(app, path, handler, method, summary, body, answers, refusals)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _error_handlers(app: FastAPI) -> None:
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


def _routes(endpoint: AgentEndpoint) -> list[tuple]:
    """Every route: (path, handler, method, summary, request body schema, answers, refusals)."""
    e, model, length = endpoint, endpoint.model, endpoint.response_length
    chat_body = schemas.chat_request(model, e.temperature, e.top_p, length)
    chat_answer = {"application/json": schemas.CHAT_COMPLETION, "text/event-stream": schemas.CHAT_EVENT}
    responses_body = schemas.responses_request(model, e.temperature, e.top_p, length)
    generate_body = schemas.generate_request(model, e.temperature, e.top_p, e.top_k, length, e.vocab_size)
    turn_refusals = (*_REFUSED, (410, "the session has ended"), (429, "a session's bound reached"))
    json_answer = lambda description, schema: {200: (description, {"application/json": schema})}  # noqa: E731
    routes = [
        (
            "/v1/sessions/claim", e.claim, "POST", "a waiting session, with the run's key", None,
            {**json_answer("the session", schemas.CLAIMED), 204: ("none waits now", None)},
            ((401, "not the run's key"), _FAILED),
        ),
        (
            "/sessions/{session_id}/reward", e.reward, "POST", "an external session's reward, which ends it",
            schemas.REWARD_REQUEST, json_answer("the session ended", schemas.REWARDED),
            (*_REFUSED, (409, "the session's agent is the run's function"), (410, "the session has ended")),
        ),
    ]  # fmt: skip
    for path in ("/inference/v1/generate", "/sessions/{session_id}/inference/v1/generate"):
        answer = json_answer("the generated ids", schemas.GENERATE_REPLY)
        routes.append((path, e.generate, "POST", "a turn from token ids", generate_body, answer, turn_refusals))
    models_refusals = tuple(r for r in (*_REFUSED, (410, "the session has ended")) if r[0] not in (400, 413, 415))
    for prefix in ("/v1", "/sessions/{session_id}/v1"):
        routes += [
            (
                f"{prefix}/chat/completions", e.chat, "POST", "an assistant turn", chat_body,
                {200: ("the turn (streamed: server-sent events)", chat_answer)}, turn_refusals,
            ),
            (
                f"{prefix}/responses", e.responses, "POST", "an assistant turn (Responses API)", responses_body,
                json_answer("the turn", schemas.RESPONSE), turn_refusals,
            ),
            (
                f"{prefix}/models", e.models, "GET", "the model served", None,
                json_answer("the model", schemas.MODELS), models_refusals,
            ),
        ]  # fmt: skip
    return routes


def _route(
    app: FastAPI, path: str, handler: Callable, method: str, summary: str, body: Any, answers: dict, refusals: tuple
) -> None:
    """``handler`` at ``path``, described in the OpenAPI document: its body, its answers and refusals."""
    responses: dict[int | str, Any] = {
        status: {"description": description, "content": {"application/json": {"schema": schemas.ERROR}}}
        for status, description in refusals
    }
    for status, (description, content) in answers.items():
        responses[status] = {"description": description}
        if content:
            responses[status]["content"] = {media: {"schema": schema} for media, schema in content.items()}
    extra: dict[str, Any] = {"security": [{"key": []}], "responses": responses}
    if "{session_id}" in path:
        extra["parameters"] = [{"name": "session_id", "in": "path", "required": True, "schema": schemas.STRING}]
    if body is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    app.add_api_route(
        path, _answered(handler), methods=[method], summary=summary, openapi_extra=extra, response_class=JSONResponse
    )


_FAILED = (500, "the endpoint failed (a bug, or the engine was lost)")
_REFUSED = (
    (400, "a bad request: the error names the parameter"),
    (401, "no key, or not a key of the endpoint's"),
    (403, "another session's key"),
    (404, "no such session, or another model"),
    (413, "the body is over rollout.agent.max_body_bytes"),
    (415, "the body is not application/json"),
    _FAILED,
)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The endpoint's OpenAPI document, with its bearer key (a session's, or the run's to claim sessions)."""
    if app.openapi_schema is None:
        document = get_openapi(title="hybridflow agent endpoint", version="1", routes=app.routes)
        document.setdefault("components", {})["securitySchemes"] = {"key": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = document
    return app.openapi_schema
