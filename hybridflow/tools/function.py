"""A plain Python function as a tool: its schema from the signature and docstring.

    def word_count(text: str) -> int:
        \"\"\"Count the words of a text.\"\"\"
        return len(text.split())

    tool = FunctionTool(word_count)   # name "word_count", one required string argument "text"

The function may be sync (run in a worker thread, so a slow one does not stop generation) or async,
and returns a string, a ToolResponse, or any value (shown as ``str(value)``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, get_type_hints

from hybridflow.tools.base import Tool, ToolResponse

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(annotation: Any) -> dict[str, str]:
    origin = getattr(annotation, "__origin__", annotation)
    return {"type": _JSON_TYPES[origin]} if origin in _JSON_TYPES else {}


def function_parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s keyword-callable parameters (types from its annotations)."""
    hints = get_type_hints(fn)
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool function {fn.__name__!r}: parameter {name!r} cannot be passed by name")
        properties[name] = _json_type(hints.get(name, Any))
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


class FunctionTool(Tool):
    """Calls ``fn(**arguments)``; arguments that do not fit its signature are an error shown to the model."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description or (inspect.getdoc(fn) or "").split("\n\n")[0]
        self.parameters = function_parameters(fn)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as error:
            return ToolResponse(text=f"Error: bad arguments for {self.name}: {error}", error=True)
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**arguments)
        else:
            result = await asyncio.to_thread(self.fn, **arguments)
        return result if isinstance(result, ToolResponse) else ToolResponse(text=str(result))
