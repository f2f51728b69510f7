"""A Pydantic AI agent as a Charlie task, through real workers (I34): its own OpenAIChatModel
against the session's fake Chat Completions server, a read tool, a write tool, a structured
output; SIGKILL in the write (I9, I10) and in a model request (I3); approvals by
``requires_approval`` and by the task's ``approve`` list (I23). An agent's MCP
server (tests/support/mcp_agents.py) through Charlie's MCP client, SIGKILLed during its write.
The agents are tests/support/agents.py; every real run of one of their tools is in the test
ledger."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

import pytest
from click.testing import CliRunner

import charlie
from charlie import api, cli
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster, McpServers
from tests.support.fake_openai import FakeOpenAI, Reply, chat_stream
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(180)

AGENT = "tests.support.agents:support"
DEPS = "tests.support.agents:make_deps"


def _runs(event: str, account: str) -> list[dict[str, Any]]:
    return [e for e in read_ledger() if e.get("event") == event and e.get("account") == account]


def _calls(*calls: tuple[str, str, dict[str, Any]]) -> Reply:
    """The model's answer, streamed as OpenAI streams it: with task events on (the default),
    an agent task's request is streamed for people watching."""
    return chat_stream(calls=[(i, n, json.dumps(a)) for i, n, a in calls])


def _final(account: str, cents: int) -> Reply:
    return _calls(("f", "final_result", {"account": account, "charged_cents": cents}))


def _tool_messages(body: dict[str, Any]) -> dict[str, str]:
    return {
        m["tool_call_id"]: m["content"] for m in body.get("messages", []) if m["role"] == "tool"
    }


def test_a_killed_write_runs_once_settles_interrupted_and_the_agent_is_told(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I9, I10: the agent's unmarked tool is a write; killed after its side effect it is never
    run again, settles interrupted, and the agent's model is shown so; its read ran, its
    structured output is the task's result (I34)."""
    account = f"acme-{uuid.uuid4().hex[:8]}"
    hold = cluster.ledger_path.parent / "agent-charge-hold"
    hold.touch()
    model_server.enqueue(
        _calls(("l", "lookup", {"account": account})),
        _calls(("c", "charge", {"account": account, "cents": 1200})),
        _final(account, 0),
    )
    try:
        task_id = charlie.submit("settle the account", agent=AGENT, deps=DEPS)
        charged = wait_for(lambda: _runs("agent.charge", account), timeout=60)
        call = next(c for c in api.calls(task_id) if c.call_id == "c")
        assert call.state == "started" and call.started_by  # I9: recorded before it acted
        cluster.kill_pid_group(int(charged[0]["pid"]))
    finally:
        hold.unlink(missing_ok=True)

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert json.loads(info.result["answer"]) == {"account": account, "charged_cents": 0}
    assert info.model.startswith("openai:gpt-4.1#agent=")
    calls = {c.call_id: c for c in api.calls(task_id)}
    assert calls["l"].effect == "read" and calls["l"].outcome == "ok"
    assert calls["c"].effect == "write" and calls["c"].outcome == "interrupted"
    assert len(_runs("agent.charge", account)) == 1  # never run again
    assert len(_runs("agent.lookup", account)) == 1
    bodies = model_server.bodies
    assert len(bodies) == 3
    first = bodies[0]["messages"]
    # the agent's own prompts (its instructions, its system prompt given the deps), not Charlie's
    assert any("EUR cents" in str(m.get("content")) for m in first if m["role"] == "system")
    assert not any("You are Charlie" in str(m.get("content")) for m in first)
    assert {t["function"]["name"] for t in bodies[0]["tools"]} >= {"lookup", "charge"}
    assert _tool_messages(bodies[1])["l"] == f"{account} owes 1200"
    assert "INTERRUPTED" in _tool_messages(bodies[2])["c"]  # the model is told
    assert info.model_calls == 3 and info.usage["input_tokens"] > 0
    assert_every_call_has_one_result(task_id)


def test_a_model_request_killed_in_flight_is_repeated_and_an_answered_one_is_not(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I3: the worker whose agent's second model request is in flight is killed: that request
    is sent again, the first (answered and recorded) is not, its tool not rerun."""
    account = f"kill-{uuid.uuid4().hex[:8]}"
    model_server.enqueue(
        _calls(("l", "lookup", {"account": account})),
        replace(_final(account, 5), delay=30),
        _final(account, 5),
    )
    task_id = charlie.submit("settle the account", agent=AGENT, deps=DEPS)
    wait_for(lambda: len(model_server.requests) >= 2, timeout=60)
    cluster.kill_pid_group(int(model_server.requests[1].headers["x-test-pid"]))

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert json.loads(info.result["answer"])["charged_cents"] == 5
    bodies = model_server.bodies
    answered = [b for b in bodies if not _tool_messages(b)]
    assert len(answered) == 1  # the recorded answer was not asked for again
    assert len(bodies) == 3 and info.model_repeats == 1
    assert len(_runs("agent.lookup", account)) == 1


def test_approvals_by_requires_approval_and_by_the_approve_list_hold_no_worker(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I23, I25: ``refund`` (requires_approval=True) and ``charge`` (on the task's approve
    list) wait for a person; the approved one runs once, the denied one never, and the
    agent's model sees both outcomes."""
    account = f"ask-{uuid.uuid4().hex[:8]}"
    model_server.enqueue(
        _calls(
            ("c", "charge", {"account": account, "cents": 300}),
            ("r", "refund", {"account": account, "cents": 300}),
        ),
        _final(account, 300),
    )
    task_id = charlie.submit("settle the account", agent=AGENT, deps=DEPS, approve=["charge"])
    waiting = wait_for(
        lambda: (
            (i := charlie.get_task(task_id)).status is TaskStatus.WAITING
            and len(i.waiting_for) == 2
            and i.waiting_for
        )
    )
    why = {w.call_id: (w.kind, w.detail.get("why")) for w in waiting}
    assert why == {
        "c": ("approval", "the task's approve list"),
        "r": ("approval", "the tool needs approval"),
    }
    assert not _runs("agent.charge", account) and not _runs("agent.refund", account)
    charlie.approve(task_id, "c")
    charlie.deny(task_id, "r", "no refunds today")

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(_runs("agent.charge", account)) == 1
    assert not _runs("agent.refund", account)
    seen = _tool_messages(model_server.bodies[1])
    assert seen["c"] == f"charged 300 EUR cents to {account}"
    assert "DENIED" in seen["r"] and "no refunds today" in seen["r"]


def test_an_agent_that_cannot_be_made_durable_is_refused_before_anything_is_written(
    cluster: Cluster,
) -> None:
    with pytest.raises(api.InvalidSubmission, match="no 'nothing'"):
        charlie.submit("x", agent="tests.support.agents:nothing")
    with pytest.raises(api.InvalidSubmission, match="approve names tool"):
        charlie.submit("x", agent=AGENT, approve=["delete_everything"])


def test_the_cli_and_a_celery_only_producer_submit_an_agent_task(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """`charlie submit --agent/--deps` and ``send_task("charlie.submit", kwargs={"agent":
    ...})`` start the same agent task as ``charlie.submit(agent=...)``; a refused agent is an
    error naming what is refused, and nothing is written."""
    from charlie.app import app

    model_server.enqueue(_final("cli", 1), _final("celery", 2))
    # in this process (its environment is the cluster's): a subprocess would import the
    # framework again, seconds on a loaded machine
    runner = CliRunner()
    done = runner.invoke(
        cli.main,
        [
            *("submit", "settle", "--agent", AGENT, "--deps", DEPS),
            *("--usage-limit", "request_limit=2", "--wait"),
        ],
    )
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[-1].startswith("succeeded: ")
    assert 'charged_cents\\":1' in done.output
    task_id = f"celery-{uuid.uuid4().hex[:8]}"
    app.send_task(
        "charlie.submit",
        kwargs={
            "prompt": "settle",
            "agent": AGENT,
            "deps": DEPS,
            "usage_limits": {"request_limit": 2, "tool_calls_limit": 1},
        },
        task_id=task_id,
    )
    info = wait_for(lambda: _terminal(task_id), timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert json.loads(info.result["answer"]) == {"account": "celery", "charged_cents": 2}
    refused = runner.invoke(cli.main, ["submit", "x", "--agent", f"{AGENT}_nope"])
    assert refused.exit_code != 0 and "has no 'support_nope'" in refused.output


def test_usage_limits_end_the_task_before_the_request_past_them(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """Pydantic AI's UsageLimits, given at submit, are checked before each request from the
    task's transcript: the request past request_limit is never sent, the task fails naming
    the limit as agent.run's UsageLimitExceeded does."""
    from pydantic_ai.usage import UsageLimits

    account = f"limit-{uuid.uuid4().hex[:8]}"
    model_server.enqueue(_calls(("l", "lookup", {"account": account})))
    task_id = charlie.submit(
        "settle the account", agent=AGENT, deps=DEPS, usage_limits=UsageLimits(request_limit=1)
    )
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.FAILED
    assert "UsageLimitExceeded" in str(info.error) and "request_limit of 1" in str(info.error)
    assert len(_runs("agent.lookup", account)) == 1
    assert len(model_server.bodies) == 1  # the second request was never sent
    assert info.model.endswith("&usage_limits=request_limit:1")


def test_a_failed_agent_task_resumes_and_a_fork_at_a_turn_finishes_nothing_repeated(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I26, I34: an agent task failed by its model (a 400) is resumed: the request is sent
    again and the task ends with the agent's output, its read and write not run again; a fork
    of it at its first turn starts from the copied transcript (the read's result, never run
    again) and ends with the agent's output too."""
    account = f"again-{uuid.uuid4().hex[:8]}"
    refused = Reply(status=400, body={"error": {"message": "no", "type": "invalid_request"}})
    model_server.enqueue(
        _calls(("l", "lookup", {"account": account})),
        _calls(("c", "charge", {"account": account, "cents": 1200})),
        refused,
    )
    task_id = charlie.submit("settle the account", agent=AGENT, deps=DEPS)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.FAILED, info.error
    model_server.enqueue(_final(account, 1200))
    charlie.resume(task_id)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert json.loads(info.result["answer"]) == {"account": account, "charged_cents": 1200}
    assert len(_runs("agent.lookup", account)) == 1
    assert len(_runs("agent.charge", account)) == 1
    resent = model_server.bodies[-1]
    assert _tool_messages(resent)["c"] == f"charged 1200 EUR cents to {account}"

    model_server.enqueue(_final(account, 7))
    fork_id = charlie.fork(task_id, turn=0, message="charge 7 instead")
    forked = charlie.wait(fork_id, timeout=90)
    assert forked.status is TaskStatus.SUCCEEDED, forked.error
    assert json.loads(forked.result["answer"]) == {"account": account, "charged_cents": 7}
    first = model_server.bodies[-1]
    assert _tool_messages(first) == {"l": f"{account} owes 1200"}  # copied, not run again
    assert any(m.get("content") == "charge 7 instead" for m in first["messages"])
    assert len(_runs("agent.lookup", account)) == 1
    assert len(_runs("agent.charge", account)) == 1
    assert_every_call_has_one_result(task_id)
    assert_every_call_has_one_result(fork_id)


def _terminal(task_id: str) -> Any:
    try:
        info = charlie.get_task(task_id)
    except api.TaskNotFound:
        return None
    return info if info.terminal else None


MCP_AGENT = "tests.support.mcp_agents:with_mcp"


def _mcp_ran(servers: McpServers, event: str, key: str) -> int:
    if not servers.ledger.exists():
        return 0
    rows = [json.loads(line) for line in servers.ledger.read_text().splitlines() if line.strip()]
    return len([r for r in rows if r["event"] == event and r.get("key") == key])


def test_an_agents_mcp_write_killed_mid_call_runs_once_settles_interrupted_and_is_told(
    cluster: Cluster, model_server: FakeOpenAI, agent_mcp_server: McpServers
) -> None:
    """I9, I10, I34: the agent's MCP server (an MCPToolset, prefixed ``rec``) is called through
    Charlie's MCP client: its read-only ``lookup`` is a read, ``delete_record`` a write; the
    worker is SIGKILLed while the server runs the write: it was recorded before it was sent,
    is never sent again (the server's own ledger), settles interrupted, and the model is told."""
    key = uuid.uuid4().hex[:8]
    model_server.enqueue(
        _calls(("l", "rec_lookup", {"key": key})),
        _calls(("d", "rec_delete_record", {"key": key, "hold": 20})),
        chat_stream(text="could not tell whether it was deleted"),
    )
    task_id = charlie.submit("delete the record", agent=MCP_AGENT)
    wait_for(lambda: _mcp_ran(agent_mcp_server, "delete.start", key), timeout=90)
    call = next(c for c in api.calls(task_id) if c.call_id == "d")
    assert call.state == "started" and call.started_by  # I9: recorded before it was sent
    cluster.kill_pid_group(int(call.started_by.rsplit(":", 1)[1]))

    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "could not tell whether it was deleted"
    calls = {c.call_id: c for c in api.calls(task_id)}
    assert calls["l"].effect == "read" and calls["l"].outcome == "ok"
    assert calls["d"].effect == "write" and calls["d"].outcome == "interrupted"
    assert _mcp_ran(agent_mcp_server, "lookup", key) == 1
    assert _mcp_ran(agent_mcp_server, "delete.start", key) == 1  # never sent again
    bodies = model_server.bodies
    assert {t["function"]["name"] for t in bodies[0]["tools"]} >= {
        "rec_lookup",
        "rec_delete_record",
    }
    assert _tool_messages(bodies[1])["l"] == f"{key}=v-{key}"
    assert "INTERRUPTED" in _tool_messages(bodies[2])["d"]  # the model is told
    assert_every_call_has_one_result(task_id)


def test_an_agents_mcp_read_killed_mid_call_is_not_sent_again_either(
    cluster: Cluster, model_server: FakeOpenAI, agent_mcp_server: McpServers
) -> None:
    """I10: a read of the agent's MCP server (its readOnlyHint) whose worker is SIGKILLed while
    the server runs it is, like any started call without a result (and like the fleet's MCP
    reads), not sent again: it settles interrupted and the model is told."""
    key = uuid.uuid4().hex[:8]
    model_server.enqueue(
        _calls(("l", "rec_lookup", {"key": key, "hold": 20})),
        chat_stream(text="will look again"),
    )
    task_id = charlie.submit("look the record up", agent=MCP_AGENT)
    wait_for(lambda: _mcp_ran(agent_mcp_server, "lookup", key), timeout=90)
    call = next(c for c in api.calls(task_id) if c.call_id == "l")
    assert call.state == "started" and call.started_by
    cluster.kill_pid_group(int(call.started_by.rsplit(":", 1)[1]))

    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (read,) = api.calls(task_id)
    assert read.effect == "read" and read.outcome == "interrupted"
    assert _mcp_ran(agent_mcp_server, "lookup", key) == 1
    assert "INTERRUPTED" in _tool_messages(model_server.bodies[1])["l"]
    assert_every_call_has_one_result(task_id)


def _replace_every_worker(cluster: Cluster) -> None:
    """SIGKILL every worker (their pool processes too) and start fresh ones: none of them has
    met the agent (its module is not in CHARLIE_TOOL_MODULES), so whichever takes the waiting
    call up registers the agent's tools by the call's recorded name first."""
    with cluster._lock:  # no worker restarted before all are dead
        for worker in list(cluster.alive_workers()):
            cluster.kill(worker)
    cluster.ensure(workers=2, beat=True)


def _parked_on_task(task_id: str, call_id: str) -> bool:
    from tests.mcp.test_tasks import parked_on_task

    return parked_on_task(task_id, call_id)


def _server_ran(servers: McpServers, event: str, key: str | None) -> list[dict[str, Any]]:
    """The agent's MCP server's ledger entries of ``event`` (for ``key``; None: all)."""
    from tests.mcp.test_cluster import entries

    return entries(servers, event, key)


def test_an_agents_mcp_tool_answered_with_a_task_is_followed_by_its_id_holding_no_worker(
    cluster: Cluster, model_server: FakeOpenAI, agent_mcp_server: McpServers
) -> None:
    """I20, I25, I34: the agent's MCP server answers ``rec_slow_job`` with an MCP task: its id
    is the call's handle, the call parks holding no worker and no lease (every worker is
    replaced meanwhile), fresh workers poll ``tasks/get`` by that id, and the task's result
    reaches the agent's model, which ends the run with it: the task's result is the agent's
    output. The job ran once, and no take-over was refused."""
    from tests.mcp.test_cluster import call_row

    key = uuid.uuid4().hex[:8]
    model_server.enqueue(
        _calls(("j", "rec_slow_job", {"key": key, "seconds": 4})),
        chat_stream(text=f"the job said: job {key} done"),
    )
    task_id = charlie.submit("run the job", agent=MCP_AGENT)
    wait_for(lambda: _parked_on_task(task_id, "j"), timeout=90)  # no worker holds it (I25)
    (created,) = _server_ran(agent_mcp_server, "slow_job.created", key)
    assert call_row(task_id, "j").handle == f"task:{created['task_id']}"
    assert charlie.get_task(task_id).status is not TaskStatus.SUCCEEDED
    _replace_every_worker(cluster)

    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == f"the job said: job {key} done"
    polls = [
        e
        for e in _server_ran(agent_mcp_server, "tasks/get", None)
        if e["task_id"] == created["task_id"]
    ]
    assert polls and polls[-1]["status"] == "completed"
    assert len(_server_ran(agent_mcp_server, "slow_job.start", key)) == 1  # ran once
    (call,) = api.calls(task_id)
    assert call.effect == "write" and call.outcome == "ok", call.result
    assert call.handle == f"task:{created['task_id']}"
    bodies = model_server.bodies
    assert len(bodies) == 2  # no model request while the job ran
    assert _tool_messages(bodies[1])["j"] == f"job {key} done"  # the model saw its result
    assert_every_call_has_one_result(task_id)


@pytest.mark.parametrize("tool", ["confirm_delete", "approve_job"])
def test_an_agents_mcp_server_asking_a_question_waits_for_a_person_holding_no_worker(
    cluster: Cluster, model_server: FakeOpenAI, agent_mcp_server: McpServers, tool: str
) -> None:
    """I23-I25, I34: the agent's MCP server asks a question (``confirm_delete``: a form
    elicitation, ``input_required`` on the call; ``approve_job``: an MCP task's
    ``input_required``): the task waits for a person, the call holds no worker and no lease
    (every worker is replaced meanwhile); a reply through the public API is sent to the
    server by a fresh worker that never met the agent, the tool completes once, and the
    agent's model sees its result."""
    from tests.mcp.test_cluster import call_row

    key = uuid.uuid4().hex[:8]
    done = f"deleted {key}" if tool == "confirm_delete" else f"job {key} approved"
    question = f"Really delete {key}?" if tool == "confirm_delete" else f"Approve job {key}?"
    model_server.enqueue(
        _calls(("q", f"rec_{tool}", {"key": key})),
        chat_stream(text=f"the server said: {done}"),
    )
    task_id = charlie.submit("ask first", agent=MCP_AGENT)
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=90)
    assert info.status is TaskStatus.WAITING
    (waiting,) = info.waiting_for
    assert waiting.kind == "reply" and waiting.call_id == "q"
    assert question in waiting.detail["question"]
    row = call_row(task_id, "q")
    assert (row.state, row.hold, row.lease_owner) == ("started", "reply", None)  # I25
    assert len(model_server.bodies) == 1
    _replace_every_worker(cluster)

    record = charlie.reply(task_id, "q", "yes", operator="ana")
    assert record.detail and record.detail.get("resumes") is True
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == f"the server said: {done}"
    if tool == "confirm_delete":
        assert len(_server_ran(agent_mcp_server, "confirm_delete.asked", key)) == 1
        assert len(_server_ran(agent_mcp_server, "confirm_delete.deleted", key)) == 1
    else:
        (answered,) = _server_ran(agent_mcp_server, "approve_job.answered", key)
        assert answered["approved"] is True
    (call,) = api.calls(task_id)
    # answered on a tools/call retry (its sending recorded first), or with tasks/update
    assert call.outcome == "ok", call.result
    assert (call.handle or "").startswith("input:" if tool == "confirm_delete" else "task")
    bodies = model_server.bodies
    assert len(bodies) == 2
    assert _tool_messages(bodies[1])["q"] == done  # the model saw the completed tool
    assert_every_call_has_one_result(task_id)


@pytest.mark.recovery
def test_an_agents_mcp_task_is_polled_by_its_id_across_a_worker_kill(
    cluster: Cluster, model_server: FakeOpenAI, agent_mcp_server: McpServers
) -> None:
    """I10, I19, I20: the worker that polled the agent's MCP task is SIGKILLed right after a
    poll: another attempt polls the same task id through the agent's graph; the tool is never
    called again, and the model sees the job's result."""
    key = uuid.uuid4().hex[:8]
    cluster.set_faults(
        {
            "mcp.after_poll": {
                "action": "kill",
                "times": 1,
                "match": {"tool": "slow_job", "status": "working"},
            }
        }
    )
    model_server.enqueue(
        _calls(("j", "rec_slow_job", {"key": key, "seconds": 6})),
        chat_stream(text="done"),
    )
    task_id = charlie.submit("run the job, a kill", agent=MCP_AGENT)
    info = charlie.wait(task_id, timeout=150)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("mcp.after_poll") == 1
    assert len(_server_ran(agent_mcp_server, "slow_job.created", key)) == 1  # never sent again
    assert len(_server_ran(agent_mcp_server, "slow_job.end", key)) == 1
    (call,) = api.calls(task_id)
    assert call.outcome == "ok" and (call.handle or "").startswith("task:")
    assert _tool_messages(model_server.bodies[-1])["j"] == f"job {key} done"
    assert_every_call_has_one_result(task_id)
