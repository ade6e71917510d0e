"""The built-in Python interpreter tool: the model's code runs in a sandbox (tools/sandbox.py) and the tool
returns what it printed. Its config (the tools YAML file's ``config:``) sets the sandbox's limits."""

from __future__ import annotations

from typing import Any

from hybridflow.tools.base import Tool, ToolResponse
from hybridflow.tools.sandbox import SandboxLimits, check_sandbox, run_python


class PythonTool(Tool):
    name = "python"
    description = (
        "Run a Python program and see what it prints (standard library only; no network; files only in its "
        "working directory; limited time and memory). Use print() to show results."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python program"}},
        "required": ["code"],
    }

    def __init__(self, **limits: Any) -> None:
        self.limits = SandboxLimits(**limits)
        check_sandbox()  # at start-up, not at the first call deep into a run

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResponse(text='Error: give the program as {"code": "..."}', error=True)
        result = await run_python(code, self.limits)
        return ToolResponse(text=result.as_tool_output(), error=result.error is not None or result.exit_code != 0)
