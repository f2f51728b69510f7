"""A call held for a person a second time gets a verdict of its own (I23, I24).

A call is held for a person more than once when an approved ``on_interrupt="hold"`` call is
interrupted (held for approval, then for a reconcile), or when the repeat a ``not_done``
verdict authorised is interrupted too (held for a reconcile twice). Each hold is decided once:
the first verdict on it stands, and a verdict on an earlier hold is no verdict on this one.
"""

from __future__ import annotations

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(180)


def runs_of(task_id: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e["event"] == "held_write"]


def held_for(task_id: str, kind: str) -> bool:
    return any(w.kind == kind for w in charlie.get_task(task_id).waiting_for)


def script_of(script, key: str):
    return script(
        [
            {
                "tool_calls": [
                    {"id": "h", "name": "held_write", "arguments": {"key": key, "hold": 30}}
                ]
            },
            {"expect": {"tool_results": [{"call_id": "h", "outcome": "ok"}]}, "say": "done"},
        ]
    )


def test_an_approved_call_held_after_a_kill_takes_a_reconcile(cluster: Cluster, script) -> None:
    model, _ = script_of(script, "held-again-1")
    task_id = charlie.submit("approve, kill, reconcile", model=model, approve=["held_write"])
    wait_for(lambda: held_for(task_id, "approval"), timeout=60)
    first = charlie.approve(task_id, "h", operator="ana")
    runs = wait_for(lambda: runs_of(task_id), timeout=60)
    cluster.kill_pid_group(int(runs[0]["pid"]))
    wait_for(lambda: held_for(task_id, "reconcile"), timeout=90)

    record = charlie.reconcile(task_id, "h", "done", result={"written": "yes"}, operator="bo")
    assert record.action.value == "reconcile"
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert len(runs_of(task_id)) == 1
    # Decided, the call takes no second verdict, whichever hold it names (I24).
    with pytest.raises(api.VerdictConflict):
        charlie.approve(task_id, "h")
    with pytest.raises(api.VerdictConflict):
        charlie.reconcile(task_id, "h", "unknown")
    assert first.id < record.id


def test_a_repeat_interrupted_again_takes_a_second_reconcile(cluster: Cluster, script) -> None:
    model, _ = script_of(script, "held-again-2")
    task_id = charlie.submit("kill, not_done, kill, reconcile", model=model)
    runs = wait_for(lambda: runs_of(task_id), timeout=60)
    cluster.kill_pid_group(int(runs[0]["pid"]))
    wait_for(lambda: held_for(task_id, "reconcile"), timeout=90)
    charlie.reconcile(task_id, "h", "not_done", note="pretend it did not happen")
    runs = wait_for(lambda: len(runs_of(task_id)) == 2 and runs_of(task_id), timeout=60)
    cluster.kill_pid_group(int(runs[1]["pid"]))
    wait_for(lambda: held_for(task_id, "reconcile"), timeout=90)

    charlie.reconcile(task_id, "h", "done", result={"written": "yes"})
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    with pytest.raises(api.VerdictConflict):
        charlie.reconcile(task_id, "h", "unknown")
