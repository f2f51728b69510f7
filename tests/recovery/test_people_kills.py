"""People in the loop under SIGKILL: a worker killed right after a message's commit,
inside and just after the boundary that takes it in, after an approve's commit, and during a
`not_done` repeat, which is then an ordinary dispatch (I9, I10, I22-I24)."""

from __future__ import annotations

import uuid

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(180)]


def tid() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


def ledger_for(task_id: str, event: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e.get("event") == event]


def delivered(task_id: str, message_id: str) -> list[charlie.api.TranscriptEntry]:
    return [
        i
        for i in charlie.transcript(task_id)
        if i.kind == "input" and i.payload.get("message_id") == message_id
    ]


def test_a_worker_killed_right_after_a_messages_commit_loses_nothing(
    cluster: Cluster, script
) -> None:
    """I22: the message is committed; the worker running the turn dies; the turn recovers
    (the read settles interrupted) and the message enters once, at that turn's boundary."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "s", "name": "sleep_then", "arguments": {"seconds": 5, "value": "v"}}
                ]
            },
            {"expect": {"contains": ["after the kill"]}, "say": "ok", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("kill after send", model=model, task_id=tid())
    (start,) = wait_for(lambda: ledger_for(task_id, "sleep_then.start"))
    charlie.send(task_id, "after the kill", message_id="m")
    cluster.kill_pid_group(int(start["pid"]))
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(delivered(task_id, "m")) == 1
    assert_every_call_has_one_result(task_id)


@pytest.mark.parametrize("point", ["tick.in_transaction", "tick.after_commit"])
def test_a_worker_killed_at_the_boundary_that_takes_a_message_in(
    cluster: Cluster, script, point: str
) -> None:
    """I22: killed inside the boundary's transaction, nothing of it commits and the next try
    takes the message; killed just after its commit, the message is in once and never again.
    The fault matches only a transaction that takes the message in (``messages``): on
    PostgreSQL with fused commits the turn's last settle predicted at dispatch (no mail then)
    also passes advance_turn, and a kill there would not be at this boundary."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "s", "name": "sleep_then", "arguments": {"seconds": 1.5, "value": "v"}}
                ]
            },
            {"expect": {"contains": ["mind the boundary"]}, "say": "ok", "tool_calls": []},
        ]
    )
    task_id = tid()
    cluster.set_faults(
        {
            point: {
                "action": "kill",
                "times": 1,
                "match": {"phase": "advance_turn", "task_id": task_id, "messages": 1},
            }
        }
    )
    charlie.submit("kill at boundary", model=model, task_id=task_id)
    wait_for(lambda: ledger_for(task_id, "sleep_then.start"))
    charlie.send(task_id, "mind the boundary", message_id="b")
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count(point) == 1
    assert len(delivered(task_id, "b")) == 1
    assert_every_call_has_one_result(task_id)


def test_a_worker_killed_after_an_approve_starts_the_call_at_most_once(
    cluster: Cluster, script
) -> None:
    """I23, I9, I10: the approve commits, the worker that marks the call started dies before
    the handler; the call is never repeated blindly (interrupted, the model told), and it was
    not started before the approve."""
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "approved_write", "arguments": {"key": "a1"}}]},
            {
                "expect": {"tool_results": [{"call_id": "w", "outcome": "interrupted"}]},
                "say": "checked",
                "tool_calls": [],
            },
        ]
    )
    task_id = tid()
    cluster.set_faults(
        {"tool.after_started": {"action": "kill", "times": 1, "match": {"tool": "approved_write"}}}
    )
    charlie.submit("kill after approve", model=model, task_id=task_id)
    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    (call,) = charlie.calls(task_id)
    assert call.started_at is None
    record = charlie.approve(task_id, "w")
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted"
    assert call.started_at is not None and call.started_at >= record.at
    assert ledger_for(task_id, "approved_write") == []  # killed before the handler: never ran


def test_a_held_write_is_held_then_a_not_done_repeat_is_an_ordinary_dispatch(
    cluster: Cluster, script
) -> None:
    """on_interrupt="hold": killed mid-call, the write is held (the model is not called, the
    task waits for an operator); `not_done` dispatches it again under the same call id, and a
    kill during that repeat holds it again (an ordinary dispatch under I9/I10); `done` settles
    it. The ledger, outside Charlie, shows exactly the two executions the operator allowed."""
    model, _ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "h", "name": "held_write", "arguments": {"key": "h1", "hold": 30}}
                ]
            },
            {
                "expect": {
                    "tool_results": [{"call_id": "h", "outcome": "ok", "contains": "by hand"}]
                },
                "say": "reconciled",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("hold me", model=model, task_id=tid())
    (first,) = wait_for(lambda: ledger_for(task_id, "held_write"))
    cluster.kill_pid_group(int(first["pid"]))
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    (waiting,) = info.waiting_for
    assert waiting.kind == "reconcile" and waiting.call_id == "h"
    assert info.status is TaskStatus.WAITING
    assert waiting.detail["evidence"]["started_by"]
    turns_before = info.model_calls

    repeat = charlie.reconcile(task_id, "h", "not_done", note="the first write never landed")
    assert repeat.detail["repeat"]["authorised_by"] == repeat.actor
    runs = wait_for(
        lambda: len(ledger_for(task_id, "held_write")) == 2 and ledger_for(task_id, "held_write")
    )
    assert float(runs[1]["t"]) >= repeat.at.timestamp()  # the repeat came after the verdict
    cluster.kill_pid_group(int(runs[1]["pid"]))
    info = wait_for(lambda: (i := charlie.get_task(task_id)).waiting_for and i, timeout=60)
    assert info.model_calls == turns_before  # held twice, the model never saw it interrupted

    charlie.reconcile(task_id, "h", "done", result={"written": "h1", "checked": "by hand"})
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(ledger_for(task_id, "held_write")) == 2
    (call,) = charlie.calls(task_id)
    assert call.outcome == "ok" and call.result == {"written": "h1", "checked": "by hand"}
    verdicts = [
        a.detail["verdict"] for a in charlie.actions(task_id) if a.action.value == "reconcile"
    ]
    assert verdicts == ["not_done", "done"]
    assert_every_call_has_one_result(task_id)


def test_an_unknown_verdict_settles_interrupted_and_the_model_is_told(
    cluster: Cluster, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "h", "name": "held_write", "arguments": {"key": "h2", "hold": 30}}
                ]
            },
            {
                "expect": {"tool_results": [{"call_id": "h", "outcome": "interrupted"}]},
                "say": "told",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("unknown", model=model, task_id=tid())
    (first,) = wait_for(lambda: ledger_for(task_id, "held_write"))
    cluster.kill_pid_group(int(first["pid"]))
    wait_for(lambda: charlie.get_task(task_id).waiting_for, timeout=60)
    charlie.reconcile(task_id, "h", "unknown", note="cannot tell from the logs")
    with pytest.raises(charlie.api.VerdictConflict, match="reconcile unknown"):
        charlie.reconcile(task_id, "h", "done")
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted" and call.result["note"] == "cannot tell from the logs"
    assert len(ledger_for(task_id, "held_write")) == 1


def test_an_approved_call_held_after_a_kill_takes_its_own_verdict(cluster: Cluster, script) -> None:
    """I24: approve and hold are two rounds: the approve that let the call run does not
    answer the reconcile its interruption asks for."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "h", "name": "held_write", "arguments": {"key": "ah", "hold": 30}}
                ]
            },
            {
                "expect": {"tool_results": [{"call_id": "h", "outcome": "ok"}]},
                "say": "both rounds",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit(
        "approve then hold", model=model, task_id=tid(), approve=["held_write"]
    )
    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    charlie.approve(task_id, "h")
    (run,) = wait_for(lambda: ledger_for(task_id, "held_write"))
    cluster.kill_pid_group(int(run["pid"]))
    info = wait_for(
        lambda: (
            (i := charlie.get_task(task_id)).waiting_for
            and i.waiting_for[0].kind == "reconcile"
            and i
        ),
        timeout=60,
    )
    assert info.status is TaskStatus.WAITING
    with pytest.raises(charlie.api.NotHeld, match="waits for reconcile"):
        charlie.approve(task_id, "h")
    charlie.reconcile(task_id, "h", "done", result={"written": "ah"})
    assert charlie.wait(task_id, timeout=120).status is TaskStatus.SUCCEEDED
    assert len(ledger_for(task_id, "held_write")) == 1


def test_a_poisoned_task_resumes_with_a_fresh_attempt_budget(cluster: Cluster, script) -> None:
    """Item 6: a model turn whose worker died every time ended the task `failed` (poison, all
    its attempts used); a resume re-enters that phase with its attempts counted from zero, so
    the model is called at last, once, and the task finishes."""
    from tests.conftest import model_calls

    task_id = tid()
    cluster.set_faults(
        {
            "tick.before_work": {
                "action": "kill",
                "times": 3,  # the cluster's CHARLIE_MAX_ATTEMPTS
                "match": {"phase": "call_model", "task_id": task_id},
            }
        }
    )
    model, ledger = script([{"say": "answered after the resume", "tool_calls": []}])
    charlie.submit("poisoned, then resumed", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=150)
    assert info.status is TaskStatus.FAILED
    assert info.error["type"] == "PoisonMessage" and info.error["phase"] == "call_model"
    assert cluster.fault_count("tick.before_work") == 3
    assert model_calls(ledger) == []
    wait_for(lambda: charlie.get_task(task_id).phase.value == "done")

    record = charlie.resume(task_id, operator="ops")
    assert (record.actor, record.detail["phase"]) == ("ops", "call_model")
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "answered after the resume"
    assert [c["turn"] for c in model_calls(ledger)] == [0]
