"""What names a framework agent in a task (its model spec, its metadata, its submission),
with no framework imported: the executor's side of the adapter reads these, and the adapter
itself (:mod:`charlie.agents.pydantic_ai`) builds on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
