"""One trajectory's tools: instances created at their first call, calls answered, rewards asked, released.

Whatever a call does wrong becomes the tool's answer, never an exception out of the loop: a malformed
call, an unknown tool, missing arguments, a tool that raises or that does not answer within
``timeout_s`` (it is cancelled). Such answers start with "Error:" and count as tool errors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hybridflow.rollout.agent.parsers import MalformedCall, ParsedCall
from hybridflow.tools import ToolResponse, ToolSet
from hybridflow.tools.base import missing_arguments

logger = logging.getLogger(__name__)


class TrajectoryTools:
    """The tools of one trajectory. tools_kwargs: the sample's ``extra_info.tools_kwargs``."""

    def __init__(self, tools: ToolSet, instance_id: str, tools_kwargs: dict[str, Any], timeout_s: float):
        self.tools, self.instance_id, self.timeout_s = tools, instance_id, timeout_s
        self.tools_kwargs = tools_kwargs or {}
        self.created: dict[str, asyncio.Task] = {}  # tool name -> its create(), run once

    async def call(self, parsed: ParsedCall) -> ToolResponse:
        if isinstance(parsed, MalformedCall):
            return ToolResponse(text=f"Error: {parsed.problem}", error=True)
        if parsed.name not in self.tools:
            known = ", ".join(self.tools.tools) or "none"
            return ToolResponse(text=f"Error: there is no tool named {parsed.name!r} (tools: {known})", error=True)
        tool = self.tools[parsed.name]
        missing = missing_arguments(tool.parameters, parsed.arguments)
        if missing:
            return ToolResponse(text=f"Error: {tool.name} needs the argument(s) {', '.join(missing)}", error=True)
        try:
            return await asyncio.wait_for(self._execute(tool.name, parsed.arguments), self.timeout_s)
        except TimeoutError:
            return ToolResponse(text=f"Error: {tool.name} did not answer within {self.timeout_s:g} s", error=True)
        except Exception as error:  # noqa: BLE001  (a tool's bug is the model's error message, not a crash)
            logger.warning("tool %r raised on %r: %r", tool.name, parsed.arguments, error, exc_info=error)
            return ToolResponse(text=f"Error: {tool.name} failed: {type(error).__name__}: {error}", error=True)

    async def _execute(self, name: str, arguments: dict[str, Any]) -> ToolResponse:
        if name not in self.created:
            create_kwargs = dict(self.tools_kwargs.get(name, {}).get("create_kwargs", {}))
            self.created[name] = asyncio.ensure_future(self.tools[name].create(self.instance_id, **create_kwargs))
        await self.created[name]
        response = await self.tools[name].execute(self.instance_id, arguments)
        if not isinstance(response, ToolResponse):
            raise TypeError(f"execute returned {type(response).__name__}, not a ToolResponse")
        return response

    async def finish(self) -> dict[str, float]:
        """Each created tool's reward for the trajectory, then release them all (failures are logged, and score 0)."""
        rewards = {}
        for name, created in self.created.items():  # every call has returned: their create()s are done
            tool = self.tools[name]
            rewards[name] = 0.0
            if created.cancelled() or created.exception() is not None:
                continue  # it never started (timed out, or raised: that call's answer said so)
            try:
                rewards[name] = float(await asyncio.wait_for(tool.reward(self.instance_id), self.timeout_s))
            except Exception as error:  # noqa: BLE001
                logger.warning("tool %r: reward failed: %r", name, error)
            try:
                await asyncio.wait_for(tool.release(self.instance_id), self.timeout_s)
            except Exception as error:  # noqa: BLE001
                logger.warning("tool %r: release failed: %r", name, error)
        return rewards
