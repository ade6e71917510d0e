"""Tools an agent loop calls (rollout/agent): the interface, plain functions as tools, the built-ins
(a calculator; a Python interpreter in a sandbox) and the YAML file that declares a run's tools."""

from hybridflow.tools.base import Tool, ToolResponse
from hybridflow.tools.function import FunctionTool
from hybridflow.tools.registry import TOOLS, ToolSet, load_tools, register_tool

__all__ = ["TOOLS", "FunctionTool", "Tool", "ToolResponse", "ToolSet", "load_tools", "register_tool"]
