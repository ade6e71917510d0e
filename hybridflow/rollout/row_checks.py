"""Each rollout feature's own checks of a run's rows, run once before anything is built (the trainer calls
``check_rollout_rows``, and names no feature): a feature adds its check here, beside its code."""

from __future__ import annotations

from hybridflow.rollout.agent.row_checks import check_agent_names
from hybridflow.rollout.agent_server.row_checks import check_agent_rows
from hybridflow.rollout.config import RolloutConfig

ROW_CHECKS = (check_agent_rows, check_agent_names)  # each (rollout config, rows) -> None, or a ConfigError


def check_rollout_rows(rollout: RolloutConfig, rows: list[dict]) -> None:
    for check in ROW_CHECKS:
        check(rollout, rows)
