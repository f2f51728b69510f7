"""MCP tool servers, durably: every tool of every configured server is a Charlie
tool, ``mcp__SERVER__TOOL``, recovered by the same rules as any other (I9, I10, I12, I13, I20,
I22-I25).

- :mod:`charlie.mcp.config`: ``CHARLIE_MCP_CONFIG`` / ``CHARLIE_MCP_SERVERS``, validated, and the
  secrets they hold kept out of everything shown;
- :mod:`charlie.mcp.connections`: one background event loop per process, one long-lived session
  per server, and what a failure means (not sent, lost in flight, refused);
- :mod:`charlie.mcp.tools`: names, effects, and one call (results, input_required as a question
  to a person, tasks as resumable waits by their id).

A worker lists the servers' tools once, in its main process before its pool forks (Celery's
``worker_init``), each within a short timeout, and ends those sessions: every pool process
inherits the tools and connects on its first call. A server that is down then is listed again
by each pool process when it builds its runtime, and every ``CHARLIE_MCP_RETRY_SECONDS`` after
(said once in the log); its tools are registered when it answers. A producer lists them only to
check an ``mcp__`` tool name it does not know (``discover``, with sessions it closes).

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
from charlie.mcp.connections import McpFailure
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
    config = load(settings.mcp_config, settings.mcp_servers)
    _guard_logs(config)
    return config


class _Scrub(logging.Filter):
    """Blanks the configuration's secrets out of the MCP SDK's and its HTTP client's log
    records (a URL's query, an echoed header), message and traceback both."""

    def __init__(self) -> None:
        super().__init__()
        self.configs: dict[str, McpConfig] = {}

    def scrub(self, text: str) -> str:
        for config in self.configs.values():
            text = config.scrub(text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        scrubbed = self.scrub(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info:
            # formatted here, scrubbed, and the exception dropped, so no formatter shows it raw
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = self.scrub(text), None
        return True


_SCRUB = _Scrub()
#: the loggers of what talks to MCP servers (filters do not pass down to child loggers, so
#: each is given it; they exist once the SDK is imported, as it is here).
_GUARDED = ("mcp", "httpx2", "httpcore2", "httpx", "httpcore")


def _guard_logs(config: McpConfig) -> None:
    _SCRUB.configs[config.fingerprint()] = config
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in _GUARDED]
    for name in {*names, *_GUARDED}:
        logger = logging.getLogger(name)
        if _SCRUB not in logger.filters:
            logger.addFilter(_SCRUB)


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
    """This process's MCP state; a forked child inherits it (and the tools it registered) and
    makes its own from it."""

    pid: int
    servers: Servers
    status: dict[str, Status]
    retrying: threading.Thread | None = None
    #: servers whose being down was logged (once, until they come back).
    warned: set[str] = field(default_factory=set)


_process: _Process | None = None
_lock = threading.Lock()


def _servers(settings: Settings, config: McpConfig) -> Servers:
    return Servers(
        config=config,
        timeout=settings.mcp_timeout,
        default_deadline=settings.tool_deadline,
        max_message_bytes=settings.mcp_max_message_bytes,
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


def _mine(config: McpConfig) -> _Process | None:
    state = _process
    if state is None or state.pid != os.getpid():
        return None
    return state if state.servers.config.fingerprint() == config.fingerprint() else None


def discover(
    settings: Settings, registry: ToolRegistry, *, keep: bool = False, timeout: float | None = None
) -> dict[str, Status]:
    """List every configured server's tools and register them. In a worker (after ``start``)
    with its sessions; elsewhere (a producer, a command) with sessions ended after, unless
    ``keep`` (the tools stay registered, and connect again if they are ever called here)."""
    config = config_of(settings)
    if not config.servers:
        return {}
    names = [s.name for s in config.servers]
    state = _mine(config)
    servers = state.servers if state is not None else _servers(settings, config)
    try:
        return _list(servers, registry, names, timeout)
    finally:
        if not keep and state is None:
            servers.connections.close()


def start(settings: Settings, registry: ToolRegistry, *, keep: bool = True) -> dict[str, Status]:
    """A worker's discovery, once per process: list the servers' tools (each within
    CHARLIE_MCP_TIMEOUT) and register them; a forked child inherits what its parent listed and
    lists only the servers that were down then. ``keep``: keep the sessions for the calls and
    try a server that is down again every CHARLIE_MCP_RETRY_SECONDS until it answers; without
    (a prefork worker's main process, before its pool forks), end them, so no session or
    thread of it crosses a fork: each child connects on its first call."""
    global _process
    with _lock:
        config = config_of(settings)
        if not config.servers:
            return {}
        mine = _mine(config)
        if mine is not None:
            # (a solo pool: its main process listed before it ran tasks; now it keeps trying)
            if keep and mine.retrying is None and any(s.problem for s in mine.status.values()):
                _retry_later(mine, settings, registry)
            return mine.status
        inherited = _process
        if inherited is not None and inherited.servers.config.fingerprint() != config.fingerprint():
            inherited = None
        state = _process = _Process(os.getpid(), _servers(settings, config), {})
    names = [s.name for s in config.servers]
    if inherited is not None:
        state.status = dict(inherited.status)
        state.warned = set(inherited.warned)
    todo = [n for n in names if n not in state.status or state.status[n].problem]
    if todo:
        for name, status in _list(state.servers, registry, todo).items():
            state.status[name] = status
            _report(state, status, settings)
    if not keep:
        state.servers.connections.close()
    elif any(s.problem for s in state.status.values()):
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


def reset_after_fork() -> None:
    """A forked child connects for itself (its parent's sessions and loop thread are not its
    own); what its parent listed stays registered, and ``start`` there lists what was down."""
    _reset_connections()
