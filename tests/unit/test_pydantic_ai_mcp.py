"""An agent's MCP servers (``MCPToolset``, prefixed) as Charlie's MCP calls (I34, I9-I11), against
Pydantic AI's FunctionModel and the test MCP server over stdio (tests/support/mcp_server.py),
which writes every execution to a ledger outside Charlie. No worker, no database: a
transcript is built by hand, as call_model would hand it over."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mcp_types
import pytest
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai import messages as pm
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.models.function import AgentInfo, FunctionModel

from charlie import agents
from charlie.domain import Effect
from charlie.mcp.config import McpConfig, ServerConfig
from charlie.mcp.connections import Connections, TooLarge
from charlie.tools.context import Interrupted, ToolContext
from charlie.tools.registry import ToolRegistry, ToolUnavailable
from tests.support.cluster import MCP_SERVER_SCRIPT, free_port
from tests.unit.test_pydantic_ai_agents import Transcript, _result

pytestmark = pytest.mark.backend_free

HERE = "tests.unit.test_pydantic_ai_mcp"
LEDGER = Path(tempfile.mkdtemp(prefix="charlie-agent-mcp-")) / "ledger.jsonl"
TOKEN = "agent-stdio-secret-51c0"

SCRIPT: list[pm.ModelResponse] = []
SEEN: list[tuple[list[pm.ModelMessage], AgentInfo]] = []


def scripted(messages: list[pm.ModelMessage], info: AgentInfo) -> pm.ModelResponse:
    SEEN.append((messages, info))
    return SCRIPT.pop(0)


def _stdio(**extra: Any) -> MCPToolset[Any]:
    env = {"MCP_TEST_LEDGER": str(LEDGER), "MCP_TEST_NAME": "files", "MCP_TEST_TOKEN": TOKEN}
    return MCPToolset(StdioTransport(sys.executable, [str(MCP_SERVER_SCRIPT)], env=env), **extra)


mcp_agent = Agent(
    FunctionModel(scripted, model_name="fn"), toolsets=[_stdio(id="files").prefixed("f")]
)


async def _hook(ctx: Any, call: Any, name: str, args: Any) -> Any:
    return await call(name, args)


with_auth = Agent(
    FunctionModel(scripted), toolsets=[MCPToolset("http://127.0.0.1:9/mcp", auth="t")]
)
with_hook = Agent(FunctionModel(scripted), toolsets=[_stdio(process_tool_call=_hook)])
with_filter = Agent(FunctionModel(scripted), toolsets=[_stdio().filtered(lambda c, d: True)])
with_instructions = Agent(FunctionModel(scripted), toolsets=[_stdio(include_instructions=True)])
unreachable = Agent(FunctionModel(scripted), toolsets=[MCPToolset("http://127.0.0.1:9/mcp")])


@pytest.fixture(autouse=True)
def _fresh() -> None:
    SCRIPT.clear()
    SEEN.clear()


def _ran(event: str, key: str) -> int:
    if not LEDGER.exists():
        return 0
    rows = [json.loads(line) for line in LEDGER.read_text().splitlines() if line.strip()]
    return len([r for r in rows if r["event"] == event and r.get("key") == key])


def _ctx(call_id: str, *, resumed: bool = False) -> ToolContext:
    return ToolContext(
        task_id="t1",
        execution_id="t1:x",
        call_id=call_id,
        turn=0,
        workspace=Path("."),
        metadata={agents.METADATA_KEY: {"agent": f"{HERE}:mcp_agent", "deps": None}},
        resumed=resumed,
        handle=None,
        _record_handle=lambda h: None,
    )


def test_the_servers_tools_are_the_agents_with_effects_from_their_annotations() -> None:
    """I34: each MCP tool is a Charlie tool of the agent under the model's (prefixed) name; a
    read by its readOnlyHint, a write otherwise (as for the fleet's MCP servers)."""
    made = agents.prepare_submission(f"{HERE}:mcp_agent", None, ["f_delete_record"], None)
    assert f"{HERE}:mcp_agent.f_lookup" in made.tools
    assert made.approve == [f"{HERE}:mcp_agent.f_delete_record"]
    registry = ToolRegistry()
    assert agents.find_tool(registry, f"{HERE}:mcp_agent.f_lookup")
    get = registry.get_registered
    lookup, delete, unhinted = (
        get(f"{HERE}:mcp_agent.f_{n}") for n in ("lookup", "delete_record", "unhinted")
    )
    assert lookup and delete and unhinted
    assert lookup.effect is Effect.READ
    assert delete.effect is Effect.WRITE and unhinted.effect is Effect.WRITE
    assert not delete.resumable and delete.reconcile is None and delete.parks
    assert delete.implementation == f"{HERE}:mcp_agent:f_delete_record"
    assert delete.remote  # a replay never calls the server (I35)


def test_the_model_is_shown_the_servers_tools_as_pydantic_ai_defines_them() -> None:
    model = agents.model_for(
        agents.AgentSpec("function:fn", f"{HERE}:mcp_agent").render(), ToolRegistry()
    )
    t = Transcript("look it up")
    SCRIPT.append(pm.ModelResponse(parts=[pm.ToolCallPart("f_lookup", {"key": "k1"}, "c1")]))
    response = model.complete(t.request())
    _, info = SEEN[0]
    shown = {d.name: d for d in info.function_tools}
    assert {"f_lookup", "f_delete_record", "f_fails"} <= set(shown)
    assert shown["f_lookup"].parameters_json_schema["properties"]["key"]["type"] == "string"
    assert (shown["f_lookup"].metadata or {})["annotations"]["readOnlyHint"] is True
    assert [i.payload.get("name") for i in response.output] == [f"{HERE}:mcp_agent.f_lookup"]


def test_calls_go_through_charlies_client_and_come_back_as_pydantic_ai_maps_them() -> None:
    """A read's result as the model would see it under agent.run; an isError result is a
    ModelRetry (tool_error_behavior='retry'); the server ran each exactly once."""
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:mcp_agent.f_lookup")

    def call(name: str, call_id: str, args: dict[str, Any], resumed: bool = False) -> Any:
        definition = registry.get_registered(f"{HERE}:mcp_agent.{name}")
        assert definition is not None
        return definition.handler(**args, _charlie_ctx=_ctx(call_id, resumed=resumed))

    assert call("f_lookup", "c1", {"key": "u1"}) == "u1=v-u1"
    assert _ran("lookup", "u1") == 1
    failed = _result(
        f"{HERE}:mcp_agent.f_fails", "c2", lambda: call("f_fails", "c2", {"message": "no"})
    )
    assert failed.payload["outcome"] == "error"
    part = failed.payload["result"]["pydantic_ai_part"]
    assert part["outcome"] == "retried" and "tool fails" in part["content"]
    assert call("f_delete_record", "c3", {"key": "u2"}) == "deleted u2"
    assert _ran("delete.start", "u2") == 1


def test_a_call_found_started_after_a_crash_is_interrupted_and_never_sent_again() -> None:
    """I10: a call taken over (resumed, no handle), a write or a read, settles interrupted, and
    the server never sees it again."""
    registry = ToolRegistry()
    agents.find_tool(registry, f"{HERE}:mcp_agent.f_delete_record")
    delete = registry.get_registered(f"{HERE}:mcp_agent.f_delete_record")
    lookup = registry.get_registered(f"{HERE}:mcp_agent.f_lookup")
    assert delete is not None and lookup is not None
    with pytest.raises(Interrupted, match="does not send it again"):
        delete.handler(key="r1", _charlie_ctx=_ctx("c1", resumed=True))
    with pytest.raises(Interrupted, match="does not send it again"):
        lookup.handler(key="r2", _charlie_ctx=_ctx("c2", resumed=True))
    assert _ran("delete.start", "r1") == 0 and _ran("lookup", "r2") == 0


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("with_auth", "auth: give the credential as headers"),
        ("with_hook", "process_tool_call"),
        ("with_filter", "toolset FilteredToolset"),
        ("with_instructions", "include_instructions"),
        ("unreachable", "did not list its tools"),
    ],
)
def test_what_of_an_mcp_toolset_cannot_be_made_durable_is_refused_by_name(
    name: str, says: str
) -> None:
    with pytest.raises(agents.AgentRefused, match=re.escape(says)):
        agents.prepare_submission(f"{HERE}:{name}", None, None, None)


@pytest.fixture(scope="module")
def sse_server() -> Iterator[str]:
    """The test MCP server over the SSE transport, on a port of this run's range: its URL."""
    port = free_port()
    env = {**os.environ, "MCP_TEST_LEDGER": str(LEDGER), "MCP_TEST_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, str(MCP_SERVER_SCRIPT), "--http", str(port), "--sse"],
        env={**env, "MCP_TEST_NAME": "sse"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, "no SSE server"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/sse"
    finally:
        proc.kill()
        proc.wait()


def test_a_server_over_sse_is_listed_and_called_through_charlies_client(sse_server: str) -> None:
    """MCPToolset over the SSE transport: the same tools, effects and calls as over
    streamable HTTP (its token given as a header, never shown)."""
    toolset = MCPToolset(sse_server, id="old", headers={"Authorization": f"Bearer {TOKEN}"})
    globals()["sse_agent"] = Agent(FunctionModel(scripted, model_name="fn"), toolsets=[toolset])
    registry = ToolRegistry()
    assert agents.find_tool(registry, f"{HERE}:sse_agent.lookup")
    lookup = registry.get_registered(f"{HERE}:sse_agent.lookup")
    delete = registry.get_registered(f"{HERE}:sse_agent.delete_record")
    assert lookup is not None and delete is not None
    assert lookup.effect is Effect.READ and delete.effect is Effect.WRITE
    ctx = replace(_ctx("s1"), metadata={})
    assert lookup.handler(key="s1", _charlie_ctx=ctx) == "s1=v-s1"
    assert _ran("lookup", "s1") == 1


def test_an_sse_event_over_the_limit_is_cut_and_the_call_is_too_large(sse_server: str) -> None:
    """The SSE transport carries every answer on its GET event stream: an event over
    CHARLIE_MCP_MAX_MESSAGE_BYTES is not read on (its connection closed) and its request
    fails as too large, naming the server and the limit (I15); the next call connects
    again."""
    limit = 64 * 1024
    server = ServerConfig(
        name="sse-old", transport="sse", url=sse_server,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    links = Connections(McpConfig(servers=(server,)), 10.0, limit)
    try:
        with pytest.raises(TooLarge) as caught:
            links.call_tool("sse-old", "flood", {"answer_bytes": limit * 4}, timeout=20)
        assert caught.value.server == "sse-old"
        assert f"over the limit of {limit} bytes" in caught.value.reason
        fits = links.call_tool("sse-old", "flood", {"answer_bytes": limit // 2}, timeout=20)
        assert isinstance(fits, mcp_types.CallToolResult) and not fits.is_error
    finally:
        links.close()


def test_an_agents_server_that_does_not_answer_holds_up_no_other_agents_load() -> None:
    """An agent whose MCP server accepts and never answers is loaded (its servers listed,
    up to their timeout) under its own lock: meanwhile another agent loads, and one loaded
    before is found, without waiting for it (I36: the other agents' steps go on)."""
    from charlie.agents import pydantic_ai

    mute = socket.create_server(("127.0.0.1", free_port()))
    held: list[socket.socket] = []
    port = mute.getsockname()[1]
    globals()["mute_agent"] = Agent(
        FunctionModel(scripted), toolsets=[MCPToolset(f"http://127.0.0.1:{port}/mcp")]
    )
    globals()["other_agent"] = Agent(FunctionModel(scripted, model_name="fn"))
    before = pydantic_ai.load(f"{HERE}:mcp_agent")
    failed: list[BaseException] = []

    def load_mute() -> None:
        try:
            pydantic_ai.load(f"{HERE}:mute_agent")
        except agents.AgentRefused as exc:
            failed.append(exc)

    loading = threading.Thread(target=load_mute)
    loading.start()
    try:
        held.append(mute.accept()[0])  # its listing is in flight now, and stays so
        assert pydantic_ai.load(f"{HERE}:mcp_agent") is before
        assert pydantic_ai.load(f"{HERE}:other_agent").ref == f"{HERE}:other_agent"
        assert loading.is_alive()  # the mute server's listing still waits
    finally:
        for conn in held:
            conn.close()
        mute.close()
        loading.join()
    assert failed and "did not list its tools" in str(failed[0])


def double(n: int) -> int:
    """Twice n."""
    return 2 * n


half_down = Agent(
    FunctionModel(scripted, model_name="fn"),
    tools=[double],
    toolsets=[MCPToolset("http://127.0.0.1:9/mcp", id="gone")],
)


def test_a_call_of_an_agent_whose_mcp_server_is_down_runs_its_function_tools() -> None:
    """A worker that first meets the agent while its MCP server does not list its tools
    registers the agent's function tools all the same, and they run; a call of the server's
    tool is not sent, and says which server did not answer and why, not "not registered"
    (I36, I11: a call never sent is said to be so)."""
    registry = ToolRegistry()
    registry.add_finder(agents.find_tool)
    found = registry.find(f"{HERE}:half_down.double")
    assert found is not None
    ctx = replace(_ctx("h1"), metadata={})
    assert found.handler(n=21, _charlie_ctx=ctx) == 42
    with pytest.raises(ToolUnavailable) as caught:
        registry.find(f"{HERE}:half_down.lookup")
    said = str(caught.value)
    assert "its MCP server MCPToolset 'gone'" in said and "127.0.0.1:9" in said
    assert "did not list its tools" in said and "the call was not sent" in said
    # the model's step is not taken meanwhile: tried again later (its tools not all known)
    with pytest.raises(agents.AgentRefused, match="did not list its tools"):
        agents.prepare_submission(f"{HERE}:half_down", None, None, None)


@pytest.mark.parametrize("raw", [False, True], ids=["fleet", "agent"])
def test_a_secret_that_json_escapes_is_scrubbed_from_a_result(raw: bool) -> None:
    """A configured secret holding a quote, a backslash, a control and a non-ASCII character
    is found in a server's result as it is, not only as JSON text shows it: it is in no
    string of the result, escaped or not (the fleet's MCP results and an agent's)."""
    from charlie.agents.mcp import _RawCall
    from charlie.mcp.tools import McpCall, Servers

    secret = 'pa"ss\\w\tord-ü-51c0'
    server = ServerConfig(
        name="s", transport="http", url="http://127.0.0.1:9/mcp",
        headers={"Authorization": f"Bearer {secret}"},
    )  # fmt: skip
    servers = Servers(McpConfig(servers=(server,)), 1.0, 10.0)
    kind = _RawCall if raw else McpCall
    call = kind(servers, "s", "t", Effect.READ, 10.0, {}, _ctx("x1"))
    result = mcp_types.CallToolResult(
        content=[mcp_types.TextContent(type="text", text=f"token {secret} here")],
        structured_content={"token": secret, "nested": [{"again": f"<{secret}>"}]},
    )
    shown = call._result(result)
    text = json.dumps(shown.model_dump(mode="json") if raw else shown)
    for form in (secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]):
        assert form not in text
    assert "***" in text


def test_the_private_names_of_pydantic_ai_the_adapter_uses_are_there(monkeypatch) -> None:
    """The adapter reads and overrides names Pydantic AI keeps private: a release that renames
    one is caught, by name (at import for the class's; here for a toolset's settings), not
    found at a call where the stand-in's override and its guard would be skipped (I34)."""
    from charlie.agents import mcp as agent_mcp

    assert agent_mcp.private_names_missing() == []
    toolset = MCPToolset("http://127.0.0.1:9/mcp", id="x")
    assert [n for n in agent_mcp.PRIVATE_INSTANCE_NAMES if n not in vars(toolset)] == []
    assert hasattr(Agent(FunctionModel(scripted)), "_output_toolset")
    monkeypatch.delattr(MCPToolset, "_call_tool_checked")
    assert agent_mcp.private_names_missing() == ["_call_tool_checked"]


def test_the_stand_in_sends_nothing_outside_a_charlie_call() -> None:
    """The stand-in of an agent's MCP server is guarded at its public call too: a call made
    outside a Charlie call (none recorded, I9) is refused, never sent."""
    import asyncio

    from charlie.agents import pydantic_ai
    from charlie.agents.mcp import _StandIn

    loaded = pydantic_ai.load(f"{HERE}:mcp_agent")
    assert loaded.mcp is not None
    stand_in = getattr(loaded.mcp.toolsets[0], "wrapped", None)
    assert isinstance(stand_in, _StandIn)
    with pytest.raises(RuntimeError, match="outside a Charlie call"):
        asyncio.run(stand_in.call_tool("lookup", {"key": "g1"}, None, None))
    with pytest.raises(RuntimeError, match="not a Charlie call"):
        asyncio.run(stand_in.call_tool_for_app("lookup", {"key": "g1"}))
    assert _ran("lookup", "g1") == 0


def test_a_server_over_sse_is_described_as_sse() -> None:
    server = ServerConfig(name="s", transport="sse", url="http://u:p@127.0.0.1:9/sse?k=v")
    assert server.describe().startswith("sse: http://127.0.0.1:9/sse")
    assert replace(server, transport="http").describe().startswith("http: ")
