"""MCP tools against real servers (the official SDK's MCPServer, over stdio and streamable HTTP),
run the way a worker runs them (charlie.testing.ToolEnvironment) but without a cluster: what the
model is shown, results and errors, a server that dies mid-call, one that is down, input a
person gives, tasks, and secrets."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from charlie.domain import Effect, Outcome
from charlie.mcp.config import load
from charlie.mcp.tools import Servers, definition, register
from charlie.testing import ToolEnvironment
from charlie.tools.registry import ToolRegistry
from tests.support.cluster import (
    MCP_HTTP_TOKEN,
    MCP_SERVER_SCRIPT,
    MCP_STDIO_TOKEN,
    McpServers,
    free_port,
    kill_mcp_server,
)

pytestmark = pytest.mark.timeout(120)


def entries(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if event is None or r["event"] == event]


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > end:
            raise AssertionError("condition not met")
        time.sleep(0.05)
    return value


class Remote:
    """Real MCP servers and a registry of their tools, as one worker process has them."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.ledger = home / "mcp-ledger.jsonl"
        self.servers = McpServers(home, web_port=free_port(), flaky_port=0, dead_port=free_port())
        self.http = self.servers.start_http(self.servers.web_port, "web")
        self.registry = ToolRegistry()
        stdio_env = {
            "MCP_TEST_LEDGER": str(self.ledger),
            "MCP_TEST_TOKEN": MCP_STDIO_TOKEN,
            "MCP_TEST_NAME": "files",
        }
        document = {
            "mcpServers": {
                "files": {
                    "command": sys.executable,
                    "args": [str(MCP_SERVER_SCRIPT)],
                    "env": stdio_env,
                },
                "web": {
                    "url": f"http://127.0.0.1:{self.servers.web_port}/mcp",
                    "headers": {"Authorization": f"Bearer {MCP_HTTP_TOKEN}"},
                },
                "down": {"url": f"http://127.0.0.1:{self.servers.dead_port}/mcp"},
            }
        }
        self.config = load(None, json.dumps(document))
        self.tools = Servers(self.config, timeout=10.0, default_deadline=30.0)
        self.connections = self.tools.connections
        self.found = self.connections.list_many(["files", "web", "down"])
        for name in ("files", "web"):
            server = self.config.server(name)
            assert server is not None
            listed = self.found[name]
            assert isinstance(listed, list), listed
            register(self.registry, [d for t in listed if (d := definition(self.tools, server, t))])
        self.env = ToolEnvironment(registry=self.registry, workspace=home / "ws")

    def stdio_pids(self) -> list[int]:
        return [
            int(e["pid"]) for e in entries(self.ledger, "server.start") if e["server"] == "files"
        ]

    def close(self) -> None:
        self.connections.close()
        if self.http.poll() is None:
            self.http.kill()
            self.http.wait()


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    r = Remote(tmp_path_factory.mktemp("mcp"))
    yield r
    r.close()


SERVERS = ["files", "web"]


def test_every_tool_is_a_charlie_tool_with_the_servers_description_and_schema(
    remote: Remote,
) -> None:
    names = remote.registry.names()
    for server in SERVERS:
        lookup = remote.registry.get(f"mcp__{server}__lookup")
        assert lookup is not None, names
        assert lookup.description == "Look a key up in the test store."
        assert lookup.parameters["properties"]["key"]["type"] == "string"
        assert lookup.parameters["required"] == ["key"]
        assert lookup.effect is Effect.READ  # readOnlyHint
        assert lookup.implementation == f"mcp:{server}:lookup"
        assert lookup.source == f"mcp:{server}"
        assert not lookup.resumable and lookup.parks
        delete = remote.registry.get(f"mcp__{server}__delete_record")
        assert delete is not None and delete.effect is Effect.WRITE  # destructiveHint
        unhinted = remote.registry.get(f"mcp__{server}__unhinted")
        assert unhinted is not None and unhinted.effect is Effect.WRITE  # no hint: a write
    # arguments are validated against the server's schema before anything is sent (I15)
    bad = remote.env.run("mcp__files__lookup", key=3)
    assert bad.outcome is Outcome.ERROR and "invalid arguments" in bad.result["error"]
    assert "ConnectError" in remote.found["down"].reason


@pytest.mark.parametrize("server", SERVERS)
def test_a_read_a_write_and_a_tool_error(remote: Remote, server: str) -> None:
    read = remote.env.run(f"mcp__{server}__lookup", key="k1")
    assert read.ok and read.result == "k1=v-k1"
    write = remote.env.run(f"mcp__{server}__delete_record", key=f"d-{server}")
    assert write.ok and write.result == f"deleted d-{server}"
    deletions = [e for e in entries(remote.ledger, "delete.start") if e["key"] == f"d-{server}"]
    assert len(deletions) == 1 and deletions[0]["server"] == server
    failed = remote.env.run(f"mcp__{server}__fails", message="no such key")
    assert failed.outcome is Outcome.ERROR and failed.result["server"] == server


def test_one_stdio_server_per_process_and_one_pooled_http_session_serve_every_call(
    remote: Remote,
) -> None:
    """The calls of one process reuse its stdio server (no process per call)
    and its HTTP session, whose client keeps its connection for the next request (a session
    made per call would show a new server process, or a new client port, each time)."""
    keys = [f"reuse-{i}" for i in range(6)]
    for key in keys:
        assert remote.env.run("mcp__files__lookup", key=key).ok
        assert remote.env.run("mcp__web__lookup", key=key).ok
    looked = [e for e in entries(remote.ledger, "lookup") if e["key"] in keys]
    stdio = [e for e in looked if e["server"] == "files"]
    http = [e for e in looked if e["server"] == "web"]
    assert len(stdio) == len(http) == len(keys)
    assert len({e["pid"] for e in stdio}) == 1, stdio  # one server process for them all
    assert len({e["peer_port"] for e in http}) < len(keys), http  # pooled connections


@pytest.mark.parametrize("server", SERVERS)
def test_a_secret_a_server_echoes_never_reaches_the_result(remote: Remote, server: str) -> None:
    leaked = remote.env.run(f"mcp__{server}__leak")
    assert leaked.ok
    text = json.dumps(leaked.result)
    assert MCP_STDIO_TOKEN not in text and MCP_HTTP_TOKEN not in text
    assert "the token is ***" in text


def test_what_a_stdio_server_writes_to_stderr_reaches_the_log_scrubbed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A stdio server's stderr is its client's (a worker's log): a server that logs its token
    there shows ``***``, and the rest of what it writes is still shown."""
    config = load(
        None,
        json.dumps(
            {
                "mcpServers": {
                    "noisy": {
                        "command": sys.executable,
                        "args": [str(MCP_SERVER_SCRIPT)],
                        "env": {"MCP_TEST_TOKEN": MCP_STDIO_TOKEN, "MCP_TEST_NAME": "noisy"},
                    }
                }
            }
        ),
    )
    tools = Servers(config, timeout=10.0, default_deadline=30.0)
    connections = tools.connections
    try:
        server = config.server("noisy")
        assert server is not None
        registry = ToolRegistry()
        listed = connections.list_tools("noisy")
        register(registry, [d for t in listed if (d := definition(tools, server, t))])
        env = ToolEnvironment(registry=registry, workspace=tmp_path / "ws")
        assert env.run("mcp__noisy__leak").ok
        seen: list[str] = []

        def logged() -> bool:
            seen.append(capfd.readouterr().err)
            return "leak: the token is" in "".join(seen)

        wait_for(logged)
    finally:
        connections.close()
    err = "".join(seen) + capfd.readouterr().err
    assert MCP_STDIO_TOKEN not in err
    assert "leak: the token is ***" in err


def test_a_stdio_server_that_dies_mid_call_interrupts_a_write_and_fails_a_read(
    remote: Remote,
) -> None:
    """Sent, and then the server's process died: a write is interrupted (never sent again,
    I10), a read a tool error; the next call starts the server again."""

    def killed_during(tool: str, key: str) -> Any:
        remote.env.run("mcp__files__lookup", key="warm")  # a live session first
        pids = remote.stdio_pids()
        event = "delete.start" if tool == "delete_record" else "lookup"

        def kill() -> None:
            wait_for(lambda: any(e["key"] == key for e in entries(remote.ledger, event)))
            for pid in pids:
                kill_mcp_server(pid)

        killer = threading.Thread(target=kill)
        killer.start()
        started = time.monotonic()
        done = remote.env.run(f"mcp__files__{tool}", key=key, hold=10)
        killer.join()
        assert time.monotonic() - started < 10  # noticed, not waited out
        return done

    write = killed_during("delete_record", "kill-w")
    assert write.outcome is Outcome.INTERRUPTED, write
    assert "cannot tell whether it took effect" in write.result["error"]
    assert write.result["server"] == "files"
    read = killed_during("lookup", "kill-r")
    assert read.outcome is Outcome.ERROR and "did not answer" in read.result["error"], read
    assert len([e for e in entries(remote.ledger, "delete.start") if e["key"] == "kill-w"]) == 1
    again = remote.env.run("mcp__files__lookup", key="after")
    assert again.ok, again


def test_an_http_server_that_is_down_is_a_tool_error_for_reads_and_writes(
    tmp_path: Path,
) -> None:
    """Down (refused): nothing was sent, so a write is a tool error too; never a hang."""
    port = free_port()
    servers = McpServers(tmp_path, web_port=port, flaky_port=0, dead_port=0)
    http = servers.start_http(port, "gone")
    config = load(
        None,
        json.dumps(
            {
                "mcpServers": {
                    "gone": {
                        "url": f"http://127.0.0.1:{port}/mcp",
                        "headers": {"Authorization": f"Bearer {MCP_HTTP_TOKEN}"},
                    }
                }
            }
        ),
    )
    tools = Servers(config, timeout=5.0, default_deadline=30.0)
    connections = tools.connections
    try:
        registry = ToolRegistry()
        server = config.server("gone")
        assert server is not None
        register(
            registry,
            [d for t in connections.list_tools("gone") if (d := definition(tools, server, t))],
        )
        env = ToolEnvironment(registry=registry, workspace=tmp_path / "ws")
        assert env.run("mcp__gone__lookup", key="up").ok
        http.kill()
        http.wait()
        for tool, args in (("lookup", {"key": "a"}), ("delete_record", {"key": "b"})):
            started = time.monotonic()
            done = env.run(f"mcp__gone__{tool}", **args)
            assert time.monotonic() - started < 15
            assert done.outcome is Outcome.ERROR, done
            assert "is unavailable" in done.result["error"]
            assert "was not sent" in done.result["error"]
            assert MCP_HTTP_TOKEN not in json.dumps(done.result)
        assert not [e for e in entries(servers.ledger, "delete.start") if e["key"] == "b"]
    finally:
        connections.close()
        if http.poll() is None:
            http.kill()


@pytest.mark.parametrize("server", SERVERS)
def test_input_required_asks_a_person_and_the_answer_goes_on(remote: Remote, server: str) -> None:
    name = f"mcp__{server}__confirm_delete"
    asked = remote.env.run(name, key=f"c-{server}")
    assert asked.asked is not None, asked
    question = asked.asked.question
    assert f"Really delete c-{server}?" in question and '"confirm" (boolean' in question
    assert asked.asked.state["kind"] == "input"
    # an answer that does not fit the form is asked again, saying why
    again = remote.env.reply(name, asked, "perhaps", key=f"c-{server}")
    assert again.asked is not None and "must be yes or no" in again.asked.question
    done = remote.env.reply(name, again, "yes", key=f"c-{server}")
    assert done.ok and done.result == f"deleted c-{server}", done
    assert done.handle is not None and done.handle.startswith("input:")  # marked before sent
    deleted = [
        e for e in entries(remote.ledger, "confirm_delete.deleted") if e["key"] == f"c-{server}"
    ]
    assert len(deleted) == 1 and deleted[0]["state"] is True  # the request state came back
    declined = remote.env.reply(name, asked, "/decline", key=f"c-{server}")
    assert declined.ok and declined.result == f"kept c-{server}"


def test_an_answer_whose_request_state_a_restarted_server_refuses_is_sent_afresh(
    remote: Remote,
) -> None:
    """A stdio server seals its request state with a key of its process: asked by one server
    process and answered to the next, the call is made afresh with the answer."""
    name = "mcp__files__confirm_delete"
    asked = remote.env.run(name, key="restarted")
    assert asked.asked is not None
    for pid in remote.stdio_pids():
        kill_mcp_server(pid)
    # (a moment for the session to see its server gone: a request written in the instant
    # between the death and its noticing is in flight as far as anyone can tell)
    time.sleep(1.0)
    done = remote.env.reply(name, asked, "yes", key="restarted")
    assert done.ok and done.result == "deleted restarted", done
    (deleted,) = [
        e for e in entries(remote.ledger, "confirm_delete.deleted") if e["key"] == "restarted"
    ]
    assert deleted["state"] is False  # afresh: no state, the answer carried


def test_an_answer_that_may_have_been_sent_is_never_sent_again(remote: Remote) -> None:
    """I9, I10: the answer's sending is recorded (handle ``input:ROUND``) before it is sent;
    an attempt that finds that mark cannot tell what the server did."""
    name = "mcp__web__confirm_delete"
    asked = remote.env.run(name, key="marked")
    assert asked.asked is not None
    marked = asked.__class__(asked.outcome, None, handle=f"input:{asked.asked.state['round']}",
                             asked=asked.asked)  # fmt: skip
    done = remote.env.reply(name, marked, "yes", key="marked")
    assert done.outcome is Outcome.INTERRUPTED, done
    assert not [e for e in entries(remote.ledger, "confirm_delete.deleted") if e["key"] == "marked"]
    # resumed with nothing at all to go on: interrupted, and nothing is sent
    lost = remote.env.resume("mcp__web__delete_record", handle="", key="never")
    assert lost.outcome is Outcome.INTERRUPTED
    assert not [e for e in entries(remote.ledger, "delete.start") if e["key"] == "never"]


def test_a_call_whose_lease_is_lost_stops_waiting(remote: Remote) -> None:
    env = remote.env
    definition_ = remote.registry.get("mcp__web__lookup")
    assert definition_ is not None
    from charlie.tools.calling import run_handler
    from charlie.tools.context import ToolContext

    ctx = ToolContext(
        task_id="t", execution_id="x-t", call_id="c", turn=0, workspace=env.workspace or Path("."),
        metadata={}, resumed=False, handle=None, _record_handle=lambda h: None,
    )  # fmt: skip
    threading.Timer(0.5, ctx.lease_lost.set).start()
    started = time.monotonic()
    outcome, result = run_handler(definition_, {"key": "slow", "hold": 5}, ctx)
    assert time.monotonic() - started < 3
    assert outcome is Outcome.ERROR and result.get("lease_lost") is True


@pytest.mark.parametrize("server", SERVERS)
def test_a_task_is_a_wait_on_its_id_and_its_end_is_the_result(remote: Remote, server: str) -> None:
    name = f"mcp__{server}__slow_job"
    started = remote.env.run(name, key=f"t-{server}", seconds=0.5)
    assert started.pending is not None and started.handle
    assert started.handle.startswith("task:task-")
    assert started.pending.poll_after == 0.5  # the server's pollIntervalMs, bounded
    done = wait_for(
        lambda: (o := remote.env.resume(name, started.handle, key=f"t-{server}")).ok and o
    )
    assert done.result == f"job t-{server} done"
    # past its deadline, a look (I13) reports the task's end; an input round has no identity
    looked = remote.env.observe(name, started.handle, key=f"t-{server}")
    assert looked.ok and looked.result == f"job t-{server} done"
    assert remote.env.observe(name, "input:abc", key="x").pending is not None


def test_a_task_the_server_no_longer_knows_is_interrupted_never_called_again(
    remote: Remote,
) -> None:
    lost = remote.env.resume("mcp__web__slow_job", handle="task:task-forgotten", key="f")
    assert lost.outcome is Outcome.INTERRUPTED, lost
    assert "no longer knows the task" in lost.result["error"]
    assert not entries(remote.ledger, "slow_job.created") or all(
        e["key"] != "f" for e in entries(remote.ledger, "slow_job.created")
    )


def test_a_tasks_input_is_asked_once_and_cancel_sends_tasks_cancel(remote: Remote) -> None:
    name = "mcp__web__approve_job"
    started = remote.env.run(name, key="q1")
    asked = wait_for(lambda: (o := remote.env.resume(name, started.handle, key="q1")).asked and o)
    assert "Approve job q1?" in asked.asked.question
    answered = remote.env.reply(name, asked, "yes", key="q1")
    # answered, the task may still say input_required for a moment: nobody is asked again
    assert answered.asked is None
    done = (
        answered
        if answered.ok
        else wait_for(lambda: (o := remote.env.resume(name, answered.handle, key="q1")).ok and o)
    )
    assert done.result == "job q1 approved"
    updates = [e for e in entries(remote.ledger, "tasks/update") if e["keys"] == ["approve-q1"]]
    assert len(updates) == 1

    slow = remote.env.run("mcp__web__slow_job", key="c1", seconds=30)
    definition_ = remote.registry.get("mcp__web__slow_job")
    assert definition_ is not None and definition_.cancel is not None
    from charlie.tools.context import ToolContext

    ctx = ToolContext(
        task_id="t", execution_id="x-t", call_id="c", turn=0, workspace=Path("."), metadata={},
        resumed=True, handle=slow.handle, _record_handle=lambda h: None,
    )  # fmt: skip
    definition_.cancel(_charlie_ctx=ctx, key="c1", seconds=30)
    wait_for(lambda: entries(remote.ledger, "slow_job.cancelled"))
    cancelled = remote.env.resume("mcp__web__slow_job", slow.handle, key="c1", seconds=30)
    assert cancelled.outcome is Outcome.ERROR and "was cancelled" in cancelled.result["error"]
