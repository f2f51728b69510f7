"""MCP tools through real workers: the cluster's workers are configured with the MCP
test servers (tests/support/cluster.py McpServers): ``files`` over stdio, ``web`` and
``web_strict`` over streamable HTTP, ``flaky`` (stopped by a test), ``down`` and ``broken``.
Side effects are counted in the servers' own ledger, outside Charlie."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import charlie
from charlie import api
from charlie.domain import TaskStatus, execution_id_for
from tests.conftest import MCP_PROCESSES, wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import (
    MCP_HTTP_TOKEN,
    MCP_STDIO_TOKEN,
    REPO,
    Cluster,
    McpServers,
    kill_mcp_server,
)

pytestmark = [pytest.mark.timeout(180)]


def tid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


def entries(servers: McpServers, event: str, key: str | None = None) -> list[dict[str, Any]]:
    if not servers.ledger.exists():
        return []
    rows = [json.loads(line) for line in servers.ledger.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["event"] == event and (key is None or r.get("key") == key)]


def result(call_id: str, outcome: str, contains: str | None = None) -> dict[str, str]:
    """What a scripted model expects of one tool result."""
    wanted = {"call_id": call_id, "outcome": outcome}
    return {**wanted, "contains": contains} if contains else wanted


def call_row(task_id: str, call_id: str) -> Any:
    from charlie.runtime import get_producer
    from charlie.store.engine import read
    from charlie.store.schema import tool_calls as t

    with read(get_producer().engine) as conn:
        return conn.execute(
            select(
                t.c.state, t.c.hold, t.c.hold_info, t.c.lease_owner, t.c.lease_until, t.c.handle
            ).where(t.c.execution_id == execution_id_for(task_id), t.c.call_id == call_id)
        ).first()


def worker_pid_of_server(pid: int) -> int:
    """The worker process whose stdio MCP server ``pid`` is (its parent)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def kill_worker_of_call(cluster: Cluster, task_id: str, call_id: str) -> None:
    (call,) = [c for c in charlie.calls(task_id) if c.call_id == call_id]
    assert call.started_by is not None
    cluster.kill_pid_group(int(call.started_by.rsplit(":", 1)[1]))


def wait_until_workers_listed(cluster: Cluster, server: str) -> None:
    """Until every live worker's main process has listed ``server``'s tools (its pool
    processes inherit them), as its log says."""

    def log_of(worker: subprocess.Popen[bytes]) -> Path:
        args = [str(a) for a in worker.args]  # type: ignore[union-attr]
        return cluster.home / f"worker-{args[args.index('-n') + 1].split('@')[0]}.log"

    def listed() -> bool:
        logs = [log_of(w).read_text(errors="replace") for w in cluster.alive_workers()]
        return bool(logs) and all(
            f"MCP server {server} ready" in text or f"MCP server {server} is back" in text
            for text in logs
        )

    wait_for(listed, timeout=60)


def run_charlie(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "charlie", *args],
        env=cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("server", ["files", "web"])
def test_a_read_and_a_destructive_tool_through_real_workers(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    key = uuid.uuid4().hex[:8]
    read, write = f"mcp__{server}__lookup", f"mcp__{server}__delete_record"
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "r", "name": read, "arguments": {"key": key}},
                    {"id": "w", "name": write, "arguments": {"key": key}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "r", "contains": f"{key}=v-{key}", "outcome": "ok"},
                        {"call_id": "w", "contains": f"deleted {key}", "outcome": "ok"},
                    ]
                },
                "say": "done",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("read then delete", model=model, tools=[read, write], task_id=tid())
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert_every_call_has_one_result(task_id)
    assert len(entries(mcp_servers, "delete.start", key)) == 1
    assert len(entries(mcp_servers, "lookup", key)) == 1
    calls = {c.call_id: c for c in charlie.calls(task_id)}
    assert calls["r"].effect == "read" and calls["w"].effect == "write"


def test_each_worker_process_starts_its_stdio_server_on_its_first_call_and_keeps_it(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """A stdio server is started by the pool process that calls it (not
    inherited from the main process's listing) and serves that process's later calls: eight
    calls over at most four pool processes, so some process makes two or more."""
    keys = [uuid.uuid4().hex[:8] for _ in range(8)]
    tool = "mcp__files__lookup"

    def turn(part: list[str]) -> list[dict[str, Any]]:
        return [{"id": k, "name": tool, "arguments": {"key": k}} for k in part]

    model, _ = script(
        [
            {"tool_calls": turn(keys[:4])},
            {"tool_calls": turn(keys[4:])},
            {"say": "looked", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("look eight times", model=model, tools=[tool], task_id=tid())
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    servers_of: dict[int, set[int]] = {}
    for call in charlie.calls(task_id):
        assert call.outcome == "ok" and call.started_by is not None
        worker = int(call.started_by.rsplit(":", 1)[1])
        (looked,) = entries(mcp_servers, "lookup", call.call_id)
        assert looked["ppid"] == worker, (looked, call.started_by)  # its own child
        servers_of.setdefault(worker, set()).add(int(looked["pid"]))
    assert sum(len(s) for s in servers_of.values()) == len(servers_of), servers_of  # one each
    calls_of = [c.started_by for c in charlie.calls(task_id)]
    assert max(calls_of.count(c) for c in calls_of) >= 2  # (so one was reused)


def test_submit_checks_mcp_tool_names(cluster: Cluster, mcp_servers: McpServers, script) -> None:
    model, _ = script([{"say": "x", "tool_calls": []}])
    with pytest.raises(api.UnknownToolError, match="mcp__files__nope"):
        charlie.submit("x", model=model, tools=["mcp__files__nope"])
    # a server that was down when this process listed the servers: its tools are unknown here
    with pytest.raises(api.UnknownToolError, match="CHARLIE_MCP_CONFIG"):
        charlie.submit("x", model=model, tools=["mcp__down__lookup"])


@pytest.mark.recovery
@pytest.mark.parametrize("server", ["files", "web"])
def test_a_worker_killed_during_the_destructive_call_leaves_one_execution_and_interrupted(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    """I9, I10: marked started before it was sent; killed mid-call, it settles interrupted
    (the model is told) and is never sent again: the server's ledger has one execution."""
    key = uuid.uuid4().hex[:8]
    write = f"mcp__{server}__delete_record"
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": write, "arguments": {"key": key, "hold": 20}}]},
            {
                "expect": {"tool_results": [{"call_id": "w", "outcome": "interrupted"}]},
                "say": "told",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("delete", model=model, tools=[write], task_id=tid())
    wait_for(lambda: entries(mcp_servers, "delete.start", key), timeout=60)
    kill_worker_of_call(cluster, task_id, "w")
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted", call.result
    assert call.result["implementation"] == f"mcp:{server}:delete_record"
    time.sleep(1)
    assert len(entries(mcp_servers, "delete.start", key)) == 1
    assert_every_call_has_one_result(task_id)


@pytest.mark.recovery
def test_a_held_mcp_write_killed_mid_call_waits_for_an_operator(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """web_strict ignores its server's hints (``lookup`` is a write there) and holds
    interrupted calls (``on_interrupt: hold``): killed mid-call, it is held, the model is not
    told until an operator decides; ``done`` settles it with the operator's result."""
    key = uuid.uuid4().hex[:8]
    tool = "mcp__web_strict__lookup"
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": tool, "arguments": {"key": key, "hold": 20}}]},
            {
                "expect": {
                    "tool_results": [{"call_id": "w", "contains": "by hand", "outcome": "ok"}]
                },
                "say": "ok",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("held", model=model, tools=[tool], task_id=tid())
    wait_for(lambda: entries(mcp_servers, "lookup", key), timeout=60)
    kill_worker_of_call(cluster, task_id, "w")
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    assert info.status is TaskStatus.WAITING
    (waiting,) = info.waiting_for
    assert waiting.kind == "reconcile" and waiting.tool == tool
    charlie.reconcile(task_id, "w", "done", result={"value": "checked by hand"})
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(entries(mcp_servers, "lookup", key)) == 1


@pytest.mark.parametrize("server", ["files", "web"])
def test_a_tool_that_asks_for_input_waits_for_charlie_reply(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    """input_required parks the call asking a person: the task is waiting (for what: the
    server's question), the call holds no worker and no lease (I25); the reply resumes it
    with the answer, once (I23, I24); the server acts once."""
    key = uuid.uuid4().hex[:8]
    tool = f"mcp__{server}__confirm_delete"
    model, _ = script(
        [
            {"tool_calls": [{"id": "c", "name": tool, "arguments": {"key": key}}]},
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "c", "contains": f"deleted {key}", "outcome": "ok"}
                    ]
                },
                "say": "deleted",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("confirm", model=model, tools=[tool], task_id=tid())
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    assert info.status is TaskStatus.WAITING
    (waiting,) = info.waiting_for
    assert waiting.kind == "reply" and waiting.call_id == "c"
    assert f"Really delete {key}?" in waiting.detail["question"]
    row = call_row(task_id, "c")
    assert (row.state, row.hold, row.lease_owner, row.lease_until) == (
        "started",
        "reply",
        None,
        None,
    )
    assert entries(mcp_servers, "confirm_delete.asked", key)
    assert not entries(mcp_servers, "confirm_delete.deleted", key)

    record = charlie.reply(task_id, "c", "yes", operator="ana")
    assert record.detail and record.detail.get("resumes") is True
    with pytest.raises(api.VerdictConflict, match="reply by ana"):
        charlie.reply(task_id, "c", "no")
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(entries(mcp_servers, "confirm_delete.deleted", key)) == 1
    (call,) = charlie.calls(task_id)
    assert call.outcome == "ok" and call.handle and call.handle.startswith("input:")
    assert_every_call_has_one_result(task_id)


@pytest.mark.recovery
def test_a_worker_killed_while_the_answer_is_acted_on_is_interrupted_not_repeated(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """I9, I10: the answer's sending is recorded before it is sent; the worker dies while the
    server acts on it; the call is resumed (it is a resumable wait since it parked), finds the
    mark, and settles interrupted. The server deleted once."""
    key = uuid.uuid4().hex[:8]
    tool = "mcp__files__confirm_delete"
    model, _ = script(
        [
            {"tool_calls": [{"id": "c", "name": tool, "arguments": {"key": key, "hold": 20}}]},
            {
                "expect": {"tool_results": [{"call_id": "c", "outcome": "interrupted"}]},
                "say": "told",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("confirm, killed", model=model, tools=[tool], task_id=tid())
    wait_for(lambda: charlie.get_task(task_id).waiting_for, timeout=60)
    charlie.reply(task_id, "c", "yes")
    (deleted,) = wait_for(lambda: entries(mcp_servers, "confirm_delete.deleted", key), timeout=60)
    cluster.kill_pid_group(worker_pid_of_server(int(deleted["pid"])))
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted", call.result
    assert len(entries(mcp_servers, "confirm_delete.deleted", key)) == 1


def test_a_server_that_is_down_is_a_clear_tool_error_never_a_hang(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """The ``flaky`` HTTP server stops after the workers listed its tools: a read and a write
    are tool errors saying the call was not sent (nothing was), within seconds."""
    key = uuid.uuid4().hex[:8]
    flaky = MCP_PROCESSES["flaky"]
    flaky.send_signal(signal.SIGKILL)
    flaky.wait()
    read, write = "mcp__flaky__lookup", "mcp__flaky__delete_record"
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "r", "name": read, "arguments": {"key": key}},
                    {"id": "w", "name": write, "arguments": {"key": key}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "r", "contains": "is unavailable", "outcome": "error"},
                        {"call_id": "w", "contains": "was not sent", "outcome": "error"},
                    ]
                },
                "say": "the server is down",
                "tool_calls": [],
            },
        ]
    )
    started = time.monotonic()
    task_id = charlie.submit("down", model=model, tools=[read, write], task_id=tid())
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert time.monotonic() - started < 60
    assert not entries(mcp_servers, "delete.start", key)


def test_a_stdio_server_that_cannot_start_is_a_clear_tool_error(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    key = uuid.uuid4().hex[:8]
    write = "mcp__files__delete_record"
    # this process and every worker list the server's tools while it is up (run alone, this
    # test would otherwise find the tool unknown, the server refusing to start by then)
    assert not api.unknown_tools([write], ())
    wait_until_workers_listed(cluster, "files")
    mcp_servers.down_flag.touch()
    try:
        # the servers running now die; the next call starts one, which refuses to start
        for started in entries(mcp_servers, "server.start"):
            if started["server"] == "files":
                kill_mcp_server(int(started["pid"]))
        time.sleep(1.0)
        model, _ = script(
            [
                {"tool_calls": [{"id": "w", "name": write, "arguments": {"key": key}}]},
                {
                    "expect": {
                        "tool_results": [
                            {"call_id": "w", "contains": "is unavailable", "outcome": "error"}
                        ]
                    },
                    "say": "down",
                    "tool_calls": [],
                },
            ]
        )
        task_id = charlie.submit("stdio down", model=model, tools=[write], task_id=tid())
        info = charlie.wait(task_id, timeout=90)
        assert info.status is TaskStatus.SUCCEEDED, info.error
    finally:
        mcp_servers.down_flag.unlink()
    assert not entries(mcp_servers, "delete.start", key)


def test_charlie_tools_lists_every_tool_with_its_recovery_and_source(
    cluster: Cluster, mcp_servers: McpServers
) -> None:
    """Overrides and ignore_hints as the operator configured them, next to the
    built-in and user tools."""
    done = run_charlie(cluster, "tools", "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    tools = {t["name"]: t for t in listed["tools"]}
    assert tools["read_file"]["source"] == "built-in"
    assert tools["ledger_write"]["source"] == "user"
    assert tools["wait_for_task"]["resumable"] == "yes"
    # whose calls a turn may run at once in one worker: built-ins, MCP tools, and
    # user tools that say so
    assert tools["read_file"]["threadsafe"] is True
    assert tools["ledger_write"]["threadsafe"] is True
    assert tools["fail_politely"]["threadsafe"] is False
    assert tools["mcp__files__lookup"] == {
        **tools["mcp__files__lookup"],
        "effect": "read",
        "approval": False,
        "resumable": "once parked",
        "source": "mcp:files",
        "implementation": "mcp:files:lookup",
        "threadsafe": True,
    }
    assert tools["mcp__files__unhinted"]["effect"] == "read"  # the operator's override
    assert tools["mcp__web__unhinted"]["effect"] == "write"  # no hint: a write
    assert tools["mcp__web_strict__lookup"]["effect"] == "write"  # hints ignored
    assert tools["mcp__web_strict__lookup"]["on_interrupt"] == "hold"
    assert tools["mcp__web_strict__delete_record"]["approval"] is True
    assert tools["mcp__files__confirm_delete"]["deadline"] == 60
    servers = {s["name"]: s for s in listed["mcp_servers"]}
    assert servers["down"]["problem"] and servers["broken"]["problem"]
    assert "off" not in servers  # disabled
    text = run_charlie(cluster, "tools")
    assert text.returncode == 0 and "mcp__web__delete_record" in text.stdout


def test_an_approval_override_holds_the_mcp_call_until_approved(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    key = uuid.uuid4().hex[:8]
    tool = "mcp__web_strict__delete_record"
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": tool, "arguments": {"key": key}}]},
            {
                "expect": {
                    "tool_results": [{"call_id": "w", "contains": "deleted", "outcome": "ok"}]
                },
                "say": "done",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("approve", model=model, tools=[tool], task_id=tid())
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    assert info.waiting_for[0].kind == "approval"
    time.sleep(1)
    assert not entries(mcp_servers, "delete.start", key)  # I23
    charlie.approve(task_id, "w")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(entries(mcp_servers, "delete.start", key)) == 1


def test_secrets_in_the_config_reach_no_log_transcript_or_doctor(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "mcp__files__leak", "arguments": {}},
                    {"id": "b", "name": "mcp__web__leak", "arguments": {}},
                    {"id": "c", "name": "mcp__down__lookup", "arguments": {"key": "x"}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "a", "contains": "the token is ***", "outcome": "ok"},
                        {"call_id": "b", "contains": "the token is ***", "outcome": "ok"},
                        {"call_id": "c", "outcome": "error"},
                    ]
                },
                "say": "no secrets here",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("leak", model=model, task_id=tid())
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    doctor = run_charlie(cluster, "doctor", "--json")
    assert '"mcp:files"' in doctor.stdout and '"mcp:down"' in doctor.stdout
    shown = [
        json.dumps([i.payload for i in charlie.transcript(task_id)]),
        json.dumps([c.result for c in charlie.calls(task_id)], default=str),
        doctor.stdout + doctor.stderr,
        run_charlie(cluster, "tools").stdout,
        run_charlie(cluster, "show", task_id).stdout,
        cluster.logs(),
        *(p.read_text(errors="replace") for p in cluster.home.glob("*.log")),
    ]
    for text in shown:
        assert MCP_STDIO_TOKEN not in text
        assert MCP_HTTP_TOKEN not in text
