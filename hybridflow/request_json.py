"""A request body's JSON as the services read it: bounded in depth, finite in its numbers, valid Unicode in its text.

Python's ``json`` accepts what a service must refuse: ``NaN`` and ``Infinity`` (and ``1e400``, read as infinity, and
integers past a float's range, on which ``float()`` raises),
strings holding lone UTF-16 surrogates (``"\\ud800"``) that no tokenizer can encode, and nesting deep enough to raise
``RecursionError`` in whatever walks the value next. ``read_request_json`` refuses each with a ``RequestJsonError``
whose message names the problem, so that both services (the agent endpoint and the training service) answer it as a
client error in their own error shape instead of failing inside.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

# Deeper than any real request (a tool's JSON Schema nests a few levels per property), far below the interpreter's
# recursion limit, which code walking the value (pydantic, jsonschema, the chat template) must stay under.
MAX_DEPTH = 64


class RequestJsonError(ValueError):
    """A body that is not JSON the services take; the message says what is wrong."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestJsonError(f"the number {text} is out of range: numbers must be finite")
    return value


def _float_sized_int(text: str) -> int:
    value = int(text)
    if abs(value) > sys.float_info.max:  # float() of it, which numeric checks do, would raise OverflowError
        raise RequestJsonError(f"the number {text[:20]}... is out of range: numbers must be finite")
    return value


def _no_constant(name: str) -> Any:
    raise RequestJsonError(f"{name} is not JSON: numbers must be finite")


def read_request_json(body: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``body`` (UTF-8), checked: at most ``max_depth`` arrays/objects deep, every number finite,
    every string (keys too) valid Unicode. Raises ``RequestJsonError`` with the reason otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestJsonError(f"the body is not UTF-8: {error}") from None
    try:
        value = json.loads(text, parse_float=_finite_float, parse_int=_float_sized_int, parse_constant=_no_constant)
    except RecursionError:
        raise RequestJsonError(
            f"the body is nested too deeply: at most {max_depth} levels of arrays and objects"
        ) from None
    except RequestJsonError:
        raise
    except json.JSONDecodeError as error:
        raise RequestJsonError(f"the body is not valid JSON: {error}") from None
    except ValueError:  # an integer past Python's limit on digits
        raise RequestJsonError("a number in the body has too many digits: numbers must fit in 4,300 digits") from None
    check_json_value(value, max_depth=max_depth)
    return value


def check_json_value(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``RequestJsonError`` if ``value`` nests deeper than ``max_depth`` or holds text that is not valid
    Unicode (a lone surrogate). Walks without recursion, so any depth is checked safely."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "body")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                raise RequestJsonError(
                    f"the body is nested too deeply at {where}: at most {max_depth} levels of arrays and objects"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, f"a key of {where}")
                    stack.append((child, depth + 1, f"{where}.{key}"))
            else:
                stack.extend((child, depth + 1, f"{where}[{i}]") for i, child in enumerate(item))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("utf-16-be", "surrogatepass").hex()
        raise RequestJsonError(
            f"{where} is not valid Unicode: a lone UTF-16 surrogate (0x{bad}) at character {error.start}; "
            "send text as UTF-8, or escape a pair of surrogates for characters outside the basic plane"
        ) from None
