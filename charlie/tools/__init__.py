"""Tools: the registry, the per-call invocation and the built-in tools."""

from charlie.tools import builtins as _builtins  # noqa: F401  (registers the built-in tools)
from charlie.tools.context import Reconciled, ToolContext, ToolError
from charlie.tools.registry import REGISTRY, ToolDef, ToolRegistry, tool

__all__ = ["REGISTRY", "Reconciled", "ToolContext", "ToolDef", "ToolError", "ToolRegistry", "tool"]
