"""The token-level wire format (``POST /inference/v1/generate``), which training clients that render prompts
themselves call, verifiers' TrainClient among them: the request is the prompt's token ids and vLLM-style
``sampling_params``; the reply is the generated ids, one ``{"token": "token_id:<id>", "logprob"}`` entry per id,
and why generation stopped.

As on the chat routes, sampling belongs to the run: temperature and top_p may be omitted or repeat the run's values,
and penalties or top-k other than the run's are refused. ``seed`` and ``skip_special_tokens`` are accepted and change
nothing (the reply is ids; the run's counter-based stream seeds it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from hybridflow.rollout.agent_server.errors import bad_request
from hybridflow.rollout.agent_server.openai_api import check_model, refuse_unknown

_KEYS = {"model", "token_ids", "sampling_params", "cache_salt", "request_id", "priority", "features", "content_parts"}
_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
    "n",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    # accepted without effect: the reply is ids, the run seeds sampling, the model has no reasoning switch, and
    # routing-replay hints concern mixture-of-experts engines
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "reasoning_effort",
    "routed_experts_prompt_start",
}
# settings a request may only give at their neutral value (the run's sampling is fixed)
_NEUTRAL = {"min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass
class TokenRequest:
    """One token-level generation request, checked."""

    token_ids: list[int]  # the whole context: the prompt and, on a later turn, everything before it
    max_tokens: int | None
    stop_token_ids: list[int]  # besides the model's own end tokens


@dataclass
class TokenReply:
    token_ids: list[int]  # generated ids, the stop token included when generation stopped on one
    log_probs: list[float]
    finish_reason: str  # stop | length
    prompt_tokens: int
    cached_tokens: int  # of the prompt, already computed in the session (a continued branch)


def _token_ids(value: Any, name: str, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise bad_request(f"'{name}' must be a non-empty list of token ids", param=name)
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise bad_request(
                f"{name}[{i}] = {token!r} is not a token id of this model (integers in [0, {vocab_size}))",
                param=name,
                code="invalid_token_id",
            )
    return value


def _number(params: dict[str, Any], name: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"sampling_params.{name} must be a number, got {value!r}", param=f"sampling_params.{name}")
    return float(value)


def _check_sampling(params: dict[str, Any], *, temperature: float, top_p: float, top_k: int) -> None:
    for name, run_value in (("temperature", temperature), ("top_p", top_p)):
        value = _number(params, name)
        if value is not None and abs(value - run_value) > 1e-6:
            raise bad_request(
                f"sampling_params.{name}={value}: the run samples at {name}={run_value} (its importance weights "
                f"assume it); omit it or pass {run_value}",
                param=f"sampling_params.{name}",
                code="unsupported_value",
            )
    value = params.get("top_k")
    if value is not None and value != top_k and not (top_k <= 0 and value in (-1, 0)):
        raise bad_request(
            f"sampling_params.top_k={value!r}: the run samples with top_k={top_k}; omit it",
            param="sampling_params.top_k",
            code="unsupported_value",
        )
    for name, neutral in _NEUTRAL.items():
        value = _number(params, name)
        if value is not None and value != neutral:
            raise bad_request(
                f"sampling_params.{name}={value} is not supported (the run's sampling is fixed); omit it",
                param=f"sampling_params.{name}",
                code="unsupported_value",
            )
    if params.get("n") not in (None, 1):
        raise bad_request(
            "sampling_params.n > 1 is not supported: each request is one turn of one trajectory",
            param="sampling_params.n",
            code="unsupported_value",
        )
    if params.get("logprobs") not in (None, 0, 1) or isinstance(params.get("logprobs"), bool):
        raise bad_request(
            "sampling_params.logprobs: the sampled token's log-prob is always returned; top-k alternatives are not "
            "(pass 1 or omit it)",
            param="sampling_params.logprobs",
            code="unsupported_value",
        )
    if params.get("stop"):
        raise bad_request(
            "sampling_params.stop: stop strings are not supported on the token route; use stop_token_ids",
            param="sampling_params.stop",
            code="unsupported_value",
        )


def read_generate_request(
    body: Any, *, model: str, vocab_size: int, temperature: float, top_p: float, top_k: int
) -> TokenRequest:
    """A /inference/v1/generate body, checked."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    refuse_unknown(body, _KEYS)
    for key in ("features", "content_parts"):
        if body.get(key) is not None:
            raise bad_request(
                f"{key!r}: multimodal inputs are not supported (the run's model reads text tokens)",
                param=key,
                code="unsupported_value",
            )
    check_model(body, model)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise bad_request("'sampling_params' must be an object", param="sampling_params")
    refuse_unknown(params, _SAMPLING_KEYS, "sampling_params.")
    _check_sampling(params, temperature=temperature, top_p=top_p, top_k=top_k)
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad_request(
            f"sampling_params.max_tokens must be a positive integer, got {max_tokens!r}",
            param="sampling_params.max_tokens",
        )
    stop_ids = params.get("stop_token_ids")
    return TokenRequest(
        token_ids=_token_ids(body.get("token_ids"), "token_ids", vocab_size),
        max_tokens=max_tokens,
        stop_token_ids=[]
        if stop_ids is None
        else _token_ids(stop_ids, "sampling_params.stop_token_ids", vocab_size, allow_empty=True),
    )


def generate_reply(reply: TokenReply) -> dict[str, Any]:
    """The reply body: choices[0] holds the generated ids and one log-prob entry per id."""
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "choices": [
            {
                "index": 0,
                "token_ids": reply.token_ids,
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{token}", "logprob": log_prob}
                        for token, log_prob in zip(reply.token_ids, reply.log_probs)
                    ]
                },
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": len(reply.token_ids),
            "total_tokens": reply.prompt_tokens + len(reply.token_ids),
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
        },
    }
