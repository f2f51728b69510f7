"""MCP tasks through real workers (I10, I12, I19-I20, I23-I25): a call the
server answers with a task is a resumable wait whose handle is the task's id. It parks holding
no worker, any worker polls it by that id (after a SIGKILL too), Charlie's cancel sends
tasks/cancel, and a task's input_required is a question to a person, answered with charlie
reply and sent with tasks/update. The test servers keep their tasks as files, as an outside job
system would, so a stdio server another worker process started follows them too."""

from __future__ import annotations

import uuid

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.mcp.test_cluster import call_row, entries, result, tid
from tests.support.cluster import Cluster, McpServers

pytestmark = [pytest.mark.timeout(180)]


def parked_on_task(task_id: str, call_id: str) -> bool:
    row = call_row(task_id, call_id)
    return bool(
        row is not None
        and row.state == "started"
        and (row.handle or "").startswith("task:")
        and row.lease_owner is None
    )


@pytest.mark.parametrize("server", ["files", "web"])
def test_a_task_parks_without_a_worker_and_is_polled_by_its_id(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    key = uuid.uuid4().hex[:8]
    tool = f"mcp__{server}__slow_job"
    model, _ = script(
        [
            {"tool_calls": [{"id": "j", "name": tool, "arguments": {"key": key, "seconds": 4}}]},
            {
                "expect": {"tool_results": [result("j", "ok", f"job {key} done")]},
                "say": "done",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("a job", model=model, tools=[tool], task_id=tid())
    wait_for(lambda: parked_on_task(task_id, "j"), timeout=60)  # no worker holds it (I25)
    (created,) = entries(mcp_servers, "slow_job.created", key)
    assert call_row(task_id, "j").handle == f"task:{created['task_id']}"
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    polls = [e for e in entries(mcp_servers, "tasks/get") if e["task_id"] == created["task_id"]]
    assert polls and polls[-1]["status"] == "completed"
    assert len(entries(mcp_servers, "slow_job.start", key)) == 1  # the job ran once
    (call,) = charlie.calls(task_id)
    assert call.outcome == "ok" and call.handle == f"task:{created['task_id']}"
    assert_every_call_has_one_result(task_id)


@pytest.mark.recovery
def test_a_task_is_polled_by_its_id_across_a_worker_kill(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """SIGKILL right after a poll (the worker that polled holds the call's lease): the sweep
    finds the lapsed lease of a resumable wait and another attempt polls the same task id;
    nothing calls the tool again (I10, I19-I20)."""
    key = uuid.uuid4().hex[:8]
    tool = "mcp__web__slow_job"
    cluster.set_faults(
        {
            "mcp.after_poll": {
                "action": "kill",
                "times": 1,
                "match": {"tool": "slow_job", "status": "working"},
            }
        }
    )
    model, _ = script(
        [
            {"tool_calls": [{"id": "j", "name": tool, "arguments": {"key": key, "seconds": 6}}]},
            {
                "expect": {"tool_results": [result("j", "ok", f"job {key} done")]},
                "say": "done",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("a job, a kill", model=model, tools=[tool], task_id=tid())
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("mcp.after_poll") == 1
    assert len(entries(mcp_servers, "slow_job.created", key)) == 1  # never called again
    assert len(entries(mcp_servers, "slow_job.end", key)) == 1
    (call,) = charlie.calls(task_id)
    assert call.outcome == "ok" and (call.handle or "").startswith("task:")


@pytest.mark.recovery
def test_a_worker_killed_before_the_task_call_parked_is_interrupted_with_its_task_id(
    cluster: Cluster, mcp_servers: McpServers, script
) -> None:
    """Killed after the server created the task and its id was recorded, before the park made
    the call a resumable wait: an interrupted write (I10), its evidence naming the task."""
    key = uuid.uuid4().hex[:8]
    tool = "mcp__web__slow_job"
    cluster.set_faults(
        {"mcp.task_created": {"action": "kill", "times": 1, "match": {"tool": "slow_job"}}}
    )
    model, _ = script(
        [
            {"tool_calls": [{"id": "j", "name": tool, "arguments": {"key": key, "seconds": 1}}]},
            {
                "expect": {"tool_results": [result("j", "interrupted")]},
                "say": "told",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("a job, killed early", model=model, tools=[tool], task_id=tid())
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (created,) = entries(mcp_servers, "slow_job.created", key)
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted"
    assert call.result["handle"] == f"task:{created['task_id']}"


@pytest.mark.parametrize("server", ["files", "web"])
def test_charlies_cancel_sends_tasks_cancel(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    key = uuid.uuid4().hex[:8]
    tool = f"mcp__{server}__slow_job"
    model, _ = script(
        [
            {"tool_calls": [{"id": "j", "name": tool, "arguments": {"key": key, "seconds": 60}}]},
            {"say": "never", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("a long job", model=model, tools=[tool], task_id=tid())
    wait_for(lambda: parked_on_task(task_id, "j"), timeout=60)
    (created,) = entries(mcp_servers, "slow_job.created", key)
    charlie.cancel(task_id)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.CANCELED
    wait_for(
        lambda: [
            e for e in entries(mcp_servers, "tasks/cancel") if e["task_id"] == created["task_id"]
        ],
        timeout=30,
    )
    wait_for(lambda: entries(mcp_servers, "slow_job.cancelled", key), timeout=30)
    (call,) = charlie.calls(task_id)
    assert call.outcome == "canceled"
    assert not entries(mcp_servers, "slow_job.end", key)


@pytest.mark.parametrize("server", ["files", "web"])
def test_a_tasks_input_required_is_a_question_answered_with_tasks_update(
    cluster: Cluster, mcp_servers: McpServers, script, server: str
) -> None:
    key = uuid.uuid4().hex[:8]
    tool = f"mcp__{server}__approve_job"
    model, _ = script(
        [
            {"tool_calls": [{"id": "j", "name": tool, "arguments": {"key": key}}]},
            {
                "expect": {"tool_results": [result("j", "ok", f"job {key} approved")]},
                "say": "approved",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("a job to approve", model=model, tools=[tool], task_id=tid())
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    assert info.status is TaskStatus.WAITING
    (waiting,) = info.waiting_for
    assert waiting.kind == "reply" and f"Approve job {key}?" in waiting.detail["question"]
    (created,) = entries(mcp_servers, "approve_job.created", key)
    row = call_row(task_id, "j")
    assert row.handle == f"task:{created['task_id']}" and row.lease_owner is None  # I25
    charlie.reply(task_id, "j", "yes")
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    updates = [
        e for e in entries(mcp_servers, "tasks/update") if e["task_id"] == created["task_id"]
    ]
    assert updates and updates[0]["keys"] == [f"approve-{key}"]
    (answered,) = entries(mcp_servers, "approve_job.answered", key)
    assert answered["approved"] is True
    assert_every_call_has_one_result(task_id)
