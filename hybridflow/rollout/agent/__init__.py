"""Request-level asynchronous multi-turn rollout: an agent loop per sample (state machine, tool calls,
token bookkeeping) over a generation engine's request API (rollout/requests.py)."""

from hybridflow.rollout.agent.config import MultiTurnConfig
from hybridflow.rollout.agent.loops import AGENT_LOOPS, AgentContext, AgentLoop, register_agent_loop
from hybridflow.rollout.agent.parsers import TOOL_CALL_FORMATS, register_tool_call_format
from hybridflow.rollout.agent.rollout import AgentRollout
from hybridflow.rollout.agent.state import RequestState, Trajectory

__all__ = [
    "AGENT_LOOPS",
    "TOOL_CALL_FORMATS",
    "AgentContext",
    "AgentLoop",
    "AgentRollout",
    "MultiTurnConfig",
    "RequestState",
    "Trajectory",
    "register_agent_loop",
    "register_tool_call_format",
]
