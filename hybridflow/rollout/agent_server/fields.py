"""A request body's fields read by their types, never coerced: a boolean is ``true`` or ``false`` (not ``1`` or
``"false"``), an integer is a JSON integer (not ``8.0``, and not a boolean, which Python counts as an int), a number
is finite, a string is a string. Each reader returns the field (``None`` when it is absent or null) or raises a 400
`ApiError` naming it; ``where`` is the path of the object the field is in (``"sampling_params."``)."""

from __future__ import annotations

import math
from typing import Any

from hybridflow.rollout.agent_server.errors import ApiError, bad_request


def refuse_unknown(body: dict[str, Any], known: set[str], where: str = "") -> None:
    """400 naming the first key of ``body`` not in ``known``."""
    for key in body:
        if key not in known:
            raise bad_request(f"unknown parameter: {where}{key!r}", param=f"{where}{key}", code="unknown_parameter")


def refuse_given(body: dict[str, Any], names: tuple[str, ...], message: str) -> None:
    """400 naming the first of ``names`` that ``body`` gives (null counts as not given): a parameter the endpoint
    knows and does not support; ``message`` says why, its ``{name}`` the parameter's name, quoted."""
    for name in names:
        if body.get(name) is not None:
            raise bad_request(message.format(name=repr(name)), param=name, code="unsupported_value")


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "'model' is required: the id /v1/models lists", param="model", code="missing_required_parameter"
        )
    if model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this endpoint serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _wrong(name: str, kind: str, value: Any) -> ApiError:
    return bad_request(f"{name!r} must be {kind}, got {_shown(value)}", param=name)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def boolean(body: dict[str, Any], name: str, where: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _wrong(f"{where}{name}", "a boolean (true or false)", value)
    return value


def integer(body: dict[str, Any], name: str, where: str = "", *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(f"{where}{name}", "an integer", value)
    if minimum is not None and value < minimum:
        raise _wrong(f"{where}{name}", f"an integer >= {minimum}", value)
    return value


def is_finite_number(value: Any) -> bool:
    """A JSON number Python can compute with: not a boolean, finite, and (an integer) within a float's range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        return False


def number(body: dict[str, Any], name: str, where: str = "") -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_finite_number(value):
        raise _wrong(f"{where}{name}", "a finite number", value)
    return float(value)


def string(body: dict[str, Any], name: str, where: str = "") -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _wrong(f"{where}{name}", "a string", value)
    return value


def mapping(body: dict[str, Any], name: str, where: str = "") -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise _wrong(f"{where}{name}", "an object", value)
    return value


def strings(body: dict[str, Any], name: str, where: str = "") -> list[str] | None:
    value = body.get(name)
    if value is not None and not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise _wrong(f"{where}{name}", "a list of strings", value)
    return value


def only(body: dict[str, Any], name: str, allowed: float, why: str, where: str = "") -> None:
    """A number a request may give only at ``allowed`` (the run's sampling is fixed)."""
    value = number(body, name, where)
    if value is not None and value != allowed:
        raise bad_request(
            f"{where}{name}={value:g} is not supported ({why}); omit it",
            param=f"{where}{name}",
            code="unsupported_value",
        )
