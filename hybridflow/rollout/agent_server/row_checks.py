"""The agent endpoint's checks of a run's rows, before anything is built: the agent function loads, and a verifiers
environment loads in its venv and names the rows' tasks (rollout/row_checks.py runs them)."""

from __future__ import annotations

from typing import Any

from hybridflow.data.tasks.verifiers_env import check_environment_rows
from hybridflow.rollout.agent_server.rollout import load_agent_function
from hybridflow.validation import ConfigError
from hybridflow.verifiers_runner.launch import EnvironmentRunnerError, verifiers_python

AGENT_KEY = "actor_rollout_ref.rollout.agent"


def check_agent_rows(rollout: Any, rows: list[dict]) -> None:
    agent = rollout.agent
    if not agent.enabled:
        return
    try:
        if agent.function:
            load_agent_function(agent.function)
    except (ImportError, AttributeError, FileNotFoundError, TypeError) as error:
        raise ConfigError(f"{AGENT_KEY}.function", str(error)) from None
    settings = agent.verifiers
    if settings.env:  # the environment loads in its venv and the rows name its tasks
        try:
            python = verifiers_python(settings.python)
            check_environment_rows(settings.env, settings.args, settings.path, python, rows)
        except (ValueError, EnvironmentRunnerError) as error:
            raise ConfigError(f"{AGENT_KEY}.verifiers", str(error)) from None
