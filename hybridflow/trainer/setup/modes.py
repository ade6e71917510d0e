"""Training modes (``trainer.async_training.mode``): each one a descriptor, in one registry.

A mode is two parts that the RL trainer is given (rl_trainer.py): where a step's batch comes from
(batch_source.py) and when the weights move to the generator (weight_sync.py); and two facts the rest of the
driver reads: whether generation runs on a pool of its own (the rollout role; the run plan, placement and
the planner read it) and how many policy versions a batch may lag the weights it trains (check_config
requires a correction when it may).

This module holds the facts, which the config, the checks, the run plan and the planner read without any of the
machinery; the parts are registered by the layer that builds them (trainer/loop/mode_parts.py,
``register_mode_parts``), so every import points down the layers. A new mode is one ``TrainingMode`` registered
here with ``register_training_mode`` and its parts' builder registered there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class TrainingMode:
    name: str
    summary: str  # one line, for help and error messages
    rollout_apart: bool  # generation on the rollout role's own pool (else the hybrid actor generates)
    lag: Callable[[Any], int]  # the async_training settings -> the most versions a batch lags the policy it trains


SYNC = "sync"
ONE_STEP_OFF = "one_step_off"
FULLY_ASYNC = "fully_async"

_MODES: dict[str, TrainingMode] = {}


def register_training_mode(mode: TrainingMode) -> TrainingMode:
    if mode.name in _MODES:
        raise ValueError(f"training mode '{mode.name}' is already registered")
    _MODES[mode.name] = mode
    return mode


def training_mode(name: str) -> TrainingMode:
    if name not in _MODES:
        raise ValueError(f"unknown training mode '{name}'; known: {', '.join(_MODES)}")
    return _MODES[name]


def mode_names() -> tuple[str, ...]:
    return tuple(_MODES)


register_training_mode(
    TrainingMode(
        name=SYNC,
        summary="generate, then train, both on the actor's pool (the hybrid engine switches its layout)",
        rollout_apart=False,
        lag=lambda settings: 0,
    )
)
register_training_mode(
    TrainingMode(
        name=ONE_STEP_OFF,
        summary="the rollout role generates the batch of step k+1 with the weights of step k-1 while the actor "
        "trains step k (trainer/loop/generate_ahead.py)",
        rollout_apart=True,
        lag=lambda settings: 1,
    )
)
register_training_mode(
    TrainingMode(
        name=FULLY_ASYNC,
        summary="the rollout role generates continuously into a queue, at most max_staleness versions ahead "
        "(trainer/loop/async_queue.py)",
        rollout_apart=True,
        lag=lambda settings: settings.max_staleness,
    )
)
