"""The tool registry: ``@charlie.tool`` turns a typed function into a tool the model can call.

The JSON Schema of a tool's arguments comes from its signature, so what the model is told and
what is validated before the handler runs are the same thing.
"""

from __future__ import annotations

import inspect
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, overload

import jsonschema

from charlie.domain import JSON, Effect, OnInterrupt
from charlie.models.base import ToolSpec
from charlie.tools.context import ToolContext

Handler = Callable[..., Any]
Reconcile = Callable[..., Any]


class ToolDefinitionError(TypeError):
    pass


@dataclass(frozen=True)
class ToolDef:
    name: str
    handler: Handler
    description: str
    parameters: JSON
    effect: Effect
    deadline: float | None
    #: I10: only waits that observe existing work may be dispatched again after a crash.
    resumable: bool
    #: I10: called instead of the handler for a call found started without a result; returns
    #: ``Reconciled(outcome, result)`` or ``None`` when it cannot tell.
    reconcile: Reconcile | None
    context_param: str | None
    #: which code this is, stable across processes ("module:qualname" of the handler): a call
    #: records the one it was started with, and only that one resumes or reconciles it
    #:, never another tool of the same name.
    implementation: str = ""
    #: every call waits for a person's approve (or deny) before it is dispatched (I23).
    approval: bool = False
    #: an interrupted call no reconcile hook could settle: reported to the model, or held for
    #: an operator's verdict (``charlie reconcile``).
    on_interrupt: OnInterrupt = OnInterrupt.REPORT
    #: a person answers the call (``ask_human``): no worker runs it, a reply settles it.
    answered_by_person: bool = False
    #: a read or write whose call may become a resumable wait once its outside work has an
    #: identity: its handler may return ``Pending(handle)`` (an MCP task) or ``AskPerson``
    #: (a question to a person), and the call parks. It is marked resumable by that park,
    #: never before: interrupted before it, it is an interrupted read or write (I10).
    parks: bool = False
    #: where the tool comes from, for `charlie tools`: "built-in", "user" (CHARLIE_TOOL_MODULES
    #: or this process's @charlie.tool) or "mcp:SERVER".
    source: str = ""
    #: called (like the handler, ``ctx.handle`` set) when Charlie cancels a call that has a
    #: handle on outside work (its task canceled or timed out, its run failed): asks the outside
    #: system to stop it (an MCP task's tasks/cancel). Best effort, after the call settled
    #: ``canceled``, which stays its outcome; an exception is logged.
    cancel: Handler | None = None
    #: its calls may run at the same time in one worker process, each in a thread of its own:
    #: a turn of several calls of such tools runs them in the worker that dispatched them
    #: (CHARLIE_LOCAL_CALLS) instead of one worker each through the broker
    threadsafe: bool = False
    #: the service of the deployment its implementation talks to ("devbox", "MCP server X"),
    #: or "" for a tool that runs in its process alone: a replay never runs such a tool, its
    #: recorded result stands in, a read's too (I35: the deployment is never touched).
    remote: str = ""

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def validate(self, arguments: JSON) -> str | None:
        """The first problem with ``arguments``, as a sentence for the model, or ``None``."""
        validator = jsonschema.Draft202012Validator(self.parameters)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not errors:
            return None
        first = errors[0]
        where = ".".join(str(p) for p in first.path) or "arguments"
        return f"invalid arguments for tool {self.name!r}: {where}: {first.message}"


def _schema_for(annotation: Any, owner: str, param: str) -> JSON:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(members) != len(get_args(annotation))
        if len(members) == 1:
            inner = _schema_for(members[0], owner, param)
            return {"anyOf": [inner, {"type": "null"}]} if nullable else inner
        schemas = [_schema_for(m, owner, param) for m in members]
        if nullable:
            schemas.append({"type": "null"})
        return {"anyOf": schemas}
    if origin is Literal:
        return {"enum": list(get_args(annotation))}
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        args = get_args(annotation)
        return {"type": "array", "items": _schema_for(args[0], owner, param) if args else {}}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in simple:
        return {"type": simple[annotation]}
    raise ToolDefinitionError(
        f"tool {owner!r}: parameter {param!r} has type {annotation!r}, which has no JSON Schema "
        "(use str, int, float, bool, list[...], dict, Literal[...] or X | None)"
    )


def build_tool(
    fn: Handler,
    *,
    name: str | None = None,
    effect: Effect | str = Effect.READ,
    deadline: float | None = None,
    resumable: bool = False,
    reconcile: Reconcile | None = None,
    description: str | None = None,
    approval: bool = False,
    on_interrupt: OnInterrupt | str = OnInterrupt.REPORT,
    answered_by_person: bool = False,
    parks: bool = False,
    threadsafe: bool = False,
    remote: str = "",
) -> ToolDef:
    tool_name = name or fn.__name__
    effect = Effect(effect)
    try:
        on_interrupt = OnInterrupt(on_interrupt)
    except ValueError:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: on_interrupt must be 'report' or 'hold', got {on_interrupt!r}"
        ) from None
    if resumable and effect is not Effect.WAIT:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: only effect='wait' tools may be resumable (I10): a resumable "
            "tool is dispatched again after a crash, which is safe only for observing work"
        )
    hints = typing.get_type_hints(fn)
    properties: dict[str, JSON] = {}
    required: list[str] = []
    context_param = None
    for pname, param in inspect.signature(fn).parameters.items():
        annotation = hints.get(pname, param.annotation)
        if annotation is ToolContext:
            context_param = pname
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {tool_name!r}: *args/**kwargs cannot be described")
        schema = _schema_for(annotation, tool_name, pname)
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        elif param.default is not None:
            schema = {**schema, "default": param.default}
        properties[pname] = schema
    parameters: JSON = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    doc = inspect.getdoc(fn) or ""
    return ToolDef(
        name=tool_name,
        handler=fn,
        description=description or doc.split("\n\n")[0].replace("\n", " ") or tool_name,
        parameters=parameters,
        effect=effect,
        deadline=deadline,
        resumable=resumable,
        reconcile=reconcile,
        context_param=context_param,
        implementation=f"{fn.__module__}:{fn.__qualname__}",
        approval=bool(approval),
        on_interrupt=on_interrupt,
        answered_by_person=answered_by_person,
        parks=bool(parks),
        source="built-in" if fn.__module__.startswith("charlie.") else "user",
        threadsafe=bool(threadsafe),
        remote=remote,
    )


class ToolUnavailable(Exception):
    """A finder knows the tool named but cannot make it here now (a framework agent's MCP
    server that did not list its tools): why, in words for the call's result; nothing of the
    call was sent."""


class ToolRegistry:
    """Tools by name. Like Celery's task registry, it is filled at import time, and by MCP
    discovery later, from another thread: a change replaces the whole mapping, so a reader
    iterating it never sees it change under it."""

    def __init__(self) -> None:
        #: writers take it (import time, MCP discovery, a finder in a tick's thread): each
        #: copies the mapping and puts a new one in place, and two at once would lose one
        self._writing = threading.Lock()
        self._tools: dict[str, ToolDef] = {}
        self._implementations: tuple[dict[str, ToolDef], tuple[tuple[str, str], ...]] | None = None
        #: asked, in order, for a name no tool is registered under: each may register tools
        #: found by that name (a framework agent's, imported when first named) and says
        #: whether it did
        self._finders: tuple[Callable[[ToolRegistry, str], bool], ...] = ()

    def add_finder(self, finder: Callable[[ToolRegistry, str], bool]) -> None:
        with self._writing:
            if finder not in self._finders:
                self._finders = (*self._finders, finder)

    def add(self, definition: ToolDef) -> ToolDef:
        with self._writing:
            existing = self._tools.get(definition.name)
            if existing is not None and existing.handler is not definition.handler:
                raise ToolDefinitionError(f"a tool named {definition.name!r} is already registered")
            self._tools = {**self._tools, definition.name: definition}
            self._implementations = None
        return definition

    def replace(self, definition: ToolDef) -> ToolDef:
        """Register ``definition`` in place of the tool of the same name, if there is one (the
        devbox's tools take the local ones' names, so the model sees one tool set)."""
        with self._writing:
            self._tools = {**self._tools, definition.name: definition}
            self._implementations = None
        return definition

    def implementations(self) -> tuple[tuple[str, str], ...]:
        """(name, implementation) of every tool, sorted: what a claim records and checks."""
        tools, cached = self._tools, self._implementations
        if cached is not None and cached[0] is tools:
            return cached[1]
        found = tuple(sorted((name, d.implementation) for name, d in tools.items()))
        # keyed by the mapping it was made from: a change meanwhile makes it stale, not wrong
        self._implementations = (tools, found)
        return found

    def get(self, name: str) -> ToolDef | None:
        return self._tools.get(name)

    def find(self, name: str) -> ToolDef | None:
        """The tool registered under ``name``, else one a finder registers by that name. Only
        for names Charlie recorded or a producer gave (a planned call's, a task's tools), never
        one a model chose: a finder may import the module a name names."""
        found = self._tools.get(name)
        # (a finder may raise ToolUnavailable: the tool is known, and why it is not here says
        # more than its absence)
        if found is None and self._finders:
            for finder in self._finders:
                if finder(self, name):
                    return self._tools.get(name)
        return found

    def _found(self, name: str) -> ToolDef | None:
        try:
            return self.find(name)
        except ToolUnavailable:
            return None

    def get_registered(self, name: str) -> ToolDef | None:
        """The tool registered under ``name`` now, asking no finder."""
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def enabled(self, allowed: list[str] | None) -> list[ToolDef]:
        tools = self._tools
        if allowed is None:
            return [tools[n] for n in sorted(tools)]
        if self._finders and any(n not in tools for n in allowed):
            found = [self._found(n) for n in allowed]
            return [d for d in found if d is not None]
        return [tools[n] for n in allowed if n in tools]


#: The process's registry: the built-ins plus whatever CHARLIE_TOOL_MODULES registers.
REGISTRY = ToolRegistry()


@overload
def tool(fn: Handler) -> Handler: ...
@overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    effect: Effect | str = Effect.READ,
    deadline: float | None = None,
    resumable: bool = False,
    reconcile: Reconcile | None = None,
    description: str | None = None,
    approval: bool = False,
    on_interrupt: OnInterrupt | str = OnInterrupt.REPORT,
    parks: bool = False,
    threadsafe: bool = False,
) -> Callable[[Handler], Handler]: ...
def tool(
    fn: Handler | None = None,
    *,
    name: str | None = None,
    effect: Effect | str = Effect.READ,
    deadline: float | None = None,
    resumable: bool = False,
    reconcile: Reconcile | None = None,
    description: str | None = None,
    approval: bool = False,
    on_interrupt: OnInterrupt | str = OnInterrupt.REPORT,
    parks: bool = False,
    threadsafe: bool = False,
) -> Handler | Callable[[Handler], Handler]:
    """Register a function as a tool.

    ``effect`` says what recovery may do with an interrupted call: ``read`` and ``write`` calls
    found started without a result settle as ``interrupted`` (I10) unless ``reconcile`` can tell
    what happened; ``wait`` tools declared ``resumable=True`` are dispatched again with the same
    call identity. ``deadline`` is in seconds (I13). A parameter annotated ``ToolContext``
    receives the call's context instead of a model argument.

    People in the loop: ``approval=True`` holds every call before dispatch until a person
    approves it (``charlie.approve``) or denies it (``charlie.deny``), I23.
    ``on_interrupt="hold"``: an interrupted call that no ``reconcile`` hook could settle is not
    reported to the model but held for an operator's verdict (``charlie.reconcile``).
    ``parks=True``: a read or write that may return ``Pending`` (its work got an identity
    outside) or ``AskPerson`` (a person must answer first); the call then parks and is resumed
    with its handle, or with the answer.
    ``threadsafe=True``: its calls may run at the same time in threads of one worker process; a
    turn whose calls are all of such tools (up to ``CHARLIE_LOCAL_CALLS``) runs them in the
    worker that dispatched them, in fewer commits and no trip through the broker.
    """

    def register(f: Handler) -> Handler:
        REGISTRY.add(
            build_tool(
                f,
                name=name,
                effect=effect,
                deadline=deadline,
                resumable=resumable,
                reconcile=reconcile,
                description=description,
                approval=approval,
                on_interrupt=on_interrupt,
                parks=parks,
                threadsafe=threadsafe,
            )
        )
        return f

    return register(fn) if fn is not None else register
