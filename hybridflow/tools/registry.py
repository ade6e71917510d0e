"""Tools by name, and the YAML file that declares a run's tools (``multi_turn.tool_config_path``).

    tools:
      - name: calculator                      # a registered tool (built in: calculator, python)
      - name: python
        config: {timeout_s: 5, memory_mb: 256}  # the tool's constructor arguments
      - class: my_tools.py:WeatherTool        # a Tool subclass, from a file or an installed module
        config: {units: metric}
      - function: my_tools.py:word_count      # a plain Python function (tools/function.py)

A sample's tools get per-trajectory arguments from its ``extra_info.tools_kwargs``:
``{"<tool name>": {"create_kwargs": {...}}}`` (passed to ``Tool.create``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hybridflow.tools.base import Tool
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.tools.function import FunctionTool
from hybridflow.user_code import load_object
from hybridflow.validation import UserError, reading_file


def _python_tool(**config: Any) -> Tool:
    from hybridflow.tools.python_tool import PythonTool  # the sandbox is checked only where it is used

    return PythonTool(**config)


TOOLS: dict[str, Callable[..., Tool]] = {"calculator": CalculatorTool, "python": _python_tool}


def register_tool(name: str, factory: Callable[..., Tool]) -> None:
    """Make ``name`` usable as ``- name: <name>`` in a tools file; ``factory(**config)`` builds the tool."""
    if name in TOOLS:
        raise ValueError(f"tool {name!r} is already registered")
    TOOLS[name] = factory


class ToolSet:
    """A run's tools by name, with their schemas (in declaration order)."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise UserError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __len__(self) -> int:
        return len(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]


SCHEMA_FIELDS = {"name": str, "description": str, "parameters": dict}  # what a Tool class declares


def _build(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: each tool is a mapping with name, class or function; got {entry!r}")
    kinds = [key for key in ("name", "class", "function") if key in entry]
    unknown = sorted(set(entry) - {"name", "class", "function", "config"})
    if len(kinds) != 1 or unknown:
        raise UserError(f"{where}: give exactly one of name, class, function (and optionally config); got {entry}")
    config = dict(entry.get("config") or {})
    try:
        if "name" in entry:
            if entry["name"] not in TOOLS:
                raise UserError(f"{where}: no tool named {entry['name']!r}; registered: {sorted(TOOLS)}")
            return TOOLS[entry["name"]](**config)
        if "class" in entry:
            cls = load_object(entry["class"], f"{where}.class")
            if not (isinstance(cls, type) and issubclass(cls, Tool)):
                raise UserError(f"{where}.class: {entry['class']!r} is not a subclass of hybridflow.tools.Tool")
            missing = [attr for attr, kind in SCHEMA_FIELDS.items() if not isinstance(getattr(cls, attr, None), kind)]
            if missing:
                raise UserError(
                    f"{where}.class: {entry['class']!r} does not set {', '.join(missing)} (a Tool subclass sets "
                    "name and description as strings and parameters as a JSON schema dict)"
                )
            return cls(**config)
        return FunctionTool(load_object(entry["function"], f"{where}.function"), **config)
    except UserError:
        raise
    except (TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as error:
        raise UserError(f"{where}: {error}") from error


def load_tools(path: str | Path) -> ToolSet:
    """The tools declared in a YAML file (format in this module's docstring); errors name the entry."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"multi_turn.tool_config_path: {str(file)!r} does not exist")
    with reading_file(file, key="multi_turn.tool_config_path", fix="a YAML file with a top-level 'tools:' list"):
        content = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    entries = content.get("tools") if isinstance(content, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{file}: expected a top-level 'tools:' list with at least one tool")
    return ToolSet(_build(entry, f"{file}: tools[{i}]") for i, entry in enumerate(entries))
