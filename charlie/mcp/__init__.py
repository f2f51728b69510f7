"""MCP tool servers, durably (issue 15): every tool of every configured server is a Charlie
tool, ``mcp__SERVER__TOOL``, recovered by the same rules as any other (I9, I10, I12, I13, I20,
I22-I25).

- :mod:`charlie.mcp.config`: ``CHARLIE_MCP_CONFIG`` / ``CHARLIE_MCP_SERVERS``, validated, and the
  secrets they hold kept out of everything shown;
- :mod:`charlie.mcp.connections`: one background event loop per process, one long-lived session
  per server, and what a failure means (not sent, lost in flight, refused);
- :mod:`charlie.mcp.tools`: names, effects, and one call (results, input_required as a question
  to a person, tasks as resumable waits by their id).

A worker discovers the servers' tools when it builds its runtime (``start``), each within a short
timeout; a server that is down then is tried again every ``CHARLIE_MCP_RETRY_SECONDS`` (and said
so once in the log), and its tools are registered when it answers. A producer discovers them
only to check an ``mcp__`` tool name it does not know (``discover``, with sessions it closes).

Layer: above charlie.tools (it imports the tool SDK, charlie.config and charlie.domain), below
the runtime; it never imports the engine (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from charlie.config import Settings
from charlie.mcp.config import McpConfig, McpConfigError, load
from charlie.mcp.connections import Connections, McpFailure, connections
from charlie.mcp.connections import reset_after_fork as _reset_connections
from charlie.mcp.tools import Servers, definition, register, server_of, tool_name
from charlie.tools.registry import ToolRegistry

__all__ = [
    "McpConfig",
    "McpConfigError",
    "Status",
    "config_of",
    "discover",
    "reset_after_fork",
    "server_of",
    "start",
    "status",
    "tool_name",
]

log = logging.getLogger("charlie.mcp")


def config_of(settings: Settings) -> McpConfig:
    """The MCP configuration of these settings (raises McpConfigError, naming the bad key)."""
    return load(settings.mcp_config, settings.mcp_servers)


@dataclass
class Status:
    """What discovery found of one server."""

    name: str
    described: str
    #: the Charlie names of its tools, once listed.
    tools: list[str] = field(default_factory=list)
    #: why it could not be listed (None: it was).
    problem: str | None = None


@dataclass
class _Process:
    """This process's MCP state: made again in a forked child."""

    pid: int
    servers: Servers
    status: dict[str, Status]
    retrying: threading.Thread | None = None
    #: servers whose being down was logged (once, until they come back).
    warned: set[str] = field(default_factory=set)


_process: _Process | None = None
_lock = threading.Lock()


def _servers(settings: Settings, config: McpConfig, *, private: bool = False) -> Servers:
    """The MCP tools' servers: this process's connections, or (``private``) connections of
    their own, for a one-off listing that closes them."""
    return Servers(
        config=config,
        connections=Connections(config, settings.mcp_timeout)
        if private
        else connections(config, settings.mcp_timeout),
        default_deadline=settings.tool_deadline,
    )


def _list(
    servers: Servers, registry: ToolRegistry, names: list[str], timeout: float | None = None
) -> dict[str, Status]:
    config = servers.config
    found = servers.connections.list_many(names, timeout)
    statuses = {}
    for name in names:
        server = config.server(name)
        assert server is not None
        status = Status(name, server.describe())
        listed = found[name]
        if isinstance(listed, McpFailure):
            status.problem = config.scrub(listed.reason)
        else:
            defs = [d for d in (definition(servers, server, t) for t in listed) if d is not None]
            status.tools = [d.name for d in register(registry, defs)]
        statuses[name] = status
    return statuses


def discover(
    settings: Settings, registry: ToolRegistry, *, keep: bool = False, timeout: float | None = None
) -> dict[str, Status]:
    """List every configured server's tools and register them. In a process that discovered
    already (a worker: ``start``), with its sessions; elsewhere (a producer, a command) with
    sessions of its own, ended after unless ``keep`` (the tools stay registered, and connect
    again if they are ever called here)."""
    config = config_of(settings)
    if not config.servers:
        return {}
    names = [s.name for s in config.servers]
    state = _process
    if state is not None and state.pid == os.getpid() and state.servers.config == config:
        return _list(state.servers, registry, names, timeout)
    servers = _servers(settings, config, private=not keep)
    try:
        return _list(servers, registry, names, timeout)
    finally:
        if not keep:
            servers.connections.close()


def start(settings: Settings, registry: ToolRegistry) -> dict[str, Status]:
    """A worker's discovery, once per process: list every server's tools (each within
    CHARLIE_MCP_TIMEOUT), register them, keep the sessions for the calls, and try a server that
    is down again every CHARLIE_MCP_RETRY_SECONDS until it answers."""
    global _process
    with _lock:
        if _process is not None and _process.pid == os.getpid():
            return _process.status
        config = config_of(settings)
        if not config.servers:
            return {}
        servers = _servers(settings, config)
        state = _process = _Process(os.getpid(), servers, {})
    state.status = _list(servers, registry, [s.name for s in config.servers])
    for status in state.status.values():
        _report(state, status, settings)
    if any(s.problem for s in state.status.values()):
        _retry_later(state, settings, registry)
    return state.status


def _report(state: _Process, status: Status, settings: Settings) -> None:
    extra = {"server": status.name}
    if status.problem is None:
        was_down = status.name in state.warned
        state.warned.discard(status.name)
        log.info(
            "MCP server %s %s: %d tools (%s)",
            status.name,
            "is back" if was_down else "ready",
            len(status.tools),
            status.described,
            extra=extra,
        )
    elif status.name not in state.warned:
        state.warned.add(status.name)
        log.warning(
            "MCP server %s is unavailable (%s): %s; its tools are not registered in this "
            "process yet, trying again every %gs",
            status.name,
            status.described,
            status.problem,
            settings.mcp_retry_seconds,
            extra=extra,
        )
    else:
        log.debug("MCP server %s still unavailable: %s", status.name, status.problem, extra=extra)


def _retry_later(state: _Process, settings: Settings, registry: ToolRegistry) -> None:
    stop = threading.Event()

    def retry() -> None:
        while not stop.wait(settings.mcp_retry_seconds):
            if state.pid != os.getpid() or _process is not state:
                return  # a forked child, or a process that started afresh
            down = [n for n, s in state.status.items() if s.problem]
            if not down:
                return
            for name, status in _list(state.servers, registry, down).items():
                state.status[name] = status
                _report(state, status, settings)

    state.retrying = threading.Thread(target=retry, name="charlie-mcp-retry", daemon=True)
    state.retrying.start()


def status() -> dict[str, Status]:
    """What this process's discovery found (empty before ``start``)."""
    state = _process
    return dict(state.status) if state is not None and state.pid == os.getpid() else {}


def current_connections() -> Connections | None:
    state = _process
    return state.servers.connections if state is not None and state.pid == os.getpid() else None


def reset_after_fork() -> None:
    """A forked child discovers (and connects) for itself: its parent's sessions and loop
    thread are not its own."""
    global _process
    _process = None
    _reset_connections()
