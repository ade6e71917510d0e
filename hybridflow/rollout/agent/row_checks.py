"""The agent loops' check of a run's rows, before anything is built: rows that name an agent loop need multi-turn
rollout, and every loop named exists (each name checked once; rollout/row_checks.py runs it)."""

from __future__ import annotations

from typing import Any

from hybridflow.batch_keys import AGENT_NAME
from hybridflow.rollout.agent.loops import agent_loop_class
from hybridflow.validation import ConfigError


def check_agent_names(rollout: Any, rows: list[dict]) -> None:
    if rollout.agent.enabled:  # the user's agents run the sessions, not an agent loop
        return
    names = sorted({str(row.get(AGENT_NAME) or "") for row in rows} - {""})
    if not names:
        return
    if not rollout.multi_turn.enable:
        raise ConfigError(
            "actor_rollout_ref.rollout.multi_turn.enable",
            f"the data names agent loops ({', '.join(names)}) in its agent_name column, but multi-turn rollout is off",
            "set actor_rollout_ref.rollout.multi_turn.enable=true",
        )
    for name in names:
        try:
            agent_loop_class(name)
        except (KeyError, TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as error:
            raise ConfigError("data (agent_name column)", str(error).strip("'\"")) from None
