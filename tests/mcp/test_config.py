"""The MCP configuration: the shape MCP clients use, errors that name the
key and never a secret, Charlie's overrides, tool names a model API accepts, and secrets kept
out of everything shown. No server, no cluster."""

from __future__ import annotations

import json
from pathlib import Path

import mcp_types
import pytest

from charlie.domain import Effect, OnInterrupt
from charlie.mcp.config import McpConfigError, load, parse, safe_url
from charlie.mcp.tools import MAX_NAME, SAFE, effect_of, server_of, tool_name

SECRET = "sk-very-secret-123456"


def servers(document: dict[str, object]) -> dict[str, object]:
    return {s.name: s for s in parse(document, "test")}


def error(document: object) -> str:
    with pytest.raises(McpConfigError) as raised:
        parse(document, "CHARLIE_MCP_SERVERS")
    return str(raised.value)


def test_the_shape_mcp_clients_use_stdio_and_streamable_http() -> None:
    found = servers(
        {
            "mcpServers": {
                "files": {"command": "npx", "args": ["-y", "srv"], "env": {"TOKEN": SECRET}},
                "search": {"url": "https://s.example/mcp", "headers": {"X-Key": SECRET}},
                "typed": {"type": "streamable-http", "url": "http://127.0.0.1:9/mcp"},
                "off": {"command": "x", "disabled": True},
                "other_clients_keys": {"command": "x", "autoApprove": ["a"], "alwaysAllow": []},
            }
        }
    )
    assert set(found) == {"files", "search", "typed", "other_clients_keys"}
    files, search = found["files"], found["search"]
    assert (files.transport, files.command, files.args) == ("stdio", "npx", ("-y", "srv"))
    assert (search.transport, search.url) == ("http", "https://s.example/mcp")
    assert found["typed"].transport == "http"


def test_file_and_inline_together_and_a_name_in_both_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"a": {"command": "x"}}}))
    config = load(str(path), json.dumps({"mcpServers": {"b": {"url": "http://h/mcp"}}}))
    assert [s.name for s in config.servers] == ["a", "b"]
    with pytest.raises(McpConfigError, match="'a' is configured twice"):
        load(str(path), json.dumps({"mcpServers": {"a": {"url": "http://h/mcp"}}}))
    with pytest.raises(McpConfigError, match="cannot be read"):
        load(str(tmp_path / "missing.json"), None)
    assert load(None, None).servers == ()


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ({"servers": {}}, 'no "mcpServers"'),
        ({"mcpServers": []}, "mcpServers must be an object"),
        ({"mcpServers": {"a": {"args": []}}}, 'mcpServers.a needs "command"'),
        ({"mcpServers": {"a": {"command": "x", "args": "-v"}}}, "mcpServers.a.args"),
        ({"mcpServers": {"a": {"command": "x", "env": {"T": 1}}}}, "mcpServers.a.env.T"),
        ({"mcpServers": {"a": {"url": "http://h", "headers": {"K": ["v"]}}}}, "a.headers.K"),
        ({"mcpServers": {"a": {"url": "ftp://h"}}}, "mcpServers.a.url"),
        ({"mcpServers": {"a": {"url": "http://h", "command": "x"}}}, "both"),
        ({"mcpServers": {"a": {"type": "sse", "url": "http://h"}}}, "SSE servers are not"),
        ({"mcpServers": {"a__b": {"command": "x"}}}, "mcpServers.a__b: a server name"),
        ({"mcpServers": {"a": {"command": "x", "effect": "wait"}}}, "mcpServers.a.effect"),
        ({"mcpServers": {"a": {"command": "x", "on_interrupt": "retry"}}}, "a.on_interrupt"),
        ({"mcpServers": {"a": {"command": "x", "approval": "yes"}}}, "mcpServers.a.approval"),
        ({"mcpServers": {"a": {"command": "x", "deadline": -1}}}, "mcpServers.a.deadline"),
        ({"mcpServers": {"a": {"command": "x", "ignore_hints": 1}}}, "a.ignore_hints"),
        (
            {"mcpServers": {"a": {"command": "x", "tools": {"t": {"efect": "read"}}}}},
            "mcpServers.a.tools.t.efect is not a setting",
        ),
    ],
)
def test_errors_name_the_bad_key(document: object, names: str) -> None:
    assert names in error(document)


def test_no_error_shows_a_secret() -> None:
    shown = [
        error({"mcpServers": {"a": {"command": SECRET, "args": SECRET}}}),
        error({"mcpServers": {"a": {"url": "ftp://" + SECRET}}}),
        error({"mcpServers": {"a": {"command": "x", "effect": SECRET}}}),
    ]
    with pytest.raises(McpConfigError) as bad_json:
        load(None, '{"mcpServers": {"a": {"env": {"T": "' + SECRET + '"}}')
    shown.append(str(bad_json.value))
    assert "line 1" in shown[-1]
    for text in shown:
        assert SECRET not in text, text


def test_describe_and_scrub_keep_secrets_out() -> None:
    config = load(
        None,
        json.dumps(
            {
                "mcpServers": {
                    "s": {"command": "srv", "env": {"API_TOKEN": "tok1", "LONG": "x" * 20}},
                    "h": {
                        "url": f"https://user:{SECRET}@h.example/mcp?key=qsecret",
                        "headers": {"Authorization": "Bearer bearer-cred-9"},
                    },
                }
            }
        ),
    )
    s, h = config.servers
    assert "tok1" not in s.describe() and "API_TOKEN=***" in s.describe()
    assert SECRET not in h.describe() and "qsecret" not in h.describe()
    assert "bearer-cred-9" not in h.describe() and "Authorization: ***" in h.describe()
    text = f"failed with tok1 and {SECRET}, qsecret, Bearer bearer-cred-9, bearer-cred-9 alone"
    scrubbed = config.scrub(text)
    for secret in ("tok1", SECRET, "qsecret", "bearer-cred-9"):
        assert secret not in scrubbed
    # a short ordinary value of a name that is no secret is not blanked out of text
    plain = load(None, json.dumps({"mcpServers": {"s": {"command": "x", "env": {"LVL": "info"}}}}))
    assert plain.scrub("some info") == "some info"
    assert safe_url("http://u:p@h:8/p?x=1") == "http://h:8/p?***"


def tool(name: str, read_only: bool | None = None) -> mcp_types.Tool:
    hints = None if read_only is None else mcp_types.ToolAnnotations(readOnlyHint=read_only)
    return mcp_types.Tool(name=name, input_schema={"type": "object"}, annotations=hints)


def test_effect_from_hints_with_the_operator_in_charge() -> None:
    found = servers(
        {
            "mcpServers": {
                "trusting": {"command": "x", "tools": {"forced": {"effect": "write"}}},
                "doubting": {
                    "command": "x",
                    "ignore_hints": True,
                    "tools": {"ok": {"effect": "read"}},
                },
                "all_read": {"command": "x", "effect": "read", "on_interrupt": "hold"},
            }
        }
    )
    trusting, doubting, all_read = found["trusting"], found["doubting"], found["all_read"]
    assert effect_of(trusting, tool("r", read_only=True)) is Effect.READ
    assert effect_of(trusting, tool("w", read_only=False)) is Effect.WRITE
    assert effect_of(trusting, tool("silent")) is Effect.WRITE  # anything else: a write
    assert effect_of(trusting, tool("forced", read_only=True)) is Effect.WRITE
    assert effect_of(doubting, tool("r", read_only=True)) is Effect.WRITE
    assert effect_of(doubting, tool("ok")) is Effect.READ
    assert effect_of(all_read, tool("w", read_only=False)) is Effect.READ
    assert all_read.override_for("w").on_interrupt is OnInterrupt.HOLD


def test_tool_names_fit_what_model_apis_accept() -> None:
    assert tool_name("files", "read_file") == "mcp__files__read_file"
    assert server_of("mcp__files__read_file") == "files"
    assert server_of("read_file") is None
    odd = ["get.weather", "a/b c", "x" * 80, "ü", "x" * 80 + "y"]
    names = [tool_name("server-1", t) for t in odd]
    for name in names:
        assert SAFE.match(name) and len(name) <= MAX_NAME, name
        assert name.startswith("mcp__server-1__")
    assert len(set(names)) == len(names)  # distinct, and the same in every process:
    assert names == [tool_name("server-1", t) for t in odd]


def test_the_sdks_log_records_and_surprises_are_scrubbed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Secrets stay out of the MCP SDK's own log lines, and out of any error a call shows,
    whatever raised it."""
    import logging

    from charlie.domain import Outcome
    from charlie.mcp import config_of
    from charlie.mcp.connections import Connections
    from charlie.mcp.tools import Servers, definition
    from charlie.testing import ToolEnvironment
    from charlie.tools.registry import ToolRegistry

    document = {"mcpServers": {"s": {"url": "http://h/mcp", "headers": {"X-Api-Key": SECRET}}}}
    settings = type("S", (), {"mcp_config": None, "mcp_servers": json.dumps(document)})()
    config = config_of(settings)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO):
        logging.getLogger("mcp.client.streamable_http").info("POST with key %s", SECRET)
        try:
            raise RuntimeError(f"failed with {SECRET}")
        except RuntimeError:
            logging.getLogger("httpx2").exception("request failed")
    assert SECRET not in caplog.text and "***" in caplog.text

    def surprise(self: Connections, *args: object, **kwargs: object) -> object:
        raise KeyError(f"a surprise mentioning {SECRET}")

    monkeypatch.setattr(Connections, "call_tool", surprise)
    servers = Servers(config, timeout=1.0, default_deadline=5.0)
    registry = ToolRegistry()
    server = config.servers[0]
    for name, hint in (("r", True), ("w", False)):
        made = definition(servers, server, tool(name, read_only=hint))
        assert made is not None
        registry.add(made)
    env = ToolEnvironment(registry=registry)
    read, write = env.run("mcp__s__r"), env.run("mcp__s__w")
    assert read.outcome is Outcome.ERROR and write.outcome is Outcome.INTERRUPTED
    for done in (read, write):
        assert SECRET not in json.dumps(done.result) and "KeyError" in done.result["error"]
        assert "traceback" not in done.result
