"""The MCP servers a deployment uses, in the shape MCP clients already read.

``CHARLIE_MCP_CONFIG`` names a JSON file, ``CHARLIE_MCP_SERVERS`` holds the same object inline
(both may be set; a server name may appear in only one)::

    {"mcpServers": {
        "files":  {"command": "npx", "args": ["-y", "@acme/files-mcp"], "env": {"TOKEN": "..."}},
        "search": {"url": "https://search.example/mcp", "headers": {"Authorization": "Bearer ..."}}
    }}

Besides the keys every MCP client knows (``command``, ``args``, ``env``, ``cwd``, ``url``,
``headers``, ``type``, ``disabled``), a server may carry Charlie's recovery settings, which the
operator decides rather than the server: ``effect`` ("read" | "write"),
``approval``, ``on_interrupt`` ("report" | "hold") and ``deadline`` for all its tools,
``ignore_hints`` (do not trust its ``readOnlyHint``s), ``tools`` (the same four keys per tool
name) and ``timeout`` (seconds to connect and list its tools). Other keys (another client's)
are ignored; a Charlie key with a wrong value is an error naming it.

The values of ``env`` and ``headers`` are secrets: no string this module produces for people
(``describe``, errors) contains them, and :meth:`McpConfig.scrub` blanks them, and any
credentials a URL carries, out of any text that leaves charlie.mcp.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from charlie.domain import Effect, OnInterrupt

#: a server's name: it becomes part of every tool name (``mcp__NAME__TOOL``), so letters,
#: digits, ``-`` and single ``_`` only (``__`` separates the parts), and short enough to leave
#: room for the tool's name in a model's 64-character limit.
SERVER_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_))*$")
MAX_SERVER_NAME = 24

#: the recovery settings a server, or one of its tools, may set.
OVERRIDE_KEYS = ("effect", "approval", "on_interrupt", "deadline")
#: the keys of a server Charlie reads (others are another client's, and ignored).
STDIO_KEYS = ("command", "args", "env", "cwd")
HTTP_KEYS = ("url", "headers")
TRANSPORT_TYPES = {
    "stdio": "stdio",
    "http": "http",
    "streamable-http": "http",
    "streamable_http": "http",
    "streamableHttp": "http",
}

MASK = "***"
#: a value shorter than this is not scrubbed out of text (it would blank ordinary words); a
#: credential that short is no credential.
MIN_SECRET = 4
#: env values scrubbed out of text whatever their length (above MIN_SECRET): those of names
#: that say they are secret. Other env values (a log level, a region) are scrubbed only from
#: LONG_VALUE characters on, where they may well be a key; every header value is scrubbed.
SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASS|AUTH|CRED|PRIVATE|SESSION|COOKIE|PWD", re.I)
LONG_VALUE = 12


class McpConfigError(ValueError):
    """The MCP configuration is unusable; the message names the key and never a secret."""


@dataclass(frozen=True)
class Override:
    """The operator's recovery settings for a server's tools, or for one tool; None: not set."""

    effect: Effect | None = None
    approval: bool | None = None
    on_interrupt: OnInterrupt | None = None
    deadline: float | None = None

    def over(self, base: Override) -> Override:
        """These settings, with ``base``'s where these set none."""
        return Override(
            effect=self.effect if self.effect is not None else base.effect,
            approval=self.approval if self.approval is not None else base.approval,
            on_interrupt=self.on_interrupt if self.on_interrupt is not None else base.on_interrupt,
            deadline=self.deadline if self.deadline is not None else base.deadline,
        )


@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: str  # "stdio" | "http" | "sse" (an agent's server only, charlie.agents.mcp)
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    cwd: str | None = None
    url: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: settings for all the server's tools (over its hints).
    defaults: Override = field(default_factory=Override)
    #: per tool name (the server's name for it).
    tools: Mapping[str, Override] = field(default_factory=dict)
    #: trust nothing the server says about its tools: every tool is a write unless overridden.
    ignore_hints: bool = False
    #: seconds to connect and list the tools (None: CHARLIE_MCP_TIMEOUT).
    timeout: float | None = None

    def override_for(self, tool: str) -> Override:
        return self.tools.get(tool, Override()).over(self.defaults)

    def secrets(self) -> tuple[str, ...]:
        """Every value that must not be shown in text: header values (and the credential after
        an auth scheme), env values of secret names or of a key's length, URL credentials.
        (``describe`` shows no env or header value at all.)"""
        found = [v for k, v in self.env.items() if SECRET_NAME.search(k) or len(v) >= LONG_VALUE]
        for value in self.headers.values():
            found.append(value)
            scheme, _, credential = value.partition(" ")
            if credential and scheme.isalpha():
                found.append(credential.strip())
        if self.url:
            parts = urlsplit(self.url)
            found += [p for p in (parts.username, parts.password) if p]
            found += [v for _, v in parse_qsl(parts.query)]
        return tuple(s for s in found if len(s) >= MIN_SECRET)

    def describe(self) -> str:
        """What the server is, for people: no env or header value, no URL credentials."""
        if self.transport == "stdio":
            shown = " ".join([self.command or "", *self.args])
            if len(shown) > 120:
                shown = shown[:119] + "…"
            env = f" env {', '.join(f'{k}={MASK}' for k in sorted(self.env))}" if self.env else ""
            return f"stdio: {shown}{env}"
        heads = (
            f" headers {', '.join(f'{k}: {MASK}' for k in sorted(self.headers))}"
            if self.headers
            else ""
        )
        # (an agent's server may speak the older SSE transport: said so, not "http")
        return f"{self.transport}: {safe_url(self.url or '')}{heads}"


def safe_url(url: str) -> str:
    """A URL as it may be printed: no user, password or query string."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    query = f"{MASK}" if parts.query else ""
    return urlunsplit((parts.scheme, host, parts.path, query, ""))


@dataclass(frozen=True)
class McpConfig:
    servers: tuple[ServerConfig, ...] = ()
    #: where it came from, for messages: "CHARLIE_MCP_CONFIG=/path", "CHARLIE_MCP_SERVERS".
    sources: tuple[str, ...] = ()

    def server(self, name: str) -> ServerConfig | None:
        return next((s for s in self.servers if s.name == name), None)

    def fingerprint(self) -> str:
        """Equal for equal configurations (a key for this process's connections)."""
        shape = json.dumps([asdict(s) for s in self.servers], default=str, sort_keys=True)
        return hashlib.sha256(shape.encode()).hexdigest()

    def scrub(self, text: str) -> str:
        """``text`` with every configured secret replaced by ``***``."""
        for secret in sorted(self._secrets(), key=len, reverse=True):
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def scrub_value(self, value: Any) -> Any:
        """A JSON value with every string in it (keys too) scrubbed: a secret is found as it
        is, before serialising escapes a quote, a backslash or a control or non-ASCII
        character of it into a form ``scrub`` on the JSON text would not match."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(str(k)): self.scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_value(v) for v in value]
        return value

    def _secrets(self) -> tuple[str, ...]:
        return tuple(s for server in self.servers for s in server.secrets())


def _where(source: str, path: str) -> str:
    return f"{source}: {path}"


def _string(value: Any, source: str, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise McpConfigError(
            f"{_where(source, path)} must be a non-empty string, not {_kind(value)}"
        )
    return value


def _kind(value: Any) -> str:
    """What a wrong value is, without showing it (it may be a secret)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _string_map(value: Any, source: str, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise McpConfigError(f"{_where(source, path)} must be an object of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise McpConfigError(
                f"{_where(source, f'{path}.{key}')} must be a string, not {_kind(item)}"
            )
    return dict(value)


def _override(value: Any, source: str, path: str, *, strict: bool) -> Override:
    """Charlie's recovery settings in an object; ``strict``: no other key may be there (a
    tool's override is Charlie's own object, so an unknown key there is a typo)."""
    if not isinstance(value, dict):
        raise McpConfigError(f"{_where(source, path)} must be an object, not {_kind(value)}")
    if strict:
        unknown = sorted(set(value) - set(OVERRIDE_KEYS))
        if unknown:
            raise McpConfigError(
                f"{_where(source, f'{path}.{unknown[0]}')} is not a setting "
                f"(a tool's are {', '.join(OVERRIDE_KEYS)})"
            )
    effect = value.get("effect")
    if effect is not None and effect not in (Effect.READ.value, Effect.WRITE.value):
        raise McpConfigError(f'{_where(source, f"{path}.effect")} must be "read" or "write"')
    approval = value.get("approval")
    if approval is not None and not isinstance(approval, bool):
        raise McpConfigError(f"{_where(source, f'{path}.approval')} must be true or false")
    on_interrupt = value.get("on_interrupt")
    if on_interrupt is not None and on_interrupt not in ("report", "hold"):
        raise McpConfigError(f'{_where(source, f"{path}.on_interrupt")} must be "report" or "hold"')
    deadline = value.get("deadline")
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, int | float) or deadline <= 0
    ):
        raise McpConfigError(f"{_where(source, f'{path}.deadline')} must be positive seconds")
    return Override(
        effect=Effect(effect) if effect is not None else None,
        approval=approval,
        on_interrupt=OnInterrupt(on_interrupt) if on_interrupt is not None else None,
        deadline=float(deadline) if deadline is not None else None,
    )


def _server(name: str, value: Any, source: str) -> ServerConfig | None:
    path = f"mcpServers.{name}"
    if not SERVER_NAME.match(name) or len(name) > MAX_SERVER_NAME:
        raise McpConfigError(
            f"{_where(source, path)}: a server name must be 1-{MAX_SERVER_NAME} letters, digits, "
            "'-' and single '_' (it becomes part of tool names: mcp__NAME__TOOL)"
        )
    if not isinstance(value, dict):
        raise McpConfigError(f"{_where(source, path)} must be an object, not {_kind(value)}")
    disabled = value.get("disabled", False)
    if not isinstance(disabled, bool):
        raise McpConfigError(f"{_where(source, f'{path}.disabled')} must be true or false")
    if disabled:
        return None
    kind = value.get("type", value.get("transport"))
    if kind is not None:
        if kind not in TRANSPORT_TYPES:
            raise McpConfigError(
                f'{_where(source, f"{path}.type")} must be "stdio" or "http" '
                f"(streamable HTTP){'; SSE servers are not supported' if kind == 'sse' else ''}"
            )
        transport = TRANSPORT_TYPES[kind]
    elif "command" in value:
        transport = "stdio"
    elif "url" in value:
        transport = "http"
    else:
        raise McpConfigError(
            f'{_where(source, path)} needs "command" (a stdio server) or "url" '
            "(a streamable HTTP server)"
        )
    if "command" in value and "url" in value:
        raise McpConfigError(f'{_where(source, path)} has both "command" and "url"')
    defaults = _override(value, source, path, strict=False)
    tools_raw = value.get("tools", {})
    if not isinstance(tools_raw, dict):
        raise McpConfigError(
            f"{_where(source, f'{path}.tools')} must be an object of tool names to settings"
        )
    tools = {
        str(tool): _override(settings, source, f"{path}.tools.{tool}", strict=True)
        for tool, settings in tools_raw.items()
    }
    ignore_hints = value.get("ignore_hints", False)
    if not isinstance(ignore_hints, bool):
        raise McpConfigError(f"{_where(source, f'{path}.ignore_hints')} must be true or false")
    timeout = value.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise McpConfigError(f"{_where(source, f'{path}.timeout')} must be positive seconds")
    common: dict[str, Any] = {
        "name": name,
        "transport": transport,
        "defaults": defaults,
        "tools": tools,
        "ignore_hints": ignore_hints,
        "timeout": float(timeout) if timeout is not None else None,
    }
    if transport == "stdio":
        command = _string(value.get("command"), source, f"{path}.command")
        args = value.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpConfigError(f"{_where(source, f'{path}.args')} must be a list of strings")
        cwd = value.get("cwd")
        if cwd is not None:
            cwd = _string(cwd, source, f"{path}.cwd")
        return ServerConfig(
            **common,
            command=command,
            args=tuple(args),
            env=_string_map(value.get("env"), source, f"{path}.env"),
            cwd=cwd,
        )
    url = _string(value.get("url"), source, f"{path}.url")
    scheme = urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise McpConfigError(f"{_where(source, f'{path}.url')} must be an http:// or https:// URL")
    return ServerConfig(
        **common, url=url, headers=_string_map(value.get("headers"), source, f"{path}.headers")
    )


def parse(document: Any, source: str) -> tuple[ServerConfig, ...]:
    """The servers of one configuration object (``{"mcpServers": {...}}``)."""
    if not isinstance(document, dict):
        raise McpConfigError(f'{source}: must be a JSON object with "mcpServers"')
    servers = document.get("mcpServers")
    if servers is None:
        raise McpConfigError(f'{source}: has no "mcpServers" object')
    if not isinstance(servers, dict):
        raise McpConfigError(f"{_where(source, 'mcpServers')} must be an object of servers")
    found = (_server(str(name), value, source) for name, value in servers.items())
    return tuple(s for s in found if s is not None)


def _load_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # The position only: the text may hold secrets.
        raise McpConfigError(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None


def load(config_path: str | None, inline: str | None) -> McpConfig:
    """The configuration from CHARLIE_MCP_CONFIG (a path) and CHARLIE_MCP_SERVERS (inline)."""
    servers: list[ServerConfig] = []
    sources: list[str] = []
    if config_path:
        source = f"CHARLIE_MCP_CONFIG={config_path}"
        try:
            text = Path(config_path).expanduser().read_text()
        except OSError as exc:
            raise McpConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None
        servers += parse(_load_json(text, source), source)
        sources.append(source)
    if inline:
        source = "CHARLIE_MCP_SERVERS"
        servers += parse(_load_json(inline, source), source)
        sources.append(source)
    names = [s.name for s in servers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise McpConfigError(
            f"MCP server {twice[0]!r} is configured twice ({' and '.join(sources)})"
        )
    return McpConfig(servers=tuple(servers), sources=tuple(sources))
