"""The endpoint's contract as JSON Schemas, for its OpenAPI document (``app.openapi()``, which schemathesis fuzzes):
each request body as the readers (openai_api.py, generate_api.py) take it, each answer as the writers write it.

A request schema is never stricter than its reader: whatever it refuses, the endpoint refuses too (so a fuzzer's
invalid bodies must all get a 4xx). The readers check more than a schema says (a tool's parameters against the
JSON Schema metaschema, the response budget left on a branch, a tool message's place in the conversation). Optional
fields may be null, as in OpenAI's API. Values the run fixes are given as the only ones accepted: the model id, the
run's temperature and top_p (within `SAMPLING_TOLERANCE`), neutral penalties.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rollout.agent_server.openai_api import ROLES, SAMPLING_TOLERANCE

Schema = dict[str, Any]

ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
STRING: Schema = {"type": "string"}
INTEGER: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}
BOOLEAN: Schema = {"type": "boolean"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, closed: bool = True) -> Schema:
    """An object with ``properties``; closed: no others (the readers refuse unknown parameters)."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


def _optional(properties: dict[str, Schema], required: tuple[str, ...]) -> dict[str, Schema]:
    """Each property not in ``required`` may be null."""
    return {name: schema if name in required else nullable(schema) for name, schema in properties.items()}


def request(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    return obj(_optional(properties, required), required)


def run_value(value: float) -> Schema:
    """A sampling setting the run fixes: a number within the tolerance of its value."""
    return {"type": "number", "minimum": value - SAMPLING_TOLERANCE, "maximum": value + SAMPLING_TOLERANCE}


def _text_content(roles: list[str]) -> dict[str, Schema]:
    part = obj(
        {"type": {"enum": ["text", "input_text", "output_text"]}, "text": STRING}, ("type", "text"), closed=False
    )
    return {
        "role": {"enum": roles},
        "content": {"anyOf": [STRING, {"type": "array", "items": part}, {"type": "null"}]},
    }


_TOOL_CALL = obj(
    {
        "id": nullable(STRING),
        "function": obj(
            {"name": STRING, "arguments": {"anyOf": [STRING, {"type": "object"}, {"type": "null"}]}},
            ("name",),
            closed=False,
        ),
    },
    ("function",),
    closed=False,
)
_MESSAGE_FIELDS = {
    "tool_calls": nullable({"type": "array", "items": _TOOL_CALL}),
    "name": nullable(STRING),
}
MESSAGE: Schema = {
    "anyOf": [
        obj(
            {**_text_content([r for r in ROLES if r != "tool"]), **_MESSAGE_FIELDS, "tool_call_id": nullable(STRING)},
            ("role",),
            closed=False,
        ),
        obj(
            {**_text_content(["tool"]), **_MESSAGE_FIELDS, "tool_call_id": STRING},
            ("role", "tool_call_id"),
            closed=False,
        ),  # fmt: skip
    ]
}
_FUNCTION_FIELDS: dict[str, Schema] = {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": nullable(STRING),
    "parameters": nullable({"type": "object", "properties": {"type": {"const": "object"}}}),
    "strict": nullable(BOOLEAN),
}
CHAT_TOOL = obj(
    {"type": {"const": "function"}, "function": obj(_FUNCTION_FIELDS, ("name",), closed=False)},
    ("type", "function"),
    closed=False,
)
RESPONSES_TOOL = obj({"type": {"const": "function"}, **_FUNCTION_FIELDS}, ("type", "name"), closed=False)
_STOP_STRING = {"type": "string", "minLength": 1}
_STOP = {"anyOf": [_STOP_STRING, {"type": "array", "maxItems": 4, "items": _STOP_STRING}]}
_BOOKKEEPING = {
    "user": STRING,
    "metadata": {"type": "object", "additionalProperties": STRING},
    "store": BOOLEAN,
    "parallel_tool_calls": BOOLEAN,
    "prompt_cache_key": STRING,
}


def chat_request(model: str, temperature: float, top_p: float, max_tokens: int) -> Schema:
    """POST /chat/completions. max_tokens: the response budget of a branch (its first turn's most)."""
    tokens = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    return request(
        {
            "model": {"const": model},
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "tools": {"type": "array", "items": CHAT_TOOL},
            "tool_choice": {"enum": ["auto", "none"]},
            "temperature": run_value(temperature),
            "top_p": run_value(top_p),
            "max_tokens": tokens,
            "max_completion_tokens": tokens,
            "stop": _STOP,
            "logprobs": BOOLEAN,
            "top_logprobs": {"const": 0},
            "stream": BOOLEAN,
            "stream_options": request({"include_usage": BOOLEAN, "include_obfuscation": BOOLEAN}),
            "n": {"const": 1},
            "frequency_penalty": {"const": 0},
            "presence_penalty": {"const": 0},
            "seed": INTEGER,
            **_BOOKKEEPING,
        },
        ("model", "messages"),
    )


_INPUT_ITEM: Schema = {
    "anyOf": [
        obj(
            {"type": {"const": "message"}, **_text_content([r for r in ROLES if r != "tool"])}, ("role",), closed=False
        ),  # fmt: skip
        obj(
            {"type": {"const": "function_call"}, "call_id": STRING, "name": STRING, "arguments": STRING},
            ("type", "call_id", "name", "arguments"),
            closed=False,
        ),  # fmt: skip
        obj(
            {"type": {"const": "function_call_output"}, "call_id": STRING, "output": _text_content([])["content"]},
            ("type", "call_id"),
            closed=False,
        ),
        obj({"type": {"const": "reasoning"}}, ("type",), closed=False),
    ]
}


def responses_request(model: str, temperature: float, top_p: float, max_tokens: int) -> Schema:
    """POST /responses (not streamed, nothing stored)."""
    schema = request(
        {
            "model": {"const": model},
            "input": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]},
            "instructions": STRING,
            "tools": {"type": "array", "items": RESPONSES_TOOL},
            "tool_choice": {"enum": ["auto", "none"]},
            "temperature": run_value(temperature),
            "top_p": run_value(top_p),
            "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens},
            "stream": {"const": False},
            "top_logprobs": {"const": 0},
            "text": {"type": "object"},
            "reasoning": {"type": "object"},
            "service_tier": STRING,
            "truncation": STRING,
            "include": {"type": "array", "items": STRING},
            **_BOOKKEEPING,
        },
        ("model", "input"),
    )
    schema["properties"]["previous_response_id"] = schema["properties"]["conversation"] = {"type": "null"}
    return schema


def generate_request(
    model: str, temperature: float, top_p: float, top_k: int, max_tokens: int, vocab_size: int
) -> Schema:
    """POST /inference/v1/generate: token ids in."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    sampling = request(
        {
            "temperature": run_value(temperature),
            "top_p": run_value(top_p),
            "top_k": {"enum": [top_k, -1, 0] if top_k <= 0 else [top_k]},
            "min_p": {"const": 0},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens},
            "min_tokens": {"const": 0},
            "stop": {"type": "array", "maxItems": 0},
            "stop_token_ids": {"type": "array", "items": token_id},
            "logprobs": {"enum": [0, 1]},
            "n": {"const": 1},
            "repetition_penalty": {"const": 1},
            "presence_penalty": {"const": 0},
            "frequency_penalty": {"const": 0},
            "seed": INTEGER,
            "skip_special_tokens": BOOLEAN,
            "spaces_between_special_tokens": BOOLEAN,
            "include_stop_str_in_output": BOOLEAN,
            "reasoning_effort": STRING,
            "routed_experts_prompt_start": INTEGER,
        }
    )
    schema = request(
        {
            "model": {"const": model},
            "token_ids": {"type": "array", "minItems": 1, "items": token_id},
            "sampling_params": sampling,
            "cache_salt": STRING,
            "request_id": STRING,
            "priority": INTEGER,
        },
        ("model", "token_ids"),
    )
    schema["properties"]["features"] = schema["properties"]["content_parts"] = {"type": "null"}
    return schema


_FINITE = {"type": "number", "minimum": -1.7e308, "maximum": 1.7e308}
REWARD_REQUEST: Schema = {
    "anyOf": [
        obj({"abandon": {"const": True}, "reason": nullable(STRING)}, ("abandon",), closed=False),
        obj(
            {
                "abandon": {"enum": [False, None]},
                "reward": _FINITE,
                "metrics": nullable({"type": "object", "additionalProperties": _FINITE}),
                "branches": nullable(
                    {
                        "type": "array",
                        "items": obj(
                            {
                                "token_ids": {"type": "array", "items": INTEGER},
                                "sampled_mask": {"type": "array", "items": {"anyOf": [BOOLEAN, {"enum": [0, 1]}]}},
                                "logprobs": {"type": "array", "items": _FINITE},
                            },
                            ("token_ids", "sampled_mask", "logprobs"),
                            closed=False,
                        ),
                    }
                ),
            },
            ("reward",),
            closed=False,
        ),
    ]
}

# answers
_USAGE = obj(
    {
        "prompt_tokens": INTEGER,
        "completion_tokens": INTEGER,
        "total_tokens": INTEGER,
        "prompt_tokens_details": obj({"cached_tokens": INTEGER}, ("cached_tokens",)),
    },
    ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"),
)
_LOGPROBS = nullable(
    obj(
        {
            "content": {
                "type": "array",
                "items": obj(
                    {
                        "token": STRING,
                        "logprob": NUMBER,
                        "bytes": {"type": "array", "items": INTEGER},
                        "top_logprobs": {"type": "array", "maxItems": 0},
                    },
                    ("token", "logprob", "bytes", "top_logprobs"),
                ),
            }
        },
        ("content",),
    )
)
_REPLY_CALL = obj(
    {
        "id": STRING,
        "type": {"const": "function"},
        "function": obj({"name": STRING, "arguments": STRING}, ("name", "arguments")),
    },
    ("id", "type", "function"),
)
_REPLY_CALL_FIELDS = {**_REPLY_CALL, "properties": {**_REPLY_CALL["properties"], "index": INTEGER}}
_FINISH = {"enum": ["stop", "length", "tool_calls"]}


def _completion(kind: str, choice: Schema, choices: Schema, required: tuple[str, ...]) -> Schema:
    """A chat completion object (``kind``: chat.completion or its chunk) holding at most one ``choice``."""
    fields = {"id": STRING, "object": {"const": kind}, "created": INTEGER, "model": STRING}
    return obj({**fields, "choices": {"type": "array", **choices, "items": choice}, "usage": _USAGE}, required)


def _choice(part: str, content: Schema, calls: Schema, finish: Schema, required: tuple[str, ...]) -> Schema:
    """A completion's one choice: its ``part`` (a completion's ``message``, a chunk's ``delta``) the assistant's
    ``content`` and tool ``calls`` (the array's items and bounds), a whole message's role and content required."""
    message = ("role", "content") if part == "message" else ()
    assistant = {"role": {"const": "assistant"}, "content": content, "tool_calls": {"type": "array", **calls}}
    fields = {"index": {"const": 0}, part: obj(assistant, message), "finish_reason": finish, "logprobs": _LOGPROBS}
    return obj(fields, required)


CHAT_COMPLETION = _completion(
    "chat.completion",
    _choice(
        "message",
        {"type": ["string", "null"]},
        {"minItems": 1, "items": _REPLY_CALL},
        _FINISH,
        ("index", "message", "finish_reason", "logprobs"),
    ),
    {"minItems": 1, "maxItems": 1},
    ("id", "object", "created", "model", "choices", "usage"),
)
CHAT_CHUNK = _completion(
    "chat.completion.chunk",
    _choice(
        "delta",
        STRING,
        {"items": {"allOf": [_REPLY_CALL_FIELDS, {"required": ["index"]}]}},
        {"enum": ["stop", "length", "tool_calls", None]},
        ("index", "delta", "finish_reason"),
    ),
    {"maxItems": 1},
    ("id", "object", "created", "model", "choices"),
)
# each server-sent event of a streamed turn: `data: <a chat.completion.chunk>`, the last `data: [DONE]`
CHAT_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": CHAT_CHUNK},
            ]
        }
    },
}
RESPONSE = obj(
    {
        "id": STRING,
        "object": {"const": "response"},
        "created_at": INTEGER,
        "model": STRING,
        "status": {"enum": ["completed", "incomplete"]},
        "incomplete_details": nullable(obj({"reason": {"const": "max_output_tokens"}}, ("reason",))),
        "error": {"type": "null"},
        "output": {
            "type": "array",
            "items": {
                "anyOf": [
                    obj(
                        {
                            "type": {"const": "message"},
                            "id": STRING,
                            "status": {"const": "completed"},
                            "role": {"const": "assistant"},
                            "content": {"type": "array", "items": {"type": "object"}},
                        },
                        ("type", "id", "status", "role", "content"),
                    ),
                    obj(
                        {
                            "type": {"const": "function_call"},
                            "id": STRING,
                            "call_id": STRING,
                            "name": STRING,
                            "arguments": STRING,
                            "status": {"const": "completed"},
                        },
                        ("type", "id", "call_id", "name", "arguments", "status"),
                    ),
                ]
            },
        },
        "parallel_tool_calls": BOOLEAN,
        "tool_choice": STRING,
        "tools": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"]},
    },
    ("id", "object", "created_at", "model", "status", "output", "usage"),
)
GENERATE_REPLY = obj(
    {
        "request_id": STRING,
        "choices": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": obj(
                {
                    "index": {"const": 0},
                    "token_ids": {"type": "array", "items": INTEGER},
                    "logprobs": obj(
                        {
                            "content": {
                                "type": "array",
                                "items": obj(
                                    {"token": {"type": "string", "pattern": "^token_id:[0-9]+$"}, "logprob": NUMBER},
                                    ("token", "logprob"),
                                ),
                            }
                        },
                        ("content",),
                    ),
                    "finish_reason": {"enum": ["stop", "length"]},
                },
                ("index", "token_ids", "logprobs", "finish_reason"),
            ),
        },
        "usage": _USAGE,
    },
    ("request_id", "choices", "usage"),
)
MODELS = obj(
    {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": obj(
                {
                    "id": STRING,
                    "object": {"const": "model"},
                    "created": INTEGER,
                    "owned_by": STRING,
                    "max_model_len": INTEGER,
                },
                ("id", "object", "created", "owned_by", "max_model_len"),
            ),  # fmt: skip
        },
    },
    ("object", "data"),
)
CLAIMED = obj(
    {"session_id": STRING, "base_url": STRING, "api_key": STRING, "row": {"type": "object"}},
    ("session_id", "base_url", "api_key", "row"),
)
REWARDED = obj({"session_id": STRING, "status": {"const": "closed"}}, ("session_id", "status"))
