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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from charlie.models.base import Model
    from charlie.tools.registry import ToolRegistry

#: what separates a task's model spec from the agent that runs it: what comes before it is the
#: model as prices, limits and context windows know it (``openai:gpt-4.1``)
MARK = "#agent="
#: the task metadata key that names the agent and its deps factory, for the tool calls
METADATA_KEY = "charlie.agent"


class AgentRefused(ValueError):
    """The agent cannot run as a Charlie task with Charlie's guarantees; the message names what
    (a toolset, a capability, an output function) and why. Nothing was written."""


@dataclass(frozen=True)
class AgentSpec:
    #: the model as Charlie prices and limits it (``openai:gpt-4.1``)
    model: str
    #: ``module:attr`` of the agent
    agent: str
    #: ``module:function`` that builds the agent's deps on the worker, or None
    deps: str | None = None
    #: Pydantic AI's usage limits for the run (``UsageLimits`` fields that are set, as
    #: ``(name, value)`` pairs), enforced from the transcript; part of the spec, so that every
    #: model call of the task, a forked or resumed one included, reads them (I34)
    usage_limits: tuple[tuple[str, int], ...] = ()

    def render(self) -> str:
        rendered = f"{self.model}{MARK}{self.agent}" + (f"&deps={self.deps}" if self.deps else "")
        if self.usage_limits:
            rendered += "&usage_limits=" + ",".join(f"{k}:{v}" for k, v in self.usage_limits)
        return rendered


#: the UsageLimits fields a task enforces (checked as ``agent.run`` checks them)
USAGE_LIMIT_FIELDS = (
    "request_limit",
    "tool_calls_limit",
    "input_tokens_limit",
    "output_tokens_limit",
    "total_tokens_limit",
)


def usage_limits_of(given: Any) -> tuple[tuple[str, int], ...]:
    """Pydantic AI's ``UsageLimits`` (or a dict of its fields, as ``send_task`` carries them)
    as the pairs a spec holds; AgentRefused names a field a task cannot enforce."""
    if given is None:
        return ()
    if isinstance(given, dict):
        fields = dict(given)
    elif type(given).__name__ == "UsageLimits":
        fields = {k: getattr(given, k, None) for k in (*USAGE_LIMIT_FIELDS, *_UNKEPT_LIMITS)}
        if getattr(given, "count_tokens_before_request", False):
            fields["count_tokens_before_request"] = True
    else:
        raise AgentRefused(
            f"usage_limits must be a pydantic_ai UsageLimits or a dict, got {type(given).__name__}"
        )
    pairs = []
    for key, value in fields.items():
        if value is None or (key == "count_tokens_before_request" and value is False):
            continue
        if key not in USAGE_LIMIT_FIELDS:
            raise AgentRefused(
                f"usage limit {key!r} is not enforced by a Charlie task (it enforces "
                f"{', '.join(USAGE_LIMIT_FIELDS)}; a cost limit is the task's budget usd)"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AgentRefused(f"usage limit {key!r} must be a whole number >= 0, got {value!r}")
        pairs.append((key, value))
    return tuple(sorted(pairs))


#: UsageLimits fields a task does not enforce: refused by name when set
_UNKEPT_LIMITS = ("cost_limit", "per_request_input_tokens_limit")


def is_agent_spec(spec: str) -> bool:
    return MARK in spec


def parse_spec(spec: str) -> AgentSpec:
    model, _, rest = spec.partition(MARK)
    agent, *options = rest.split("&")
    found = dict(o.partition("=")[::2] for o in options)
    limits = tuple(
        (k, int(v))
        for k, _, v in (p.partition(":") for p in found.get("usage_limits", "").split(","))
        if k
    )
    return AgentSpec(model, agent, found.get("deps") or None, limits)


def base_model(spec: str) -> str:
    """The model a spec names for prices, limits and windows: an agent's spec without the
    agent."""
    return spec.partition("#")[0]


@dataclass(frozen=True)
class Submission:
    """What a submit of an agent task writes: its model spec, its tools (the agent's, by their
    names in Charlie), its approve list mapped to those names, and the metadata naming the
    agent for its tool calls."""

    model: str
    tools: list[str]
    approve: list[str] | None
    metadata: dict[str, Any]


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
    names one that can be imported here; True when it did."""
    ref, dot, _ = name.rpartition(".")
    if not dot or ":" not in ref or name.startswith("mcp__"):
        return False
    try:
        from charlie.agents import pydantic_ai
    except ImportError:
        return False  # no framework here: no agent's tool either
    return pydantic_ai.register_agent_tools(ref, tools)


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
