"""The errors a user can cause, and how every command reports them: one message naming the key or the
file and the fix, exit code 2.

- ``UserError``: anything wrong with what the user gave; ``run_command`` (every entry point) prints it
  as one message and returns 2. Its kinds: ``ConfigError`` (a config key), ``InputFileError`` (a file
  the user named: data, tools, a --config file, a checkpoint), ``InvalidSetting`` (a config dataclass's
  own field, turned into a ConfigError with the full key by the loader).
- ``reading_file``: the one place a user's file is read: whatever goes wrong while reading and parsing
  it (a missing file, bad YAML, a corrupt parquet) becomes an ``InputFileError`` naming it.
- ``ArgumentParser``: argparse for the commands, reporting a bad argument the same way.

Each component's config dataclass validates its own fields in ``__post_init__`` with ``require*``:
the error names the field (relative to its dataclass); the config loader adds the section's path, so
the user reads the full key they typed, e.g. ``actor_rollout_ref.actor.policy_loss.clip_ratio_c``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from hybridflow.library_output import command_output


class UserError(Exception):
    """A problem with what the user gave (a config value, a file, a command's arguments): the command
    line prints it as one message and exits with code 2, without a traceback (unless --debug)."""


class ConfigError(UserError, ValueError):
    """A config problem, named by its key, with what would fix it."""

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        super().__init__(f"config key '{key}': {problem}" + (f"\n  fix: {fix}" if fix else ""))


class InputFileError(UserError, ValueError):
    """A file the user named (``key``: the setting or argument that named it) that cannot be used."""

    def __init__(self, path: str | Path, problem: str, fix: str = "", key: str = ""):
        self.path, self.key = str(path), key
        named = f"file '{path}'" + (f" ({key})" if key else "")
        super().__init__(f"{named}: {problem}" + (f"\n  fix: {fix}" if fix else ""))


@contextlib.contextmanager
def reading_file(path: str | Path, *, key: str = "", fix: str = "") -> Iterator[None]:
    """Read and parse a user's file inside this block: a failure (missing, unreadable, not the format it
    should be) becomes an InputFileError naming the file and ``key``; a UserError passes unchanged."""
    try:
        yield
    except UserError:
        raise
    except FileNotFoundError:
        raise InputFileError(path, "does not exist", fix or "give an existing file", key) from None
    except Exception as error:  # the parser's own error: yaml, pyarrow, json, an OS error, a bad structure
        problem = " ".join(str(error).split()) or type(error).__name__
        raise InputFileError(path, f"cannot be read ({type(error).__name__}: {problem[:300]})", fix, key) from error


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose bad arguments are a UserError (one message, exit 2) instead of usage on stderr."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def split_debug_flag(args: list[str]) -> tuple[bool, list[str]]:
    """Whether a traceback was asked for (``--debug`` anywhere on the line, or ``HYBRIDFLOW_DEBUG=1``), and
    the arguments without ``--debug``."""
    debug = "--debug" in args or os.environ.get("HYBRIDFLOW_DEBUG", "") not in ("", "0")
    return debug, [arg for arg in args if arg != "--debug"]


def run_command(command: Callable[[], int], debug: bool) -> int:
    """``command()``'s exit code; a UserError is one message on stderr and exit code 2 (``debug``: with
    the traceback). Every command-line entry point runs through this. Other libraries' progress bars and
    start-up chatter are kept quiet meanwhile, in this process and its workers (``debug``: not)."""
    try:
        with command_output(debug):
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
