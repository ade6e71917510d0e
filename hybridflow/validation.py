"""Checking a config field where it is declared: the error every config dataclass raises.

Each component's config dataclass validates its own fields in ``__post_init__`` with these
helpers. The error names the field (relative to its dataclass); the config loader
(``hybridflow/trainer/config.py``) adds the path of the section, so the user reads the full key
they typed, e.g. ``actor_rollout_ref.actor.policy_loss.clip_ratio_c``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Collection


class UserError(Exception):
    """A problem with what the user gave (a config value, a file, a command's arguments): the command
    line prints it as one message and exits with code 2, without a traceback (unless --debug)."""


def split_debug_flag(args: list[str]) -> tuple[bool, list[str]]:
    """Whether a traceback was asked for (``--debug`` anywhere on the line, or ``HYBRIDFLOW_DEBUG=1``), and
    the arguments without ``--debug``."""
    debug = "--debug" in args or os.environ.get("HYBRIDFLOW_DEBUG", "") not in ("", "0")
    return debug, [arg for arg in args if arg != "--debug"]


def run_command(command: Callable[[], int], debug: bool) -> int:
    """``command()``'s exit code; a UserError is one message on stderr and exit code 2 (``debug``: with
    the traceback). Every command-line entry point runs through this."""
    try:
        return command()
    except UserError as error:
        if debug:
            traceback.print_exc()
        print(f"hybridflow: error: {error}", file=sys.stderr)
        return 2


class InvalidSetting(ValueError):
    """A config field with a value that cannot work; ``field`` is the field's name (or a dotted path)."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}" + (f" (fix: {fix})" if fix else ""))


def require(condition: bool, field: str, problem: str, fix: str = "") -> None:
    """Raise InvalidSetting(field, problem, fix) unless ``condition``."""
    if not condition:
        raise InvalidSetting(field, problem, fix)


def require_choice(value: object, choices: Collection, field: str) -> None:
    """``value`` must be one of ``choices`` (a registry's names, a tuple of modes, ...)."""
    if value not in choices:
        listed = ", ".join(sorted(str(c) for c in choices))
        raise InvalidSetting(field, f"{value!r} is not one of: {listed}", f"set {field} to one of them")


def require_positive(value: float, field: str) -> None:
    require(value > 0, field, f"must be positive, got {value}")


def require_positive_fields(config: object, *names: str) -> None:
    """Each named field of ``config`` must be positive."""
    for name in names:
        require_positive(getattr(config, name), name)
