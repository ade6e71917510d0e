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
from hybridflow.rollout.agent_server.fields import (
    boolean,
    check_model,
    integer,
    only,
    refuse_given,
    refuse_unknown,
    string,
)
from hybridflow.rollout.agent_server.openai_api import check_sampling

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
_NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


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


def _check_sampling(params: dict[str, Any], *, temperature: float, top_p: float, top_k: int) -> None:
    where = "sampling_params."
    check_sampling(params, temperature, top_p, where)
    value = integer(params, "top_k", where)
    if value is not None and value != top_k and not (top_k <= 0 and value in (-1, 0)):
        raise bad_request(
            f"sampling_params.top_k={value!r}: the run samples with top_k={top_k}; omit it",
            param="sampling_params.top_k",
            code="unsupported_value",
        )
    for name, neutral in _NEUTRAL.items():
        only(params, name, neutral, "the run's sampling is fixed", where)
    if integer(params, "min_tokens", where) not in (None, 0):
        raise bad_request(
            "sampling_params.min_tokens is not supported (the run's sampling is fixed); omit it",
            param="sampling_params.min_tokens",
            code="unsupported_value",
        )
    if integer(params, "n", where) not in (None, 1):
        raise bad_request(
            "sampling_params.n > 1 is not supported: each request is one turn of one trajectory",
            param="sampling_params.n",
            code="unsupported_value",
        )
    if integer(params, "logprobs", where) not in (None, 0, 1):
        raise bad_request(
            "sampling_params.logprobs: the sampled token's log-prob is always returned; top-k alternatives are not "
            "(pass 1 or omit it)",
            param="sampling_params.logprobs",
            code="unsupported_value",
        )
    if params.get("stop") not in (None, []):
        raise bad_request(
            "sampling_params.stop: stop strings are not supported on the token route; use stop_token_ids",
            param="sampling_params.stop",
            code="unsupported_value",
        )
    # accepted without effect, checked for their types
    for name in ("seed", "routed_experts_prompt_start"):
        integer(params, name, where)
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
        boolean(params, name, where)
    string(params, "reasoning_effort", where)


def read_generate_request(
    body: Any, *, model: str, vocab_size: int, temperature: float, top_p: float, top_k: int
) -> TokenRequest:
    """A /inference/v1/generate body, checked."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    refuse_unknown(body, _KEYS)
    multimodal = ("features", "content_parts")
    refuse_given(body, multimodal, "{name}: multimodal inputs are not supported (the run's model reads text tokens)")
    check_model(body, model)
    for key in ("cache_salt", "request_id"):
        string(body, key)
    integer(body, "priority")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request("'sampling_params' must be an object", param="sampling_params")
    refuse_unknown(params, _SAMPLING_KEYS, "sampling_params.")
    _check_sampling(params, temperature=temperature, top_p=top_p, top_k=top_k)
    max_tokens = integer(params, "max_tokens", "sampling_params.", minimum=1)
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
