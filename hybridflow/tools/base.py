"""The tool interface: one instance per trajectory, created, called, scored and released by the agent loop.

    class MyTool(Tool):
        name = "lookup"
        description = "Look a word up."
        parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}

        async def execute(self, instance_id, arguments):
            return ToolResponse(text=DICTIONARY.get(arguments["word"], "not found"))

A trajectory's tools live from ``create`` (with the sample's ``extra_info.tools_kwargs[name]
["create_kwargs"]``, e.g. its ground truth) to ``release``; ``execute`` answers one call, with a
reward for that call (the turn that made it earns it); ``reward`` is the tool's verdict on the whole
trajectory, asked once at the end. Methods are coroutines so that a slow tool (a sandboxed program,
a web request) waits without holding up the other trajectories' generation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ToolResponse:
    """What one call returns."""

    text: str  # shown to the model as the tool's message
    reward: float = 0.0  # this call's reward: goes to the turn that made the call
    error: bool = False  # the call failed (bad arguments, the tool raised, timed out): counted in agent/tool_errors


class Tool(ABC):
    """A tool; subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of the arguments)
    and implement ``execute``. ``config`` is the tool's section of the tools YAML file."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]

    def __init__(self, **config: Any) -> None:
        if config:
            raise TypeError(f"tool {self.name!r} takes no config, got {sorted(config)}")

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what chat templates render into the prompt's tool list)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:  # noqa: B027  (an optional hook)
        """Start the tool's state for one trajectory."""

    @abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        """Answer one call with the model's arguments (a dict, not yet checked against ``parameters``)."""

    async def reward(self, instance_id: str) -> float:
        """The tool's reward for the whole trajectory, asked once when it ends (default 0)."""
        return 0.0

    async def release(self, instance_id: str) -> None:  # noqa: B027  (an optional hook)
        """Free the trajectory's state."""


def missing_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """The required arguments of a JSON schema that a call left out."""
    return [name for name in parameters.get("required", []) if name not in arguments]
