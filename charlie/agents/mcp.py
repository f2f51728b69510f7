"""An agent's MCP servers (``pydantic_ai.mcp.MCPToolset``, prefixed or not) as Charlie's MCP
calls.

Each server the agent holds is listed once per process by Charlie's own MCP client
(charlie.mcp.connections: the official SDK, one session per server and process), and each of
its tools becomes a Charlie tool of the agent (``module:agent.TOOL``, ``TOOL`` with the
toolset's prefix as the model sees it). A tool's effect is decided as for the fleet's MCP
servers (charlie.mcp.tools.effect_of): a ``read`` when its ``readOnlyHint`` says so, else a
``write``. A call is recorded, claimed and settled as any of the agent's calls (I9-I11), and
sent through Charlie's MCP call (charlie.mcp.tools.McpCall): a call found started without a
result after a crash settles ``interrupted`` and the model is told, never sent again (I10); an
MCP task is followed by its id, a server's question goes to a person.

What Pydantic AI decides stays its own: the tool definitions the model is shown come from the
agent's own ``MCPToolset.get_tools`` (visibility, metadata, return schema, retries), given the
tools Charlie listed instead of a session of its own; a result is mapped for the model, and an
``isError`` result becomes a retry (or a failure), by Pydantic AI's own functions, per the
toolset's ``tool_error_behavior``. Pydantic AI's MCP client is never connected.

What of a toolset cannot be made durable is refused at submit, named (``refusals``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import re
from dataclasses import dataclass, field, replace
from typing import Any

import mcp_types
from fastmcp.client.client import CallToolResult
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset
from pydantic_ai.toolsets.prefixed import PrefixedToolset

from charlie.agents.spec import AgentRefused
from charlie.config import settings
from charlie.mcp.config import McpConfig, ServerConfig
from charlie.mcp.connections import McpFailure
from charlie.mcp.tools import McpCall, Servers, definition, effect_of
from charlie.tools.context import AskPerson, Pending, ToolContext
from charlie.tools.registry import ToolDef

try:  # Pydantic AI's own mapping of an ``isError`` result (private: a release may rename it)
    from pydantic_ai.mcp import _raise_mcp_tool_error, _tool_error_result_message
except ImportError as exc:  # pragma: no cover - only with a Pydantic AI this was not made for
    raise ImportError(
        f"charlie.agents.mcp: this Pydantic AI lacks a private function Charlie uses ({exc}); "
        "install a release Charlie supports"
    ) from exc

#: what of MCPToolset, beyond its public API, this adapter reads or overrides: its
#: settings (instance attributes, checked by tests/unit), and on the class these
PRIVATE_CLASS_NAMES = ("_call_tool_checked", "_enter_lock", "call_tool")
PRIVATE_INSTANCE_NAMES = ("_client_options", "_client_source", "_auth_func", "_headers_func")
#: the parameters of the method the stand-in overrides, as the stand-in takes them
_CHECKED_PARAMETERS = ["self", "name", "args", "metadata", "use_task"]


def private_names_missing() -> list[str]:
    """The names of Pydantic AI's MCPToolset this adapter depends on that this release lacks
    (or whose shape changed): empty when it is one this adapter was made for."""
    missing = [n for n in PRIVATE_CLASS_NAMES if not hasattr(MCPToolset, n)]
    checked = getattr(MCPToolset, "_call_tool_checked", None)
    if checked is not None and list(inspect.signature(checked).parameters) != _CHECKED_PARAMETERS:
        missing.append("_call_tool_checked(self, name, args, *, metadata, use_task)")
    return missing


# Checked once, at import: a release that renames one fails here, by name, not at a call
# (where the stand-in's override would be silently skipped, and its guard with it).
if private_names_missing():  # pragma: no cover - only with a Pydantic AI this was not made for
    raise ImportError(
        "charlie.agents.mcp: this Pydantic AI's MCPToolset lacks what Charlie's adapter uses: "
        + ", ".join(private_names_missing())
    )

#: the Charlie call an MCP tool of the agent runs for, set around the graph that runs it
CALL: contextvars.ContextVar[ToolContext | None] = contextvars.ContextVar(
    "charlie_agent_mcp_call", default=None
)


class Escaped(Exception):
    """What Charlie's MCP call gave that is not a tool result Pydantic AI maps (a park on an
    MCP task or a person's answer; an interruption, a lost lease, a call not sent), carried
    out of the agent's graph to the Charlie call, as it is."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        super().__init__("the MCP call settles in Charlie")
        self.value = value
        self.error = error


def _no_hooks(toolset: MCPToolset[Any]) -> list[str]:
    """What of one MCPToolset would run code of the agent's, or talk to its server, beside
    the call Charlie records."""
    found = []
    options: dict[str, Any] = dict(toolset._client_options or {})
    for key, why in (
        ("sampling_handler", "the server would ask the agent's model, unrecorded"),
        ("elicitation_handler", "a server's question goes to a person (`charlie reply`)"),
        ("log_handler", "it would run in a worker's session, outside any call"),
        ("progress_handler", "it would run in a worker's session, outside any call"),
        ("message_handler", "it would run in a worker's session, outside any call"),
        ("roots", "Charlie offers a server no roots"),
        ("http_client", "Charlie's client makes its own HTTP client"),
        ("verify", "Charlie's client verifies TLS as httpx does by default"),
    ):
        if options.get(key) is not None:
            found.append(f"{key}: {why}")
    if toolset._client_source is None:
        found.append("a pre-built fastmcp Client: pass the server's URL or command instead")
    if toolset.sampling_model is not None:
        found.append("sampling_model: the server would ask that model, unrecorded")
    if toolset.process_tool_call is not None:
        found.append("process_tool_call: it would run around the call, unrecorded")
    if toolset._auth_func is not None or toolset._headers_func is not None:
        found.append("auth or headers given as a function of the run: not made per run here")
    if toolset.include_instructions:
        found.append("include_instructions: the server's instructions are not read here")
    if toolset.tool_error_behavior == "error":
        found.append("tool_error_behavior='error': it would end the run from inside a call")
    return found


def server_config(toolset: MCPToolset[Any], name: str) -> tuple[ServerConfig | None, list[str]]:
    """The server of ``toolset`` as Charlie's MCP client connects to it, or why it cannot."""
    from fastmcp.client.transports import (
        SSETransport,
        StdioTransport,
        StreamableHttpTransport,
    )

    problems = _no_hooks(toolset)
    transport = getattr(toolset.client, "transport", None)
    config: ServerConfig | None = None
    if isinstance(transport, StdioTransport):
        if getattr(transport, "log_file", None) is not None:
            problems.append("a stdio server's log_file: Charlie keeps its stderr in the log")
        config = ServerConfig(
            name=name,
            transport="stdio",
            command=transport.command,
            args=tuple(transport.args),
            env=dict(transport.env or {}),
            cwd=str(transport.cwd) if transport.cwd else None,
            timeout=_timeout(toolset),
        )
    elif isinstance(transport, StreamableHttpTransport | SSETransport):
        if transport.auth is not None:
            problems.append("auth: give the credential as headers={'Authorization': 'Bearer ...'}")
        if transport.httpx_client_factory is not None or transport.verify is not None:
            problems.append("an HTTP client of its own (httpx_client_factory, verify)")
        config = ServerConfig(
            name=name,
            transport="sse" if isinstance(transport, SSETransport) else "http",
            url=transport.url,
            headers=dict(transport.headers or {}),
            timeout=_timeout(toolset),
        )
    else:
        problems.append(
            f"the transport {type(transport).__name__}: Charlie's MCP client speaks stdio, "
            "streamable HTTP and SSE (an in-process server is not an MCP server a worker reaches)"
        )
    return (config if not problems else None), problems


def _timeout(toolset: MCPToolset[Any]) -> float | None:
    options: dict[str, Any] = dict(toolset._client_options or {})
    value = options.get("init_timeout")
    return float(value) if isinstance(value, int | float) else None


_SAFE = re.compile(r"[^A-Za-z0-9-]+")


def _server_name(toolset: MCPToolset[Any], n: int) -> str:
    # its id as given, else its URL's hostname (a stdio server's may be none)
    label = _SAFE.sub("-", toolset.id or "").strip("-")[:16]
    return f"{label}-{n}" if label else f"agent-mcp-{n}"


@dataclass
class Leaf:
    """One MCP server of the agent: its toolset, where it sits, its tools as listed."""

    toolset: MCPToolset[Any]
    server: ServerConfig
    #: the prefixes around it, outermost first (PrefixedToolset): the model's name for a tool
    #: is ``p1_p2_tool``
    prefixes: tuple[str, ...]
    tools: list[mcp_types.Tool]

    def model_name(self, tool: str) -> str:
        for prefix in reversed(self.prefixes):
            tool = f"{prefix}_{tool}"
        return tool


def _leaves(
    toolset: AbstractToolset[Any], prefixes: tuple[str, ...] = ()
) -> tuple[list[tuple[MCPToolset[Any], tuple[str, ...]]], list[str]]:
    if isinstance(toolset, MCPToolset):
        return [(toolset, prefixes)], []
    if isinstance(toolset, PrefixedToolset):
        return _leaves(toolset.wrapped, (*prefixes, toolset.prefix))
    label = getattr(toolset, "label", None) or type(toolset).__name__
    return [], [
        f"toolset {label}: only function tools and MCP servers (MCPToolset, prefixed or not) "
        "are recorded before they run"
    ]


def refusals(toolsets: list[AbstractToolset[Any]]) -> list[str]:
    """What of the agent's toolsets (beside its function tools) cannot be made durable."""
    found: list[str] = []
    n = 0
    for toolset in toolsets:
        if isinstance(toolset, FunctionToolset):
            continue
        leaves, problems = _leaves(toolset)
        found += problems
        for leaf, _ in leaves:
            n += 1
            _, why = server_config(leaf, _server_name(leaf, n))
            found += [f"MCP server {leaf.label}: {w}" for w in why]
    return found


@dataclass
class AgentMcp:
    """The agent's MCP servers in this process: their tools, and the toolsets its graph runs
    with in place of its own (Pydantic AI's tool definitions, Charlie's calls)."""

    servers: Servers
    leaves: list[Leaf]
    #: the agent's user toolsets with each MCPToolset replaced by its Charlie stand-in
    toolsets: list[AbstractToolset[Any]]
    #: why each server that did not answer its listing is held with no tools (the agent
    #: cannot take a step while one is: its model would not be shown them)
    unreachable: list[str] = field(default_factory=list)


def load(toolsets: list[AbstractToolset[Any]], ref: str) -> AgentMcp | None:
    """List the agent's MCP servers' tools with Charlie's client (each within its timeout), or
    AgentRefused naming a server that cannot be made durable. A server that did not answer
    is held with no tools, and said so (``unreachable``). None: the agent holds none."""
    found: list[tuple[MCPToolset[Any], ServerConfig, tuple[str, ...]]] = []
    for toolset in toolsets:
        held, _ = _leaves(toolset)
        for leaf, prefixes in held:
            config, problems = server_config(leaf, _server_name(leaf, len(found) + 1))
            if config is None:
                raise AgentRefused(f"agent {ref!r}: MCP server {leaf.label}: {problems[0]}")
            found.append((leaf, config, prefixes))
    if not found:
        return None
    s = settings()
    mcp_config = McpConfig(servers=tuple(c for _, c, _ in found), sources=(f"agent {ref}",))
    servers = Servers(mcp_config, s.mcp_timeout, s.tool_deadline, s.mcp_max_message_bytes)
    try:
        listed = servers.connections.list_many([c.name for _, c, _ in found])
    finally:
        # Sessions are made again at the first call, in the process that makes it (a worker's
        # main process lists before its pool forks; no session of it crosses the fork).
        servers.connections.close()
    leaves: list[Leaf] = []
    unreachable: list[str] = []
    for toolset, server, prefixes in found:
        tools = listed[server.name]
        if isinstance(tools, McpFailure):
            unreachable.append(
                f"agent {ref!r}: its MCP server {toolset.label} ({server.describe()}) did not "
                f"list its tools: {mcp_config.scrub(tools.reason)}"
            )
            tools = []
        leaves.append(Leaf(toolset, server, prefixes, tools))
    stand_ins = {id(leaf.toolset): _stand_in(leaf, servers) for leaf in leaves}
    replaced = [t.visit_and_replace(lambda leaf: stand_ins.get(id(leaf), leaf)) for t in toolsets]
    return AgentMcp(servers, leaves, replaced, unreachable)


class Unreachable(AgentRefused):
    """An MCP server of the agent did not answer its listing: the agent cannot run here now
    (a worker tries again at its next step)."""


class _StandIn(MCPToolset[Any]):
    """The agent's MCPToolset, its settings as given, whose tools are those Charlie listed and
    whose calls are Charlie's MCP calls; it never connects a session of Pydantic AI's."""

    _charlie_tools: list[mcp_types.Tool]
    _charlie_servers: Servers
    _charlie_server: ServerConfig

    async def __aenter__(self) -> _StandIn:
        return self

    async def __aexit__(self, *args: Any) -> bool | None:
        return None

    async def list_tools(self) -> list[mcp_types.Tool]:
        return list(self._charlie_tools)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        # guarded here too, so that a path around _call_tool_checked (a release that calls the
        # server another way) cannot skip the guard: nothing is sent outside a Charlie call
        if CALL.get() is None:
            raise RuntimeError(f"MCP tool {name!r} called outside a Charlie call")
        return await super().call_tool(name, tool_args, ctx, tool)

    async def call_tool_for_app(
        self, name: str, arguments: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        raise RuntimeError(f"MCP tool {name!r}: an app's call is not a Charlie call")

    async def _call_tool_checked(
        self, name: str, args: dict[str, Any], *, metadata: dict[str, Any] | None, use_task: bool
    ) -> CallToolResult:
        ctx = CALL.get()
        if ctx is None:
            # only a Charlie call runs a tool of the agent (the graph stops before any other)
            raise RuntimeError(f"MCP tool {name!r} called outside a Charlie call")
        tool = next((t for t in self._charlie_tools if t.name == name), None)
        if tool is None:
            raise RuntimeError(f"MCP server {self._charlie_server.name} lists no tool {name!r}")
        effect = effect_of(self._charlie_server, tool)
        servers = self._charlie_servers
        call = _RawCall(servers, self._charlie_server.name, name, effect,
                        servers.default_deadline, dict(args), ctx)  # fmt: skip
        try:
            # (Charlie's call blocks while the server works: off the agents' event loop)
            outcome = await asyncio.to_thread(call.run)
        except Exception as exc:  # ToolError, Interrupted, LeaseLost: Charlie's to settle
            raise Escaped(error=exc) from None
        if isinstance(outcome, Pending | AskPerson):
            raise Escaped(value=outcome)
        assert isinstance(outcome, mcp_types.CallToolResult)
        # the server's result in the shape Pydantic AI's own client hands it (fastmcp's)
        result = CallToolResult(
            content=list(outcome.content),
            structured_content=outcome.structured_content,
            meta=outcome.meta,
            is_error=bool(outcome.is_error),
        )
        if result.is_error:
            _raise_mcp_tool_error(
                _tool_error_result_message(name, result), self.tool_error_behavior
            )
        return result


class _RawCall(McpCall):
    """Charlie's MCP call, giving back the server's result as it came (secrets scrubbed), for
    Pydantic AI to map."""

    def _result(self, result: mcp_types.CallToolResult) -> Any:
        # each string scrubbed as it is, not the JSON text: there a secret holding a quote, a
        # backslash or a control or non-ASCII character is escaped, and would not be found
        raw = result.model_dump(by_alias=True, mode="json")
        return mcp_types.CallToolResult.model_validate(self.servers.config.scrub_value(raw))


def _stand_in(leaf: Leaf, servers: Servers) -> _StandIn:
    stand_in = _StandIn.__new__(_StandIn)
    vars(stand_in).update(vars(leaf.toolset))
    vars(stand_in).pop("_enter_lock", None)
    stand_in._charlie_tools = leaf.tools
    stand_in._charlie_servers = servers
    stand_in._charlie_server = leaf.server
    return stand_in


def tool_defs(mcp: AgentMcp, ref: str, charlie_name: Any, handler_for: Any) -> list[ToolDef]:
    """The Charlie tools of the agent's MCP servers: each tool's effect from its annotations
    (effect_of), its call through the agent's graph (``handler_for(model_name)``)."""
    defs = []
    for leaf in mcp.leaves:
        for tool in leaf.tools:
            base = definition(mcp.servers, leaf.server, tool)
            if base is None:
                continue  # a schema that is not JSON Schema: Charlie's MCP client skips it too
            model_name = leaf.model_name(tool.name)
            defs.append(
                replace(
                    base,
                    name=charlie_name(model_name),
                    handler=handler_for(model_name),
                    # Pydantic AI passes the arguments on as the server's own client does
                    parameters={"type": "object"},
                    implementation=f"{ref}:{model_name}",
                    source=f"agent:{ref}",
                    threadsafe=False,
                )
            )
    return defs


def escaped(exc: BaseException) -> Escaped | None:
    """The Escaped in what the agent's graph raised (as it is, or in a group)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Escaped):
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None
