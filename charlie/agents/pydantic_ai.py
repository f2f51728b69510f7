"""A Pydantic AI agent driven by Charlie's phases.

Charlie's call_model phase asks :class:`AgentModel` for the next turn; its tools' calls are
recorded, claimed and settled as any tool's (I9-I11). What Pydantic AI itself decides (the
system prompts and instructions, static and given ``RunContext``; the tool and output
definitions its model is sent, prepare functions included; the model settings; how a tool's
arguments are validated, how its ``ModelRetry`` or return value becomes the part its model is
shown; whether an output is valid under the agent's output validators) is decided by Pydantic
AI's own graph, run up to the point where it would send a model request, and stopped there
(:class:`_Intercept`). No tool runs in that graph but the one call a Charlie tool call stands
for, in the worker that claimed it.

One event loop per process, in a thread of its own, runs the framework's coroutines: the
agent's model keeps its HTTP client across calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import threading
import types
import typing
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic_core
from pydantic_ai import Agent, DeferredToolResults
from pydantic_ai import messages as pm
from pydantic_ai.capabilities.abstract import AbstractCapability
from pydantic_ai.exceptions import (
    ModelAPIError,
    ModelHTTPError,
    UnexpectedModelBehavior,
    UsageLimitExceeded,
)
from pydantic_ai.models import Model as PaiModel
from pydantic_ai.models import ModelRequestParameters, infer_model
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.output import NativeOutput, PromptedOutput, TextOutput, ToolOutput
from pydantic_ai.toolsets import FunctionToolset
from pydantic_ai.usage import RunUsage, UsageLimits

from charlie.agents.spec import METADATA_KEY, AgentRefused, AgentSpec, Submission
from charlie.domain import JSON, Effect, ItemKind, NewItem, OnInterrupt
from charlie.models.base import (
    NO_DELTAS,
    Deltas,
    ModelError,
    ModelRequest,
    ModelResponse,
    TransientModelError,
    Usage,
    tool_call_item,
)
from charlie.tools.context import ToolContext, ToolError
from charlie.tools.registry import (
    REGISTRY,
    ToolDef,
    ToolDefinitionError,
    ToolRegistry,
    ToolUnavailable,
)

if TYPE_CHECKING:
    from charlie.agents.mcp import AgentMcp

T = TypeVar("T")
log = logging.getLogger("charlie.agents")

try:
    # the status texts Pydantic AI shows for an output call whose valid output was not used
    from pydantic_ai._tool_status import (
        OUTPUT_NOT_FINAL_RESULT,
        OUTPUT_SKIPPED_FINAL_ALREADY_PROCESSED,
        RETRY_WINS,
    )

    # the type Pydantic AI's ``Choices`` returns for a set whose values are actions to call
    from pydantic_ai.output import _ChoicesActions
except ImportError as exc:  # pragma: no cover - only with a Pydantic AI this was not made for
    raise ImportError(
        f"charlie.agents.pydantic_ai: this Pydantic AI lacks a private name Charlie uses ({exc}); "
        "install a release Charlie supports"
    ) from exc

#: what of Pydantic AI, beyond its public API, this adapter reads (docs/agents/pydantic-ai.md,
#: "What is kept"): the names of an agent's output tools, which no public API gives without a
#: run (and its deps); for the refusal of a ``Choices`` set with actions, _ChoicesActions; the
#: status texts of an output set aside by a function tool's retry (imported above)
PRIVATE_NAMES = (
    "Agent._output_toolset",
    "OutputToolset.processors",
    "output._ChoicesActions",
    "_tool_status.RETRY_WINS",
    "_tool_status.OUTPUT_SKIPPED_FINAL_ALREADY_PROCESSED",
    "_tool_status.OUTPUT_NOT_FINAL_RESULT",
)


def private_names_missing() -> list[str]:
    """The private names of Pydantic AI this adapter reads that this release lacks (or whose
    shape changed): empty when it is one this adapter was made for. Checked on an agent with a
    structured output, built for the check (a millisecond)."""
    from pydantic import BaseModel

    class _Probe(BaseModel):
        value: int

    probe = Agent(None, output_type=_Probe)
    toolset = getattr(probe, "_output_toolset", None)
    if toolset is None:
        return ["Agent._output_toolset"]
    processors = getattr(toolset, "processors", None)
    if not isinstance(processors, dict) or list(processors) != ["final_result"]:
        return ["OutputToolset.processors"]
    return []


# Checked once, at import: a release that renames one fails here, by name, not at a submit.
if private_names_missing():  # pragma: no cover - only with a Pydantic AI this was not made for
    raise ImportError(
        "charlie.agents.pydantic_ai: this Pydantic AI lacks what Charlie's adapter uses: "
        + ", ".join(private_names_missing())
    )

#: the capabilities every Agent holds by default; any other is refused at submit (a history
#: processor, a hook: code that runs around Pydantic AI's own steps, which Charlie does not
#: run, or runs without recording)
_DEFAULT_CAPABILITIES = frozenset({"ToolSearch", "PendingMessageDrainCapability"})
#: the name of the context parameter of an agent tool's handler (never a model argument)
_CTX = "_charlie_ctx"
#: the call Charlie records for a text answer the agent's output does not accept (the model
#: never calls it): its result is the feedback Pydantic AI sends, and the model answers again
TEXT_OUTPUT = "__text_output__"
#: the payload key of the run's usage so far as Pydantic AI counts it (requests, tokens, tool
#: calls), on the first item of each model answer of a task with usage limits: cumulative, so
#: the latest one in the transcript is the run's usage, after a crash, a fork or a compaction
USAGE_KEY = "pydantic_ai_usage"


# -- the event loop ----------------------------------------------------------------------------

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a framework coroutine on this process's agent loop and wait for it."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            # a forked pool child does not inherit the loop's thread: it starts its own
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="charlie-agents", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


# -- loading an agent --------------------------------------------------------------------------


def _import_ref(ref: str, what: str) -> Any:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AgentRefused(f"{what} {ref!r} must be 'module:attribute'")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # not there, or its import raised: either way, no agent
        raise AgentRefused(f"{what} {ref!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise AgentRefused(f"{what} {ref!r}: {module_name!r} has no {attr!r}") from None
    return found


@dataclass
class Loaded:
    """An agent as this process imported it, with its tools as Charlie registers them."""

    ref: str
    agent: Agent[Any, Any]
    model: PaiModel
    #: the agent's tool name -> Charlie's name (``module:attr.tool``)
    names: dict[str, str]
    output_tools: frozenset[str]
    defs: list[ToolDef] = field(default_factory=list)
    #: the agent's MCP servers as Charlie's client listed them, and its toolsets with them
    mcp: AgentMcp | None = None
    #: the model's names of the MCP servers' tools
    mcp_tools: frozenset[str] = frozenset()
    #: the first request's system prompt parts per run (execution id), as first computed here
    system_parts: dict[str, list[pm.ModelRequestPart]] = field(default_factory=dict)

    def charlie_name(self, name: str) -> str:
        return f"{self.ref}.{name}"

    def agent_name(self, name: str) -> str:
        prefix = f"{self.ref}."
        return name[len(prefix) :] if name.startswith(prefix) else name


_loaded: dict[str, Loaded] = {}
#: one lock per agent (its load in this process); _loaded_lock guards only this dict
_loading: dict[str, threading.Lock] = {}
_loaded_lock = threading.Lock()


def refusals(agent: Agent[Any, Any]) -> list[str]:
    """What of ``agent`` Charlie cannot run with its guarantees, one sentence each."""
    found: list[str] = []
    others = [t for t in agent.toolsets if not isinstance(t, FunctionToolset)]
    if others:
        # (imported only for an agent that holds a toolset beside its function tools)
        from charlie.agents import mcp

        found += mcp.refusals(others)
    for capability in getattr(agent.root_capability, "capabilities", []) or []:
        if type(capability).__name__ not in _DEFAULT_CAPABILITIES:
            found.append(
                f"capability {type(capability).__name__}: it runs around Pydantic AI's own "
                "steps (a history processor, a hook), which a Charlie task does not run"
            )
    if agent.event_stream_handler is not None:
        found.append(
            "event_stream_handler: a Charlie task streams to `charlie watch` instead; a handler "
            "would run again on every repeated step"
        )
    for name in _output_functions(agent.output_type):
        found.append(
            f"output function {name!r}: it would run while the output is validated, "
            "unrecorded; make it a tool (effect write) and the output a plain type"
        )
    return found


def _output_functions(spec: Any) -> list[str]:
    """The functions an output spec (``agent.output_type``) has Pydantic AI call while it
    validates an output: an output function (as a tool's, native, prompted or in a union), a
    ``TextOutput``'s, a ``Choices`` set's actions. A function is what Pydantic AI itself takes
    for one (``inspect.isfunction``/``ismethod``); anything else is a type it validates."""
    if isinstance(spec, TextOutput):
        return [_callable_name(spec.output_function)]
    if isinstance(spec, ToolOutput):
        return _output_functions(spec.output)
    if isinstance(spec, NativeOutput | PromptedOutput):
        return _output_functions(spec.outputs)
    if isinstance(spec, list | tuple):
        return [name for item in spec for name in _output_functions(item)]
    if typing.get_origin(spec) in (typing.Union, types.UnionType):
        return [name for item in typing.get_args(spec) for name in _output_functions(item)]
    if inspect.isfunction(spec) or inspect.ismethod(spec):
        return [_callable_name(spec)]
    if isinstance(spec, type) and issubclass(spec, _ChoicesActions):
        return [f"{spec.__name__} (a Choices set whose values are actions)"]
    return []


def _callable_name(function: Any) -> str:
    return str(getattr(function, "__name__", None) or repr(function))


def _tool_def(loaded: Loaded, tool: Any) -> ToolDef:
    """A Charlie tool for one of the agent's function tools: its effect and reconcile hook from
    its metadata (``{"effect": "read"}``; unmarked is a write), its approval from
    ``requires_approval``."""
    metadata = tool.metadata or {}
    name = loaded.charlie_name(tool.name)
    try:
        effect = Effect(metadata.get("effect", "write"))
    except ValueError:
        raise AgentRefused(
            f"tool {tool.name!r}: metadata effect must be 'read' or 'write', got "
            f"{metadata.get('effect')!r}"
        ) from None
    if effect is Effect.WAIT:
        raise AgentRefused(f"tool {tool.name!r}: effect 'wait' is for Charlie's own tools")
    reconcile = None
    if metadata.get("reconcile"):
        hook = _import_ref(str(metadata["reconcile"]), f"tool {tool.name!r}: reconcile")

        def reconcile(**arguments: Any) -> Any:
            arguments.pop(_CTX, None)
            return hook(**arguments)

    try:
        on_interrupt = OnInterrupt(metadata.get("on_interrupt", "report"))
    except ValueError:
        raise AgentRefused(
            f"tool {tool.name!r}: metadata on_interrupt must be 'report' or 'hold'"
        ) from None
    approval = bool(tool.requires_approval)

    def handler(**arguments: Any) -> Any:
        ctx = arguments.pop(_CTX)
        return call_tool(_current(loaded), tool.name, arguments, ctx, approved=approval)

    return ToolDef(
        name=name,
        handler=handler,
        description=(tool.description or tool.name).split("\n\n")[0],
        # Pydantic AI validates the arguments itself (a failure is a retry its model sees)
        parameters={"type": "object"},
        effect=effect,
        deadline=float(metadata["deadline"]) if metadata.get("deadline") else None,
        resumable=False,
        reconcile=reconcile,
        context_param=_CTX,
        implementation=f"{loaded.ref}:{tool.name}",
        approval=approval,
        on_interrupt=on_interrupt,
        source=f"agent:{loaded.ref}",
    )


def _output_def(loaded: Loaded, name: str) -> ToolDef:
    """The agent's output tool, run by Charlie only when its model's call of it did not
    validate (or came with other calls): a read, which validates again and says why."""

    def handler(**arguments: Any) -> Any:
        ctx = arguments.pop(_CTX)
        return call_tool(_current(loaded), name, arguments, ctx, approved=False)

    return ToolDef(
        name=loaded.charlie_name(name),
        handler=handler,
        description=f"the output of agent {loaded.ref}",
        parameters={"type": "object"},
        effect=Effect.READ,
        deadline=None,
        resumable=False,
        reconcile=None,
        context_param=_CTX,
        implementation=f"{loaded.ref}:{name}",
        source=f"agent:{loaded.ref}",
    )


def _mcp_handler(loaded: Loaded, name: str) -> Any:
    def handler(**arguments: Any) -> Any:
        ctx = arguments.pop(_CTX)
        return call_tool(_current(loaded), name, arguments, ctx, approved=False)

    return handler


def load(ref: str, *, partial: bool = False) -> Loaded:
    """The agent ``ref`` names, imported once per process, or AgentRefused; Unreachable when
    one of its MCP servers did not list its tools (not kept: listed again next time), unless
    ``partial``: then the agent as it is without that server's tools (its function tools
    run without it)."""
    found = _loaded.get(ref)  # (one dict read: a loaded agent is found taking no lock)
    if found is not None:
        return found
    with _loaded_lock:
        lock = _loading.setdefault(ref, threading.Lock())
    # One agent's load (its MCP servers listed, each up to its timeout, again at each step
    # while one does not answer) holds up only that agent's steps, never another's.
    with lock:
        found = _loaded.get(ref)
        if found is not None:
            return found
        loaded = _load(ref)
        if loaded.mcp is not None and loaded.mcp.unreachable:
            if partial:
                return loaded
            from charlie.agents.mcp import Unreachable

            raise Unreachable(loaded.mcp.unreachable[0])
        _loaded[ref] = loaded
        return loaded


def _current(loaded: Loaded) -> Loaded:
    """The agent as loaded whole in this process, once it is (a tool registered while one of
    its MCP servers did not answer runs with every server once they all have)."""
    return _loaded.get(loaded.ref, loaded)


def _load(ref: str) -> Loaded:
    """The agent ``ref`` names, imported and checked, its tools made (its MCP servers
    listed), or AgentRefused."""
    agent = _import_ref(ref, "agent")
    if not isinstance(agent, Agent):
        raise AgentRefused(f"agent {ref!r} is a {type(agent).__name__}, not a pydantic_ai.Agent")
    problems = refusals(agent)
    if problems:
        raise AgentRefused(f"agent {ref!r} cannot run as a Charlie task: " + "; ".join(problems))
    if agent.model is None:
        raise AgentRefused(f"agent {ref!r} has no model: give Agent(...) one")
    try:
        model = infer_model(agent.model)
    except Exception as exc:  # a provider without its key, an unknown model name, ...
        raise AgentRefused(f"agent {ref!r}: its model cannot be made here: {exc}") from exc
    tools: dict[str, Any] = {}
    for toolset in agent.toolsets:
        if isinstance(toolset, FunctionToolset):
            tools.update(toolset.tools)
    # (private, checked at import: no public API names the output tools without a run)
    output_toolset = agent._output_toolset
    outputs = frozenset(output_toolset.processors) if output_toolset is not None else frozenset()
    agent_mcp = None
    if any(not isinstance(t, FunctionToolset) for t in agent.toolsets):
        from charlie.agents import mcp

        # the agent's own toolsets (the first is its function toolset, kept as it is)
        agent_mcp = mcp.load(list(agent.toolsets)[1:], ref)
    mcp_names = (
        [leaf.model_name(t.name) for leaf in agent_mcp.leaves for t in leaf.tools]
        if agent_mcp is not None
        else []
    )
    taken = [*tools, *outputs, *mcp_names]
    clash = sorted({n for n in mcp_names if taken.count(n) > 1})
    if clash:
        raise AgentRefused(
            f"agent {ref!r}: MCP tool name(s) {', '.join(clash)} taken by another tool "
            "(prefix the server: MCPToolset(...).prefixed('name'))"
        )
    loaded = Loaded(
        ref=ref,
        agent=agent,
        model=model,
        names={n: f"{ref}.{n}" for n in [*tools, *mcp_names, *outputs, TEXT_OUTPUT]},
        output_tools=outputs | {TEXT_OUTPUT},
        mcp=agent_mcp,
        mcp_tools=frozenset(mcp_names),
    )
    loaded.defs = [_tool_def(loaded, t) for t in tools.values()] + [
        _output_def(loaded, n) for n in sorted(outputs | {TEXT_OUTPUT})
    ]
    if agent_mcp is not None:
        from charlie.agents import mcp

        loaded.defs += mcp.tool_defs(
            agent_mcp, ref, loaded.charlie_name, lambda name: _mcp_handler(loaded, name)
        )
    return loaded


def register_agent_tools(ref: str, tools: ToolRegistry, name: str | None = None) -> bool:
    """Register the agent's tools; its function tools even while one of its MCP servers does
    not list its tools (they do not depend on it). ToolUnavailable when ``name`` is none of
    them then: an MCP tool's call is not sent, and its result says which server did not
    answer (as a fleet's MCP server that is down, I36), never "not registered"."""
    try:
        loaded = load(ref, partial=True)
    except AgentRefused:
        return False
    _register(loaded, tools)
    unreachable = loaded.mcp.unreachable if loaded.mcp is not None else []
    if name is not None and unreachable and tools.get_registered(name) is None:
        raise ToolUnavailable(
            f"tool {name!r} was not found: {'; '.join(unreachable)}; the call was not sent"
        )
    return True


def _register(loaded: Loaded, tools: ToolRegistry) -> None:
    for definition in loaded.defs:
        if tools.get_registered(definition.name) is None:
            # another thread may have registered it meanwhile
            with contextlib.suppress(ToolDefinitionError):
                tools.add(definition)


def register_module_agents(module: Any, tools: ToolRegistry) -> None:
    for attr, value in list(vars(module).items()):
        if isinstance(value, Agent):
            ref = f"{module.__name__}:{attr}"
            try:
                loaded = load(ref, partial=True)
            except AgentRefused as exc:
                # not a task's agent (or not one Charlie can run): a submit naming it says why
                log.info("agent %s not registered: %s", ref, exc)
                continue
            _register(loaded, tools)


def model_spec_of(loaded: Loaded) -> str:
    """The agent's model as Charlie's specs name models (``openai:gpt-4.1``), so that prices,
    provider limits and context windows configured for it apply."""
    system = loaded.model.system
    name = loaded.model.model_name
    return f"{system}:{name}" if not name.startswith(f"{system}:") else name


def prepare_submission(
    agent: str,
    deps: str | None,
    approve: list[str] | None,
    metadata: dict[str, Any] | None,
    usage_limits: tuple[tuple[str, int], ...] = (),
) -> Submission:
    loaded = load(agent)
    _register(loaded, REGISTRY)
    if deps is not None:
        factory = _import_ref(deps, "deps factory")
        if not callable(factory):
            raise AgentRefused(f"deps factory {deps!r} is not callable")
    names = loaded.names
    mapped = None
    if approve is not None:
        unknown = [n for n in approve if n not in names and n not in names.values()]
        if unknown:
            raise AgentRefused(
                f"approve names tool(s) agent {agent!r} does not have: {', '.join(unknown)} "
                f"(its tools: {', '.join(sorted(names)) or 'none'})"
            )
        mapped = sorted({names.get(n, n) for n in approve})
    spec = AgentSpec(model_spec_of(loaded), agent, deps, usage_limits).render()
    return Submission(
        model=spec,
        tools=sorted(names.values()),
        approve=mapped,
        metadata={**(metadata or {}), METADATA_KEY: {"agent": agent, "deps": deps}},
    )


# -- running the agent's graph up to its next model request ------------------------------------


class _Captured(Exception):
    """Pydantic AI's graph reached a model request: what it would send, and how."""

    def __init__(
        self,
        messages: list[pm.ModelMessage],
        settings: Any,
        params: ModelRequestParameters,
    ) -> None:
        super().__init__("captured")
        self.messages = messages
        self.settings = settings
        self.params = params


class _Intercept(WrapperModel):
    """The agent's own model (its profile, its name, its request preparation) that stops the
    graph where it would send a request: Charlie sends it, from a call_model step."""

    async def request(
        self, messages: list[pm.ModelMessage], model_settings: Any, params: ModelRequestParameters
    ) -> pm.ModelResponse:
        raise _Captured(list(messages), model_settings, params)


class _Replay(_Intercept):
    """The agent's model answering its first request with a response it already gave (so that
    Pydantic AI's graph processes it as ``agent.run`` would: the output validated, or a retry
    asked for), and stopping the graph at the next."""

    def __init__(self, wrapped: PaiModel, answer: pm.ModelResponse) -> None:
        super().__init__(wrapped)
        self.answer: pm.ModelResponse | None = answer

    async def request(
        self, messages: list[pm.ModelMessage], model_settings: Any, params: ModelRequestParameters
    ) -> pm.ModelResponse:
        answer, self.answer = self.answer, None
        if answer is None:
            raise _Captured(list(messages), model_settings, params)
        return answer


@dataclass
class _Retries(AbstractCapability[Any]):
    """Pydantic AI's count of each tool's retries so far, as the transcript shows it, given to
    the run's tool manager: a tool's ``RunContext.retry`` is what ``agent.run`` would give it,
    and its retry past ``max_retries`` ends the run as there."""

    counts: dict[str, int] | None = None

    async def prepare_tools(self, ctx: Any, tool_defs: Any) -> Any:
        for name, count in (self.counts or {}).items():
            ctx.retries.setdefault(name, count)
        return tool_defs


@dataclass(frozen=True)
class _Ended:
    output: Any
    #: the run's messages at its end (the parts of the calls an ``early`` end did not run)
    messages: list[pm.ModelMessage] = field(default_factory=list)


async def _drive(
    loaded: Loaded,
    deps: Any,
    *,
    prompt: str | None = None,
    history: list[pm.ModelMessage] | None = None,
    deferred: DeferredToolResults | None = None,
    replay: pm.ModelResponse | None = None,
    retries: dict[str, int] | None = None,
    call: ToolContext | None = None,
    step: bool = False,
) -> _Captured | _Ended:
    """The agent's graph run from ``history`` up to its next model request (what it would
    send, captured), or to its end. ``call``: the step that runs the tool call ending
    ``history``; ``step``: the step after ``replay`` answered ``history``'s last request;
    either stopped at the request that follows, before it is assembled (its new parts as
    Pydantic AI keeps them in a run's messages, not as a model is sent them)."""
    intercept = _Intercept(loaded.model) if replay is None else _Replay(loaded.model, replay)
    with contextlib.ExitStack() as stack:
        if loaded.mcp is not None:
            # its MCP servers as Charlie lists and calls them (charlie.agents.mcp); this
            # coroutine's context only: another step's run on this loop is not touched
            from charlie.agents.mcp import CALL

            stack.enter_context(loaded.agent.override(toolsets=loaded.mcp.toolsets))
            CALL.set(call)
        if call is not None or step:
            return await _tool_step(loaded, deps, history, deferred, retries, intercept)
        try:
            result = await loaded.agent.run(
                prompt,
                message_history=history,
                model=intercept,
                deps=deps,
                deferred_tool_results=deferred,
                capabilities=[_Retries(retries)] if retries else None,
            )
        except _Captured as captured:
            return captured
    return _Ended(result.output, result.all_messages())


async def _tool_step(
    loaded: Loaded,
    deps: Any,
    history: list[pm.ModelMessage] | None,
    deferred: DeferredToolResults | None,
    retries: dict[str, int] | None,
    intercept: _Intercept,
) -> _Captured | _Ended:
    """The graph's step that runs the tool calls ending ``history`` (or that answers its last
    request, by ``intercept``'s replay), stopped at the request that carries their parts,
    before it is assembled (the call's part is all a Charlie call needs: the next request is
    a call_model step's to assemble, from the transcript)."""
    # a history that ends with a request: the graph's first request node is that one
    skip = 1 if history and isinstance(history[-1], pm.ModelRequest) else 0
    async with loaded.agent.iter(
        None,
        message_history=history,
        model=intercept,
        deps=deps,
        deferred_tool_results=deferred,
        capabilities=[_Retries(retries)] if retries else None,
    ) as running:
        async for node in running:
            if Agent.is_model_request_node(node):
                if skip:
                    skip -= 1
                    continue
                return _Captured([node.request], None, ModelRequestParameters())
        result = running.result
    if result is None:
        raise ModelError(f"agent {loaded.ref!r} ended without an output")
    return _Ended(result.output, result.all_messages())


def _deps(ref: str | None) -> Any:
    if not ref:
        return None
    made = _import_ref(ref, "deps factory")()
    if inspect.isawaitable(made):
        return run(_awaited(made))
    return made


async def _awaited(value: Any) -> Any:
    return await value


# -- the tool calls ----------------------------------------------------------------------------


def _part_json(part: pm.ModelRequestPart) -> JSON:
    dumped = pm.ModelMessagesTypeAdapter.dump_python([pm.ModelRequest(parts=[part])], mode="json")
    parts: JSON = dumped[0]["parts"][0]
    return parts


def _part_from(data: JSON) -> pm.ModelRequestPart:
    message = pm.ModelMessagesTypeAdapter.validate_python([{"kind": "request", "parts": [data]}])[0]
    assert isinstance(message, pm.ModelRequest)
    return message.parts[0]


def _is_retry(part: pm.ModelRequestPart) -> bool:
    if isinstance(part, pm.RetryPromptPart):
        return True
    return getattr(part, "outcome", None) == "retried"


def _text_of(part: Any) -> str:
    if isinstance(part, pm.RetryPromptPart | pm.RetryFeedbackPart):
        return part.model_response()
    content = getattr(part, "content", "")
    return (
        content
        if isinstance(content, str)
        else json.dumps(pydantic_core.to_jsonable_python(content))
    )


def call_tool(
    loaded: Loaded, name: str, arguments: JSON, ctx: ToolContext, *, approved: bool
) -> Any:
    """One call of the agent's tool ``name``, through Pydantic AI's own validation and call:
    its return value (the ``ok`` result), or a ToolError carrying the retry part its model is
    shown (a ``ModelRetry``, arguments that did not validate). An output tool's call returns
    ``{"output": ...}`` when the output validates."""
    info = ctx.metadata.get(METADATA_KEY) if isinstance(ctx.metadata, dict) else None
    deps_ref = info.get("deps") if isinstance(info, dict) else None
    deps = _deps(deps_ref)
    if name == TEXT_OUTPUT:
        return _check_text(loaded, deps, str(arguments.get("text", "")))
    call = pm.ToolCallPart(name, json.dumps(arguments), ctx.call_id)
    history: list[pm.ModelMessage] = [
        pm.ModelRequest(parts=[pm.UserPromptPart("")]),
        pm.ModelResponse(parts=[call]),
    ]
    retries: dict[str, int] = {}
    read_items = getattr(ctx.record, "items", None)
    if name not in loaded.output_tools and callable(read_items):
        # RunContext.messages and .retry as agent.run gives them, from the durable transcript
        history, retries = _so_far(
            loaded, deps, deps_ref, ctx.execution_id, read_items(ctx.execution_id), call
        )
    deferred = DeferredToolResults(approvals={ctx.call_id: True}) if approved else None
    try:
        found = run(
            _drive(
                loaded, deps, history=history, deferred=deferred, retries=retries or None, call=ctx
            )
        )
    except UnexpectedModelBehavior as exc:
        if "exceeded max retries" not in str(exc):
            raise
        # past its max_retries: the failure is recorded as one more retry, and the count then
        # ends the task before the next request (_retries_exceeded), as it ends agent.run
        count = retries.get(name, 0)
        part = pm.ToolReturnPart(
            name,
            str(exc),
            ctx.call_id,
            outcome="retried",
            retry=pm.RetryInfo("model_retry", attempt=count + 1, max_retries=count),
        )
        raise ToolError(str(exc), pydantic_ai_part=_part_json(part)) from None
    except Exception as exc:
        if name not in loaded.mcp_tools:
            raise
        from charlie.agents.mcp import escaped

        # Charlie's MCP call settles it: a park (an MCP task, a person's answer to give), an
        # interruption (I10), a lost lease, a call not sent: as for the fleet's MCP tools
        carried = escaped(exc)
        if carried is None:
            raise
        if carried.error is not None:
            raise carried.error from None
        return carried.value
    if isinstance(found, _Ended):
        if name in loaded.output_tools:
            return {"output": pydantic_core.to_jsonable_python(found.output)}
        # end_strategy="early": an output call of the same answer is valid, so Pydantic AI ran
        # no function tool of it; this call's result is the part it gave the call instead
        skipped = [
            p
            for m in found.messages
            if isinstance(m, pm.ModelRequest)
            for p in m.parts
            if getattr(p, "tool_call_id", None) == ctx.call_id
        ]
        if skipped:
            return pydantic_core.to_jsonable_python(getattr(skipped[-1], "content", None))
        raise ToolError(f"agent {loaded.ref!r} ended instead of running tool {name!r}")
    last = found.messages[-1]
    parts = [
        p for p in getattr(last, "parts", []) if getattr(p, "tool_call_id", None) == ctx.call_id
    ]
    if not parts:
        raise ToolError(f"agent {loaded.ref!r} gave no result for tool {name!r}")
    part = parts[0]
    if _is_retry(part):
        raise ToolError(_text_of(part), pydantic_ai_part=_part_json(part))
    return pydantic_core.to_jsonable_python(getattr(part, "content", None))


def _so_far(
    loaded: Loaded,
    deps: Any,
    deps_ref: Any,
    execution_id: str,
    items: list[Any],
    call: pm.ToolCallPart,
) -> tuple[list[pm.ModelMessage], dict[str, int]]:
    """The run's messages up to ``call`` (the answer that holds it ends them, with no other
    call of that answer, only this one runs here; but under ``end_strategy="early"`` with the
    answer's output calls, whose validity decides whether it runs) and each tool's retries so
    far."""
    at = next(
        (
            n
            for n, i in enumerate(items)
            if i.kind is ItemKind.TOOL_CALL and i.call_id == call.tool_call_id
        ),
        len(items),
    )
    before = items[:at]
    calls = [call]
    if loaded.agent.end_strategy == "early" and at < len(items):
        # the answer's output calls too, in the order the model emitted them: under "early" a
        # valid one ends the run and Pydantic AI runs none of the answer's function tools
        turn = items[at].turn
        calls = [
            pm.ToolCallPart(
                loaded.agent_name(str(i.payload.get("name"))),
                str(i.payload.get("raw_arguments") or "{}"),
                i.call_id,
            )
            if i.call_id != call.tool_call_id
            else call
            for i in items
            if i.kind is ItemKind.TOOL_CALL
            and i.turn == turn
            and (
                i.call_id == call.tool_call_id
                or loaded.agent_name(str(i.payload.get("name")))
                in loaded.output_tools - {TEXT_OUTPUT}
            )
        ]
    model = AgentModel(
        "", AgentSpec("", loaded.ref, deps_ref if isinstance(deps_ref, str) else None), loaded
    )
    history = model.history(before)
    if history and isinstance(history[-1], pm.ModelResponse):
        kept = [p for p in history[-1].parts if not isinstance(p, pm.ToolCallPart)]
        history[-1] = pm.ModelResponse(parts=[*kept, *calls])
    else:
        history.append(pm.ModelResponse(parts=calls))
    if not isinstance(history[0], pm.ModelRequest):
        history.insert(0, pm.ModelRequest(parts=[pm.UserPromptPart("")]))
    head = history[0]
    if isinstance(head, pm.ModelRequest) and before:
        prompt = next((str(p.content) for p in head.parts if isinstance(p, pm.UserPromptPart)), "")
        system = model._system_parts(deps, execution_id, prompt)
        history[0] = pm.ModelRequest(parts=[*system, *head.parts])
    counts, _ = _retry_counts(before)
    retries = {loaded.agent_name(n): c for n, c in counts.items() if c}
    return history, retries


def _check_text(loaded: Loaded, deps: Any, text: str) -> Any:
    """A text answer, validated as ``agent.run`` validates it: ``{"output": ...}``, or a
    ToolError carrying the feedback parts Pydantic AI sends the model instead, as a run keeps
    them (a RetryFeedbackPart, its ``retry`` saying the output's retry budget)."""
    found = run(
        _drive(
            loaded,
            deps,
            history=[pm.ModelRequest(parts=[pm.UserPromptPart("")])],
            replay=pm.ModelResponse(parts=[pm.TextPart(text)]),
            step=True,
        )
    )
    if isinstance(found, _Ended):
        return {"output": pydantic_core.to_jsonable_python(found.output)}
    parts = list(getattr(found.messages[-1], "parts", []))
    if not parts:
        raise ToolError(f"agent {loaded.ref!r} neither accepted the answer nor said why")
    raise ToolError(_text_of(parts[0]), pydantic_ai_parts=[_part_json(p) for p in parts])


# -- the model ---------------------------------------------------------------------------------


def _retries_exceeded(items: list[Any]) -> str | None:
    """Pydantic AI's count of a tool's retries, from the transcript: a tool failed (a retry
    part) in more consecutive steps than its ``max_retries`` ends the run, as it ends
    ``agent.run``."""
    return _retry_counts(items)[1]


def _feedback_limit(parts: Any) -> int | None:
    """The output-retry budget Pydantic AI checked a refused text's feedback against: its
    parts' ``retry.max_retries`` (RetryInfo; None for a retry not charged to a budget)."""
    for part in parts if isinstance(parts, list) else []:
        retry = part.get("retry") if isinstance(part, dict) else None
        if isinstance(retry, dict) and isinstance(retry.get("max_retries"), int):
            return int(retry["max_retries"])
    return None


def _retry_counts(items: list[Any]) -> tuple[dict[str, int], str | None]:
    """Each tool's consecutive failed steps (Charlie's names), and why the run ends if one
    failed more steps in a row than its ``max_retries`` (each limit as Pydantic AI gave it
    with the retry part it recorded: ``RetryInfo.max_retries``)."""
    counts: dict[str, int] = {}
    turns: dict[int, list[Any]] = {}
    for item in items:
        if item.kind is ItemKind.TOOL_RESULT:
            turns.setdefault(item.turn, []).append(item)
    for turn in sorted(turns):
        failed: dict[str, int | None] = {}
        succeeded: set[str] = set()
        for item in turns[turn]:
            result = item.payload.get("result")
            data = result.get("pydantic_ai_part") if isinstance(result, dict) else None
            name = str(item.payload.get("name"))
            if isinstance(data, dict):
                retry = data.get("retry") or {}
                failed[name] = retry.get("max_retries") if isinstance(retry, dict) else None
            elif isinstance(result, dict) and "pydantic_ai_parts" in result:
                # a text answer refused: the output's retries
                failed[name] = _feedback_limit(result["pydantic_ai_parts"])
            else:
                succeeded.add(name)
        for name in succeeded - set(failed):
            counts.pop(name, None)
        for name, limit in failed.items():
            counts[name] = counts.get(name, 0) + 1
            if limit is not None and counts[name] > limit:
                if name.endswith(TEXT_OUTPUT):
                    return counts, f"Exceeded maximum output retries ({limit})"
                return counts, f"Tool {name!r} exceeded max retries count of {limit}"
    return counts, None


def _run_usage(items: list[Any]) -> RunUsage:
    """The run's usage as Pydantic AI counts it, from the transcript's latest stamp."""
    for item in reversed(items):
        stamp = item.payload.get(USAGE_KEY) if isinstance(item.payload, dict) else None
        if isinstance(stamp, dict):
            return RunUsage(
                requests=int(stamp.get("requests", 0)),
                tool_calls=int(stamp.get("tool_calls", 0)),
                input_tokens=int(stamp.get("input_tokens", 0)),
                output_tokens=int(stamp.get("output_tokens", 0)),
            )
    return RunUsage()


def _limit_error(exc: UsageLimitExceeded) -> ModelError:
    return ModelError(f"UsageLimitExceeded: {exc}")


class AgentModel:
    """Charlie's model client for an agent's task (charlie.models.base.Model)."""

    def __init__(self, spec: str, parsed: AgentSpec, loaded: Loaded) -> None:
        self.spec = spec
        self.parsed = parsed
        self.loaded = loaded
        given: dict[str, Any] = dict(parsed.usage_limits)
        self.limits = UsageLimits(**given) if given else None

    # the transcript as Pydantic AI's messages

    def _outputs_by_turn(self, items: list[Any]) -> dict[int, tuple[list[Any], bool]]:
        """Per turn of tool results: its valid outputs (the output calls Charlie ran that
        validated) in the order the model emitted their calls, and whether a function tool's
        call of that turn asked for a retry (a ModelRetry, arguments that did not validate)."""
        emitted: dict[str, int] = {}
        turns: dict[int, tuple[list[tuple[int, Any]], list[bool]]] = {}
        for n, item in enumerate(items):
            if item.kind is ItemKind.TOOL_CALL and item.call_id:
                emitted[item.call_id] = n
            if item.kind is not ItemKind.TOOL_RESULT:
                continue
            outputs, retried = turns.setdefault(item.turn, ([], []))
            name = self.loaded.agent_name(str(item.payload.get("name")))
            result = item.payload.get("result")
            if name in self.loaded.output_tools:
                if (
                    item.payload.get("outcome") == "ok"
                    and isinstance(result, dict)
                    and "output" in result
                ):
                    outputs.append((emitted.get(item.call_id or "", n), item))
            elif isinstance(result, dict) and isinstance(result.get("pydantic_ai_part"), dict):
                retried.append(_is_retry(_part_from(result["pydantic_ai_part"])))
        return {
            turn: ([i for _, i in sorted(outputs, key=lambda o: o[0])], any(retried))
            for turn, (outputs, retried) in turns.items()
        }

    def _set_aside(self, items: list[Any]) -> dict[tuple[int, str], str]:
        """Pydantic AI's retry-wins, as ``agent.run`` applies it under ``end_strategy``
        "graceful" and "exhaustive": a valid output whose answer also held a function tool
        call that asked for a retry does not end the run; the model is shown, for each such
        output call, the status Pydantic AI shows instead of its output ((turn, call id) ->
        that status)."""
        strategy = self.loaded.agent.end_strategy
        if strategy == "early":
            return {}  # no function tool runs beside a valid output there
        later = (
            OUTPUT_SKIPPED_FINAL_ALREADY_PROCESSED
            if strategy == "graceful"
            else (OUTPUT_NOT_FINAL_RESULT)
        )
        found: dict[tuple[int, str], str] = {}
        for turn, (outputs, retried) in self._outputs_by_turn(items).items():
            if retried:
                for k, item in enumerate(outputs):
                    found[(turn, item.call_id or "")] = RETRY_WINS if k == 0 else later
        return found

    def _tool_parts(
        self, payload: JSON, call_id: str, set_aside: str | None = None
    ) -> list[pm.ModelRequestPart]:
        name = self.loaded.agent_name(str(payload.get("name")))
        if set_aside is not None:
            return [pm.ToolReturnPart(name, set_aside, call_id, tool_kind="output")]
        result = payload.get("result")
        if isinstance(result, dict) and isinstance(result.get("pydantic_ai_parts"), list):
            return [_part_from(p) for p in result["pydantic_ai_parts"]]
        if name == TEXT_OUTPUT:
            return []  # a refused text's feedback is above; anything else says nothing new
        return [self._tool_part(payload, call_id)]

    def _tool_part(self, payload: JSON, call_id: str) -> pm.ModelRequestPart:
        name = self.loaded.agent_name(str(payload.get("name")))
        result = payload.get("result")
        if isinstance(result, dict) and isinstance(result.get("pydantic_ai_part"), dict):
            return _part_from(result["pydantic_ai_part"])
        if payload.get("outcome") == "ok":
            content = (
                result.get("output", result)
                if name in self.loaded.output_tools and isinstance(result, dict)
                else result
            )
            return pm.ToolReturnPart(name, content, call_id)
        # interrupted, denied, past its deadline, canceled, raised: Charlie's words for it
        return pm.ToolReturnPart(name, str(payload.get("content", "")), call_id)

    def history(self, items: list[Any]) -> list[pm.ModelMessage]:
        set_aside = self._set_aside(items)
        messages: list[pm.ModelMessage] = []
        request: list[pm.ModelRequestPart] = []
        response: list[pm.ModelResponsePart] = []

        def flush_request() -> None:
            if request:
                messages.append(pm.ModelRequest(parts=list(request)))
                request.clear()

        def flush_response() -> None:
            if response:
                messages.append(pm.ModelResponse(parts=list(response)))
                response.clear()

        for item in items:
            payload = item.payload
            if item.kind is ItemKind.INPUT:
                if payload.get("role") == "user":
                    flush_response()
                    request.append(pm.UserPromptPart(str(payload.get("content", ""))))
            elif item.kind is ItemKind.COMPACTION:
                flush_response()
                request.append(pm.UserPromptPart(str(payload.get("content", ""))))
            elif item.kind in (ItemKind.MESSAGE, ItemKind.FINAL):
                flush_request()
                response.append(pm.TextPart(str(payload.get("content", ""))))
            elif item.kind is ItemKind.REASONING:
                flush_request()
                raw = payload.get("raw")
                response.append(
                    pm.ThinkingPart(**raw) if isinstance(raw, dict) else pm.ThinkingPart("")
                )
            elif item.kind is ItemKind.TOOL_CALL:
                flush_request()
                if self.loaded.agent_name(str(payload.get("name"))) == TEXT_OUTPUT:
                    continue  # Charlie's record of a refused text, not a call the model made
                response.append(
                    pm.ToolCallPart(
                        self.loaded.agent_name(str(payload.get("name"))),
                        str(payload.get("raw_arguments") or "{}"),
                        item.call_id,
                    )
                )
            elif item.kind is ItemKind.TOOL_RESULT:
                flush_response()
                call_id = item.call_id or ""
                request.extend(
                    self._tool_parts(payload, call_id, set_aside.get((item.turn, call_id)))
                )
        flush_request()
        flush_response()
        return messages

    def _system_parts(self, deps: Any, execution_id: str, prompt: str) -> list[pm.ModelRequestPart]:
        """The system prompts of the run's first request, as Pydantic AI builds them (static
        ones and those given RunContext), computed once per run in this process."""
        parts = self.loaded.system_parts.get(execution_id)
        if parts is None:
            first = run(_drive(self.loaded, deps, prompt=prompt))
            if not isinstance(first, _Captured):
                raise ModelError(f"agent {self.loaded.ref!r} ended before its first request")
            head = first.messages[0]
            assert isinstance(head, pm.ModelRequest)
            parts = [p for p in head.parts if isinstance(p, pm.SystemPromptPart)]
            if len(self.loaded.system_parts) > 256:
                self.loaded.system_parts.clear()
            self.loaded.system_parts[execution_id] = parts
        return parts

    def complete(self, request: ModelRequest) -> ModelResponse:
        stop = _retries_exceeded(request.items)
        if stop is not None:
            raise ModelError(stop)
        deps = _deps(self.parsed.deps)
        history = self.history(request.items)
        ended = self._ended_by_output(request.items)
        if ended is not None:
            return ended
        if not history or not isinstance(history[0], pm.ModelRequest):
            raise ModelError("an agent's transcript must start with its prompt")
        prompt = next(
            (str(p.content) for p in history[0].parts if isinstance(p, pm.UserPromptPart)), ""
        )
        system = self._system_parts(deps, request.execution_id, prompt)
        history[0] = pm.ModelRequest(parts=[*system, *history[0].parts])
        found = run(_drive(self.loaded, deps, history=history))
        if isinstance(found, _Ended):
            return self._final(found.output, Usage(), [])
        if self.limits is None:
            return self._answer(request, found, deps)
        used = _run_usage(request.items)
        try:  # before the request, as agent.run checks it
            self.limits.check_before_request(used)
        except UsageLimitExceeded as exc:
            raise _limit_error(exc) from None
        response = self._answer(request, found, deps)
        # After the answer, as agent.run checks them: its tokens, then its function tool calls
        # before any of them runs (none is planned past the limit).
        used.requests += 1
        used.input_tokens += response.usage.input_tokens
        used.output_tokens += response.usage.output_tokens
        functions = [
            i
            for i in response.output
            if i.kind is ItemKind.TOOL_CALL
            and self.loaded.agent_name(str(i.payload.get("name"))) not in self.loaded.output_tools
        ]
        try:
            self.limits.check_tokens(used)
            if functions:
                used.tool_calls += len(functions)
                self.limits.check_before_tool_call(used)
        except UsageLimitExceeded as exc:
            raise _limit_error(exc) from None
        stamp = {
            "requests": used.requests,
            "tool_calls": used.tool_calls,
            "input_tokens": used.input_tokens,
            "output_tokens": used.output_tokens,
        }
        if not response.output:
            return response
        first = response.output[0]
        stamped = NewItem(first.kind, {**first.payload, USAGE_KEY: stamp}, first.call_id)
        return ModelResponse(
            [stamped, *response.output[1:]], response.usage, response.finish_reason
        )

    def _answer(self, request: ModelRequest, found: _Captured, deps: Any) -> ModelResponse:
        """The agent's model asked what ``found`` holds: its answer as Charlie's items."""
        try:
            if request.deltas is NO_DELTAS:
                answer = run(
                    self.loaded.model.request(found.messages, found.settings, found.params)
                )
            else:
                answer = run(self._streamed(found, request.deltas))
        except ModelHTTPError as exc:
            if exc.status_code in (408, 409, 429) or exc.status_code >= 500:
                raise TransientModelError(str(exc), evidence=exc.body) from exc
            raise ModelError(str(exc), evidence=exc.body) from exc
        except ModelAPIError as exc:
            raise TransientModelError(str(exc)) from exc
        usage = _usage(answer)
        outputs, items = self._items(answer)
        calls = [p for p in answer.parts if isinstance(p, pm.ToolCallPart)]
        functions = [c for c in calls if c.tool_name not in self.loaded.output_tools]
        if functions:
            return ModelResponse(items, usage, answer.finish_reason)
        # Only text or output calls: does the output validate? Pydantic AI's graph says,
        # running no tool (only the output's validators).
        parts: list[pm.ModelResponsePart] = [
            p for p in answer.parts if not isinstance(p, pm.ToolCallPart)
        ]
        shown = pm.ModelResponse(parts=[*parts, *outputs])
        checked = run(_drive(self.loaded, deps, history=found.messages, replay=shown))
        if isinstance(checked, _Ended):
            kept = [i for i in items if i.kind is ItemKind.REASONING]
            return self._final(checked.output, usage, kept, answer.finish_reason)
        if outputs:
            return ModelResponse(items, usage, answer.finish_reason)
        # A text the output does not accept: recorded as a call of its own, whose result is
        # the feedback Pydantic AI sends, so that the model answers again (from any worker).
        text = "".join(p.content for p in answer.parts if isinstance(p, pm.TextPart))
        call = tool_call_item(
            f"text_output_{request.turn}", self.loaded.charlie_name(TEXT_OUTPUT), {"text": text}
        )
        return ModelResponse([*items, call], usage, answer.finish_reason)

    async def _streamed(self, found: _Captured, deltas: Deltas) -> pm.ModelResponse:
        """The request streamed, for people watching (``charlie watch``): its text, reasoning
        and tool arguments as they come. The answer is the whole response at its end, as
        without streaming; a delta lost says nothing about it (I28)."""
        ids: dict[int, str] = {}
        async with self.loaded.model.request_stream(
            found.messages, found.settings, found.params
        ) as stream:
            async for event in stream:
                if isinstance(event, pm.PartStartEvent):
                    part = event.part
                    if isinstance(part, pm.TextPart) and part.content:
                        deltas.text(part.content)
                    elif isinstance(part, pm.ThinkingPart) and part.content:
                        deltas.reasoning(part.content)
                    elif isinstance(part, pm.ToolCallPart):
                        ids[event.index] = part.tool_call_id
                        args = part.args if isinstance(part.args, str) else ""
                        name = self.loaded.charlie_name(part.tool_name)
                        deltas.tool_call(part.tool_call_id, name, args)
                elif isinstance(event, pm.PartDeltaEvent):
                    delta = event.delta
                    if isinstance(delta, pm.TextPartDelta):
                        deltas.text(delta.content_delta)
                    elif isinstance(delta, pm.ThinkingPartDelta) and delta.content_delta:
                        deltas.reasoning(delta.content_delta)
                    elif isinstance(delta, pm.ToolCallPartDelta) and isinstance(
                        delta.args_delta, str
                    ):
                        call_id = ids.get(event.index, delta.tool_call_id or "")
                        deltas.tool_call(call_id, None, delta.args_delta)
            return stream.get()

    def _ended_by_output(self, items: list[Any]) -> ModelResponse | None:
        """An output tool that Charlie ran and that validated ends the run with its output
        (the first the model emitted), without another model request; unless a function
        tool's call of the same answer asked for a retry, under "graceful" and "exhaustive"
        (retry-wins, as ``agent.run``: the model is asked again, shown the retry)."""
        results = [i for i in items if i.kind is ItemKind.TOOL_RESULT]
        if not results:
            return None
        outputs, retried = self._outputs_by_turn(items).get(results[-1].turn, ([], False))
        if not outputs or (retried and self.loaded.agent.end_strategy != "early"):
            return None
        return self._final(outputs[0].payload["result"]["output"], Usage(), [])

    def _items(self, answer: pm.ModelResponse) -> tuple[list[pm.ToolCallPart], list[NewItem]]:
        items: list[NewItem] = []
        outputs: list[pm.ToolCallPart] = []
        for n, part in enumerate(answer.parts):
            if isinstance(part, pm.TextPart):
                items.append(
                    NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": part.content})
                )
            elif isinstance(part, pm.ThinkingPart):
                raw = {
                    "content": part.content,
                    "id": part.id,
                    "signature": part.signature,
                    "provider_name": part.provider_name,
                }
                items.append(NewItem(ItemKind.REASONING, {"summary": part.content, "raw": raw}))
            elif isinstance(part, pm.ToolCallPart):
                call_id = part.tool_call_id or f"call_{n}"
                if part.tool_name in self.loaded.output_tools:
                    outputs.append(part)
                args: str | dict[str, Any] = (
                    part.args if isinstance(part.args, str) else dict(part.args or {})
                )
                items.append(
                    tool_call_item(call_id, self.loaded.charlie_name(part.tool_name), args)
                )
        return outputs, items

    def _final(
        self, output: Any, usage: Usage, kept: list[NewItem], finish: str | None = None
    ) -> ModelResponse:
        text = output if isinstance(output, str) else pydantic_core.to_json(output).decode()
        return ModelResponse(
            [*kept, NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text})],
            usage,
            finish,
        )


def _usage(answer: pm.ModelResponse) -> Usage:
    u = answer.usage
    details = getattr(u, "details", None) or {}
    return Usage(
        input_tokens=int(u.input_tokens or 0),
        output_tokens=int(u.output_tokens or 0),
        reasoning_tokens=int(details.get("reasoning_tokens", 0) or 0),
        cache_read_tokens=int(getattr(u, "cache_read_tokens", 0) or 0),
        cache_write_tokens=int(getattr(u, "cache_write_tokens", 0) or 0),
    )


def model_for(parsed: AgentSpec, tools: ToolRegistry) -> AgentModel:
    try:
        loaded = load(parsed.agent)
    except AgentRefused as exc:
        if type(exc).__name__ == "Unreachable":
            # its MCP server did not answer: the step is tried again, by Charlie's policy
            raise TransientModelError(str(exc)) from exc
        raise ModelError(str(exc)) from exc
    _register(loaded, tools)
    return AgentModel(parsed.render(), parsed, loaded)
