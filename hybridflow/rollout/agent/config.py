"""The multi-turn rollout's settings (``actor_rollout_ref.rollout.multi_turn.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require, require_positive


@dataclass(kw_only=True)
class MultiTurnConfig:
    enable: bool  # run an agent loop per sample instead of one-shot generation
    # agent loop of rows without an agent_name column: single_turn | tool_agent | registered | file.py:Class
    default_agent: str
    tool_config_path: str  # YAML file declaring the tools (hybridflow/tools/registry.py; "": no tools)
    format: str  # how the model writes tool calls: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>)
    tool_role: str  # the chat role of tool messages given to the chat template
    max_assistant_turns: int  # generation turns per sample at most
    max_user_turns: int  # turns of tool output per sample at most
    max_parallel_calls: int  # tool calls of one turn run (concurrently); later ones are answered with an error
    max_tool_response_length: int  # tokens of one tool answer kept (the rest is cut, marked as cut)
    tool_timeout_s: float  # a tool call that takes longer is cancelled and answered with an error

    def __post_init__(self) -> None:
        require_positive(self.max_assistant_turns, "max_assistant_turns")
        require(self.max_user_turns >= 0, "max_user_turns", f"must be >= 0, got {self.max_user_turns}")
        require_positive(self.max_parallel_calls, "max_parallel_calls")
        require_positive(self.max_tool_response_length, "max_tool_response_length")
        require_positive(self.tool_timeout_s, "tool_timeout_s")
