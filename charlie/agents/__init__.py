"""Framework agents as Charlie tasks: an adapter at the edge, like ``charlie.mcp``.

A task submitted with ``agent="module:attr"`` runs a Pydantic AI agent on Charlie's own phases:
the agent's model object answers the task's model calls (recorded as any model call is, I3),
its function tools are the task's tools (each call recorded before it runs, I9-I11), its output
type and validators decide the final answer. Nothing here is known to the executor or the
store: the task's model spec names the agent (``<model>#agent=<ref>[&deps=<ref>]``), the
runtime resolves that spec through :func:`model_for`, and the agent's tools reach the registry
through :func:`find_tool` when first named in a process.

The framework is an optional dependency (``pip install 'charlie[pydantic-ai]'``), imported only
when an agent is used (:mod:`charlie.agents.pydantic_ai`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from charlie.agents.spec import (
    MARK,
    METADATA_KEY,
    USAGE_LIMIT_FIELDS,
    AgentRefused,
    AgentSpec,
    Submission,
    base_model,
    is_agent_spec,
    parse_spec,
    usage_limits_of,
)

if TYPE_CHECKING:
    from charlie.models.base import Model
    from charlie.tools.registry import ToolRegistry


def prepare_submission(
    agent: str,
    deps: str | None,
    approve: list[str] | None,
    metadata: dict[str, Any] | None,
    usage_limits: Any = None,
) -> Submission:
    """Import the agent (and check its deps factory) in this process and say what its task
    is, or raise AgentRefused naming what cannot be made durable."""
    from charlie.agents import pydantic_ai

    return pydantic_ai.prepare_submission(
        agent, deps, approve, metadata, usage_limits_of(usage_limits)
    )


def model_for(spec: str, tools: ToolRegistry) -> Model:
    """The task's model client for an agent's spec; registers the agent's tools in ``tools``."""
    from charlie.agents import pydantic_ai

    return pydantic_ai.model_for(parse_spec(spec), tools)


def find_tool(tools: ToolRegistry, name: str) -> bool:
    """Register the tools of the agent a tool name belongs to (``module:attr.tool``), if it
    names one that can be imported here; True when the name is registered now.

    The agent's reference may hold dots (``module:holder.agent``), and so may the tool's name
    (an MCP server's ``fs.read``): each dot after the colon is tried as the split, the last
    first, until one registers the name."""
    module, colon, rest = name.partition(":")
    if not colon or not module or "." not in rest or name.startswith("mcp__"):
        return False
    try:
        from charlie.agents import pydantic_ai
    except ImportError:
        return False  # no framework here: no agent's tool either
    from charlie.tools.registry import ToolUnavailable

    unavailable: ToolUnavailable | None = None
    splits = [at for at, char in enumerate(rest) if char == "."]
    for at in reversed(splits):
        try:
            pydantic_ai.register_agent_tools(f"{module}:{rest[:at]}", tools, name)
        except ToolUnavailable as exc:
            # the agent's, not made here now (one of its MCP servers did not answer); another
            # split may still name an agent that has it
            unavailable = exc
            continue
        if tools.get_registered(name) is not None:
            return True
    if unavailable is not None:
        raise unavailable
    return False


def register_module_agents(module: Any, tools: ToolRegistry) -> None:
    """Register the tools of every Pydantic AI agent a tool module defines at its top level,
    so that a worker that imports the module (CHARLIE_TOOL_MODULES) records each call's
    implementation from its first claim on."""
    import sys

    if "pydantic_ai" not in sys.modules:
        return  # the module defines no agent: it did not import the framework
    from charlie.agents import pydantic_ai

    pydantic_ai.register_module_agents(module, tools)


__all__ = [
    "MARK",
    "METADATA_KEY",
    "USAGE_LIMIT_FIELDS",
    "AgentRefused",
    "AgentSpec",
    "Submission",
    "base_model",
    "find_tool",
    "is_agent_spec",
    "model_for",
    "parse_spec",
    "prepare_submission",
    "register_module_agents",
    "usage_limits_of",
]
