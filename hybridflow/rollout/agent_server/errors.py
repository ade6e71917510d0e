"""Errors the endpoint answers with: the HTTP status and an OpenAI-style body, so that clients raise the exception
their SDK maps the status to (``openai.AuthenticationError`` for 401, ``BadRequestError`` for 400, ...)."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the endpoint refuses: ``status``, the message (what is wrong and how to fix it), the parameter at
    fault and a short machine-readable code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
