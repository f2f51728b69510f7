"""Tools: the registry, the per-call invocation and the built-in tools."""

from charlie.tools import builtins as _builtins  # noqa: F401  (registers the built-in tools)
from charlie.tools import delegation as _delegation  # noqa: F401
from charlie.tools import devbox_tools as _devbox_tools  # noqa: F401  (after the builtins)
from charlie.tools import human as _human  # noqa: F401  (ask_human)
from charlie.tools.context import (
    AskPerson,
    Interrupted,
    LeaseLost,
    Pending,
    Reconciled,
    ToolContext,
    ToolError,
)
from charlie.tools.registry import REGISTRY, ToolDef, ToolRegistry, tool

__all__ = [
    "REGISTRY",
    "AskPerson",
    "Interrupted",
    "LeaseLost",
    "Pending",
    "Reconciled",
    "ToolContext",
    "ToolDef",
    "ToolError",
    "ToolRegistry",
    "tool",
]
