"""Agent loops: how one request's conversation unfolds. Chosen per sample by its ``agent_name`` column.

    single_turn   one generation (the plain rollout, through the request API)
    tool_agent    generate; if the turn calls tools, run them, append their answers, generate again

A user's loop subclasses `AgentLoop` and is registered with ``register_agent_loop("name", MyLoop)``
(or named in the data as ``path/to/file.py:MyLoop``); it reads and writes only its `Trajectory`
through the `AgentContext`, so batching, token bookkeeping and failure handling stay the runner's.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from hybridflow.rollout.agent.chat import ChatFormat
from hybridflow.rollout.agent.config import MultiTurnConfig
from hybridflow.rollout.agent.parsers import ToolCallParser
from hybridflow.rollout.agent.state import (
    STOP_ASSISTANT_TURNS,
    STOP_LENGTH,
    STOP_NO_TOOL_CALL,
    STOP_USER_TURNS,
    RequestState,
    Trajectory,
)
from hybridflow.rollout.agent.tool_calls import TrajectoryTools
from hybridflow.rollout.requests import RequestEngine
from hybridflow.tools import ToolResponse
from hybridflow.user_code import load_object


@dataclass
class AgentContext:
    """What a loop works with for one request."""

    engine: RequestEngine
    tokenizer: Any
    chat: ChatFormat
    parse: ToolCallParser
    tools: TrajectoryTools
    config: MultiTurnConfig
    response_length: int  # the response token budget: generated and inserted tokens together

    def remaining(self, trajectory: Trajectory) -> int:
        return self.response_length - len(trajectory.tokens)


class AgentLoop(ABC):
    @abstractmethod
    async def run(self, trajectory: Trajectory, context: AgentContext) -> None:
        """Fill ``trajectory`` and leave it FINISHED (an exception marks it FAILED, with the reason)."""


class SingleTurnLoop(AgentLoop):
    async def run(self, trajectory: Trajectory, context: AgentContext) -> None:
        trajectory.move_to(RequestState.GENERATING)
        turn = await context.engine.generate(trajectory.request, trajectory.prompt, context.response_length)
        trajectory.add_generated(turn)
        trajectory.finish(STOP_NO_TOOL_CALL if turn.stopped else STOP_LENGTH)


class ToolAgentLoop(AgentLoop):
    """Generate ⇄ run tools until a turn calls none, the budget is spent, or a turn limit is reached."""

    async def run(self, trajectory: Trajectory, context: AgentContext) -> None:
        config = context.config
        new_tokens = trajectory.prompt
        trajectory.move_to(RequestState.GENERATING)
        while True:
            turn = await context.engine.generate(trajectory.request, new_tokens, context.remaining(trajectory))
            trajectory.add_generated(turn)
            if not turn.stopped:
                return trajectory.finish(STOP_LENGTH)
            calls = context.parse(context.tokenizer.decode(turn.tokens))
            if not calls:
                return trajectory.finish(STOP_NO_TOOL_CALL)
            if trajectory.assistant_turns >= config.max_assistant_turns:
                return trajectory.finish(STOP_ASSISTANT_TURNS)
            if trajectory.user_turns >= config.max_user_turns:
                return trajectory.finish(STOP_USER_TURNS)
            trajectory.move_to(RequestState.RUNNING_TOOLS)
            answers = await self.run_calls(calls, context)
            trajectory.tool_calls += len(calls)
            trajectory.tool_errors += sum(answer.error for answer in answers)
            trajectory.turn_scores[-1] += sum(answer.reward for answer in answers)
            texts = [context.chat.truncate(answer.text, config.max_tool_response_length) for answer in answers]
            new_tokens = context.chat.tool_response_ids(texts)
            if len(new_tokens) >= context.remaining(trajectory):  # no room for the answers and a token after them
                return trajectory.finish(STOP_LENGTH)
            trajectory.add_inserted(new_tokens)
            trajectory.move_to(RequestState.GENERATING)

    @staticmethod
    async def run_calls(calls: list, context: AgentContext) -> list[ToolResponse]:
        """The first ``max_parallel_calls`` calls, concurrently; the rest are answered with an error."""
        limit = context.config.max_parallel_calls
        answers = list(await asyncio.gather(*(context.tools.call(call) for call in calls[:limit])))
        skipped = f"Error: at most {limit} tool call(s) per turn; this one was not run"
        return answers + [ToolResponse(text=skipped, error=True) for _ in calls[limit:]]


AGENT_LOOPS: dict[str, type[AgentLoop]] = {"single_turn": SingleTurnLoop, "tool_agent": ToolAgentLoop}


def register_agent_loop(name: str, loop: type[AgentLoop]) -> None:
    """Make ``name`` usable in a sample's ``agent_name`` column and as ``multi_turn.default_agent``."""
    if name in AGENT_LOOPS:
        raise ValueError(f"agent loop {name!r} is already registered")
    if not (isinstance(loop, type) and issubclass(loop, AgentLoop)):
        raise TypeError(f"{loop!r} is not a subclass of AgentLoop")
    AGENT_LOOPS[name] = loop


@functools.cache
def agent_loop_class(name: str) -> type[AgentLoop]:
    """The loop class of a registered name, or of a ``file.py:Class`` / ``module:Class`` spec (imported once)."""
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if ":" not in name:
        raise KeyError(f"no agent loop named {name!r}; registered: {sorted(AGENT_LOOPS)}, or give file.py:Class")
    loop = load_object(name, "agent_name")
    if not (isinstance(loop, type) and issubclass(loop, AgentLoop)):
        raise TypeError(f"agent_name {name!r} names {loop!r}, not a subclass of AgentLoop")
    return loop
