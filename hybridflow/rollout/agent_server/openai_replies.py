"""A generated turn (`Reply`) written in the OpenAI wire formats: a chat completion, whole or as stream chunks, or a
response (the Responses API, which the OpenAI Agents SDK uses by default); and the models list."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    """What one turn produced, ready to be written in either API."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # chat-completions tool_call objects
    finish_reason: str  # stop | length | tool_calls
    tokens: list[str]  # each generated token's text (for logprobs)
    log_probs: list[float]
    prompt_tokens: int  # the conversation's tokens before the turn
    cached_tokens: int  # of those, already computed in the session (a continued branch)
    completion_tokens: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        """The assistant message as the client will send it back."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def _logprobs(reply: Reply) -> dict[str, Any]:
    return {
        "content": [
            {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            for token, lp in zip(reply.tokens, reply.log_probs)
        ]
    }


def chat_completion(reply: Reply, model: str, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion",
        "created": reply.created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": reply.message(),
                "finish_reason": reply.finish_reason,
                "logprobs": _logprobs(reply) if logprobs else None,
            }
        ],
        "usage": _usage(reply),
    }


def chat_chunks(reply: Reply, model: str, logprobs: bool, include_usage: bool) -> list[dict[str, Any]]:
    """The turn as chat.completion.chunk events: the role, the content, the tool calls, the finish (and usage).
    The engines hand a turn over whole, so the events come together when it is done."""
    head = {"id": f"chatcmpl-{reply.id}", "object": "chat.completion.chunk", "created": reply.created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    # every generated token's log-prob (tool-call markup and the end token included, as unstreamed) goes with the
    # first chunk after the role: the content's, else the tool calls', else the finish's
    pending = {"logprobs": _logprobs(reply)} if logprobs else {}
    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}, **pending))
        pending = {}
    if reply.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(reply.tool_calls)]
        chunks.append(chunk({"tool_calls": calls}, **pending))
        pending = {}
    chunks.append(chunk({}, reply.finish_reason, **pending))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    return chunks


def response_object(reply: Reply, model: str, request_tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn as a Responses API ``response``: a message item for the text, a function_call item per call."""
    output: list[dict[str, Any]] = []
    if reply.content:
        output.append(
            {
                "type": "message",
                "id": f"msg_{reply.id}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}],
            }
        )
    for i, call in enumerate(reply.tool_calls):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{reply.id}_{i}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    incomplete = reply.finish_reason == "length"
    return {
        "id": f"resp_{reply.id}",
        "object": "response",
        "created_at": reply.created,
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{"type": "function", **tool["function"], "strict": False} for tool in request_tools],
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
    }


def models_list(model: str, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "hybridflow", "max_model_len": max_model_len}
        ],
    }
