"""The help of every config key, written once: the comment on its field in the component's dataclass.

    path: str  # local Hugging Face directory, or a built-in name (tiny-llama, ...)

is the help of ``actor_rollout_ref.model.path``; a help too long for one line is written as comment
lines right above the field. The comments of the default YAML (hybridflow/config/ppo_trainer.yaml) are
made from these, never edited by hand: ``python -m hybridflow.trainer.setup.config_help`` rewrites them (``make
format`` runs it), a test fails when they differ, and ``hybridflow train --help KEY`` prints them with
the defaults. A backend's section (``rollout.<name>``) is described by its registered summary.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from omegaconf import OmegaConf

from hybridflow.rollout.backend import rollout_backends
from hybridflow.trainer.setup.config import DEFAULT_CONFIG, ConfigError, HybridFlowConfig, config_sections
from hybridflow.validation import run_command, split_debug_flag

WIDTH = 120  # ruff's line length; a help that does not fit after its key goes above it


@dataclass(frozen=True)
class Help:
    text: str  # the help, one paragraph
    above: bool  # written as comment lines above the field (True) or after it on its line


@cache
def field_help(cls: type) -> dict[str, Help]:
    """The help of each field ``cls`` (and its dataclass bases) declares, from the classes' source."""
    helps: dict[str, Help] = {}
    for owner in reversed(cls.__mro__):
        if owner is object or "__annotations__" not in vars(owner):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(owner))
        except (OSError, TypeError):  # made at run time (the rollout config's backend sections)
            continue
        helps.update(_comments_of_fields(source, set(vars(owner)["__annotations__"])))
    return helps


def _comments_of_fields(source: str, fields: set[str]) -> dict[str, Help]:
    """``name: type  # help`` lines of a class body, and comment lines right above a field."""
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string[1:].strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    helps = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"    (\w+): ", line)
        if not match or match.group(1) not in fields:
            continue
        if number in comments:
            helps[match.group(1)] = Help(comments[number], above=False)
            continue
        above, row = [], number - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        if above:
            helps[match.group(1)] = Help(" ".join(above), above=True)
    return helps


def _section_help(owner: type, name: str, hint: type) -> Help | None:
    """A section's help: its field's comment, else (a backend's section) the backend's summary."""
    if name in field_help(owner):
        return field_help(owner)[name]
    backend = rollout_backends().get(name)
    if backend is not None and backend.settings is hint:
        return Help(f"rollout.name={name}: {backend.summary}", above=False)
    return None


def key_help(cls: type = HybridFlowConfig, prefix: str = "") -> dict[str, Help | None]:
    """Every key under ``cls`` (sections too, in field order) with its help (None: a section without one)."""
    hints = typing.get_type_hints(cls)
    helps: dict[str, Help | None] = {}
    for field in dataclasses.fields(cls):
        key, hint = f"{prefix}{field.name}", hints[field.name]
        if dataclasses.is_dataclass(hint):
            helps[key] = _section_help(cls, field.name, hint)
            helps.update(key_help(hint, key + "."))
        else:
            helps[key] = field_help(cls).get(field.name)
    return helps


def keys_usage(section: str, root: type = HybridFlowConfig, defaults: Path = DEFAULT_CONFIG) -> str:
    """Each key under ``section`` (a dotted prefix) of the ``root`` config with its default (from ``defaults``)
    and its help: ``hybridflow train --help SECTION`` (and ``sft``'s)."""
    values = OmegaConf.to_container(OmegaConf.load(defaults))
    helps = key_help(root)
    lines = []
    for key, help in helps.items():
        if key != section and not key.startswith(section + "."):
            continue
        is_section = any(other.startswith(key + ".") for other in helps)
        value = functools.reduce(lambda node, part: node[part], key.split("."), values)
        lines.append(key + ("" if is_section else f" = {value!r}") + (f"\n    {help.text}" if help else ""))
    if not lines:
        raise ConfigError(section, "no such key or section", "--help lists the sections")
    return "\n".join(lines)


def command_usage(command: str, root: type, about: str) -> str:
    """A config command's help (``hybridflow <command> --help``): its usage, ``about`` (what it does, where its
    defaults are, an example) and the top-level sections of its config ``root``."""
    sections = "\n".join(f"  {name:<24} {help}" for name, help in config_sections(root))
    gap = " " * (9 - len(command))  # every command's help column at the same place
    return f"""usage: hybridflow {command} [--config FILE] [--debug] key=value ...
       hybridflow {command} --help [SECTION]{gap}every key of SECTION with its default and help

{about}
config sections:
{sections}
"""


def config_command_args(
    args: list[str], command: str, about: str, root: type, defaults: Path
) -> tuple[list[str], str | None] | None:
    """A config command's arguments (``hybridflow train`` / ``sft [--config FILE] key=value ...``): None after
    printing its help (``--help``: its usage with ``about``, see command_usage; ``--help SECTION``: every key of a
    section); else the ``key=value`` overrides and the ``--config`` file (or None)."""
    if any(arg in ("-h", "--help") for arg in args):
        sections = [arg for arg in args if not arg.startswith("-")]
        print(keys_usage(sections[0], root, defaults) if sections else command_usage(command, root, about))
        return None
    if args and args[0] == "--config":
        if len(args) < 2:
            raise ConfigError("--config", "needs a file", f"hybridflow {command} --config FILE [key=value ...]")
        return args[2:], args[1]
    return args, None


def run_as_module(main: Callable[[list[str]], int]) -> int:
    """A command run as ``python -m <its module>``: ``main`` on this process's arguments, as ``hybridflow`` runs it
    (errors included; ``--debug`` anywhere: with tracebacks)."""
    debug, arguments = split_debug_flag(sys.argv[1:])
    return run_command(lambda: main(arguments), debug)


def yaml_with_help(text: str, helps: dict[str, Help | None]) -> str:
    """The YAML ``text`` with its comments replaced by ``helps``: values, keys and order are kept; a key's
    comment goes after it, or above it when it does not fit in WIDTH; other comment lines inside the
    sections are dropped (the file's header, before the first key, is kept)."""
    out: list[str] = []
    path: list[tuple[int, str]] = []  # (indent, key) of the enclosing sections
    started = False
    for line in text.splitlines():
        match = re.match(r"^( *)('?[\w-]+'?):(.*)$", line)
        if not match:
            if not started or line.strip() and not line.lstrip().startswith("#"):
                out.append(line)
            continue
        started = True
        indent, key, rest = len(match.group(1)), match.group(2).strip("'"), match.group(3)
        while path and path[-1][0] >= indent:
            path.pop()
        full = ".".join([k for _, k in path] + [key])
        value = _strip_comment(rest)
        head = f"{match.group(1)}{match.group(2)}:{value}"
        help = helps.get(full)
        if help is None:
            out.append(head)
        elif not help.above and len(f"{head}  # {help.text}") <= WIDTH:
            out.append(f"{head}  # {help.text}")
        else:
            prefix = " " * indent + "# "
            out += textwrap.wrap(help.text, WIDTH, initial_indent=prefix, subsequent_indent=prefix)
            out.append(head)
        if not value.strip():
            path.append((indent, key))
    return "\n".join(out) + "\n"


def _strip_comment(rest: str) -> str:
    """A YAML line's value part without its comment (a # inside quotes is part of the value)."""
    quote = None
    for index, char in enumerate(rest):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (index == 0 or rest[index - 1] == " "):
            return rest[:index].rstrip()
    return rest.rstrip()
