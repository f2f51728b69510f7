"""Delegation (I19): one child per delegation; the parent waits without holding a worker."""

from __future__ import annotations

import uuid

import pytest

import charlie
from charlie import api
from charlie.domain import Phase, TaskStatus
from tests.conftest import model_calls, wait_for
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def parent_turns(child_model: str) -> list[dict]:
    return [
        {
            "say": "Delegating the compatibility check.",
            "tool_calls": [
                {
                    "id": "d1",
                    "name": "delegate",
                    "arguments": {"prompt": "check compatibility", "model": child_model},
                }
            ],
        },
        {
            "say": "Waiting for the child.",
            "tool_calls": [
                {"id": "w1", "name": "wait_for_task", "arguments": {"task_id": "{task_id}.0.d1"}}
            ],
        },
        {"say": "The child says it is compatible."},
    ]


def test_delegate_and_wait_returns_the_child_result(cluster: Cluster, script) -> None:
    child_model, child_ledger = script([{"say": "compatible with 2.3", "sleep": 2}])
    model, _ = script(parent_turns(child_model))
    parent = charlie.submit("release check", model=model)
    child = f"{parent}.0.d1"
    # The parent is `waiting` while its wait is open.
    wait_for(lambda: api.get_task(parent).status is TaskStatus.WAITING, timeout=30)
    info = charlie.wait(parent, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    child_info = api.get_task(child)
    assert child_info.parent_id == parent
    assert child_info.status is TaskStatus.SUCCEEDED
    results = {i.call_id: i for i in charlie.transcript(parent) if i.kind == "tool_result"}
    assert results["d1"].payload["result"]["task_id"] == child
    wait = results["w1"].payload["result"]
    assert wait["status"] == "succeeded"
    assert wait["result"]["answer"] == "compatible with 2.3"
    assert len(model_calls(child_ledger)) == 1  # exactly one child ran
    wait_call = next(c for c in api.calls(parent) if c.call_id == "w1")
    assert wait_call.handle == child


def test_failed_child_is_an_error_result_for_the_parent(cluster: Cluster, script) -> None:
    child_model, _ = script([{"raise": "child broke"}])
    model, _ = script(parent_turns(child_model))
    parent = charlie.submit("failing child", model=model)
    assert charlie.wait(parent, timeout=60).status is TaskStatus.SUCCEEDED
    wait = next(
        i for i in charlie.transcript(parent) if i.call_id == "w1" and i.kind == "tool_result"
    )
    assert wait.outcome == "error" and "ended failed" in wait.payload["content"]


def test_canceling_the_parent_cancels_its_child(cluster: Cluster, script) -> None:
    child_model, child_ledger = script([{"say": "slow", "sleep": 30}])
    model, ledger = script(parent_turns(child_model))
    parent = charlie.submit("cancel family", model=model)
    child = f"{parent}.0.d1"
    wait_for(lambda: len(model_calls(child_ledger)) == 1, timeout=30)
    assert charlie.cancel(parent) is True
    calls_at_cancel = len(model_calls(ledger))
    assert charlie.wait(parent, timeout=30).status is TaskStatus.CANCELED
    assert charlie.wait(child, timeout=30).status is TaskStatus.CANCELED
    # Its run ended (no tick moves it again), and sweep rounds went by after (one would
    # re-publish a tick it still had to take): the model was not called after the cancel.
    wait_for(lambda: charlie.get_task(parent).phase is Phase.DONE, timeout=30)
    cluster.sweep_rounds(2)
    assert len(model_calls(ledger)) == calls_at_cancel  # not called again after the cancel


def test_a_timeout_noticed_at_the_boundary_stops_the_children(cluster: Cluster, script) -> None:
    """I18: a parent timed out (by its own tick or the sweep) takes its children with it."""
    child_model, _ = script([{"say": "slow child", "sleep": 30}])
    model, ledger = script(parent_turns(child_model))
    parent = charlie.submit("time out family", model=model, timeout=3)
    assert charlie.wait(parent, timeout=30).status is TaskStatus.TIMED_OUT
    assert charlie.wait(f"{parent}.0.d1", timeout=30).status is TaskStatus.CANCELED
    assert len(model_calls(ledger)) <= 2


def test_canceled_fan_out_starts_nothing_after_the_cancel(cluster: Cluster, script) -> None:
    """I18: after a cancel, no queued call of the task starts, whatever is still in flight."""
    calls = [
        {"id": f"c{n}", "name": "sleep_then", "arguments": {"seconds": 0.5, "value": str(n)}}
        for n in range(12)
    ]
    model, _ = script([{"tool_calls": calls}, {"say": "never"}])
    task_id = charlie.submit("cancel fan-out", model=model)
    wait_for(lambda: any(c.state == "started" for c in api.calls(task_id)))
    assert charlie.cancel(task_id) is True
    canceled_at = api.get_task(task_id).finished_at
    assert charlie.wait(task_id, timeout=30).status is TaskStatus.CANCELED
    wait_for(lambda: all(c.state == "settled" for c in api.calls(task_id)), timeout=30)
    late_starts = [
        c.call_id for c in api.calls(task_id) if c.started_at and c.started_at > canceled_at
    ]
    assert late_starts == []


# -- a child is bound by its parent's approvals and budget (I23) -----------------------------


def call(cid: str, name: str, **arguments: object) -> dict:
    return {"id": cid, "name": name, "arguments": arguments}


def test_a_delegated_write_waits_for_the_approval_its_ancestor_asked_for(
    cluster: Cluster, script, workspace
) -> None:
    """I23 through delegation: a task submitted with approve=["write_file"] delegates a child,
    which delegates a grandchild; the grandchild's write_file waits for a person like its
    ancestor's would, and runs once, only after the approve (a child used to get no approve
    list and wrote at once)."""
    grandchild_model, _ = script(
        [
            {"tool_calls": [call("w", "write_file", path="deep.txt", content="written")]},
            {"say": "grandchild wrote"},
        ]
    )
    child_model, _ = script(
        [
            {
                "tool_calls": [
                    call("d", "delegate", prompt="write it", model=grandchild_model),
                ]
            },
            {"tool_calls": [call("wt", "wait_for_task", task_id="{task_id}.0.d")]},
            {"say": "child done"},
        ]
    )
    parent_model, _ = script(
        [
            {
                "tool_calls": [
                    call("d", "delegate", prompt="have it written", model=child_model),
                ]
            },
            {"tool_calls": [call("wt", "wait_for_task", task_id="{task_id}.0.d")]},
            {"say": "parent done"},
        ]
    )
    parent = charlie.submit(
        "write through two delegations",
        model=parent_model,
        tools=["delegate", "wait_for_task", "write_file"],
        approve=["write_file"],
        metadata={"workspace": str(workspace)},
    )
    grandchild = f"{parent}.0.d.0.d"
    held = wait_for(
        lambda: (
            [c for c in api.calls(grandchild) if c.call_id == "w" and c.hold == "approval"]
            if _exists(grandchild)
            else None
        ),
        timeout=60,
    )
    assert held[0].state == "pending" and held[0].started_at is None
    waiting = api.get_task(grandchild).waiting_for
    assert [(w.kind, w.call_id, w.tool) for w in waiting] == [("approval", "w", "write_file")]
    assert not (workspace / "deep.txt").exists()  # nothing written before the approve
    charlie.approve(grandchild, "w", note="fine")
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert (workspace / "deep.txt").read_text() == "written"
    (w,) = [c for c in api.calls(grandchild) if c.call_id == "w"]
    assert w.outcome == "ok" and w.attempts == 1


def _exists(task_id: str) -> bool:
    try:
        api.get_task(task_id)
    except api.TaskNotFound:
        return False
    return True


def budget_family(script, parent_budget: dict) -> tuple[str, str, list]:
    """A parent that delegates one child (two model calls: a tool turn, an answer), waits for
    it and answers: three model calls of its own."""
    child_model, child_ledger = script(
        [
            {"tool_calls": [call("s", "sleep_then", seconds=0, value="v")]},
            {"say": "child done"},
        ]
    )
    parent_model, _ = script(
        [
            {"tool_calls": [call("d", "delegate", prompt="spend", model=child_model)]},
            {"tool_calls": [call("wt", "wait_for_task", task_id="{task_id}.0.d")]},
            {"say": "parent done"},
        ]
    )
    parent = charlie.submit("budgeted family", model=parent_model, budget=parent_budget)
    return parent, f"{parent}.0.d", child_ledger


def test_a_childs_budget_is_what_its_parent_has_left_and_its_spend_is_the_parents(
    cluster: Cluster, script
) -> None:
    """Budgets through delegation: delegated after its parent's first model call, the child
    gets the 4 calls left of the parent's 5; its 2 calls show in its parent's usage, and the
    parent's 3 calls of its own fill the budget exactly."""
    parent, child, child_ledger = budget_family(script, {"model_calls": 5})
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert api.get_task(child).budget == {"model_calls": 4}
    assert len(model_calls(child_ledger)) == 2
    assert info.model_calls == 3
    assert info.delegated_usage is not None and info.delegated_usage["model_calls"] == 2
    assert info.budget_used() == [("model_calls", 5, 5)]


def test_a_parents_budget_counts_its_childs_spend(cluster: Cluster, script) -> None:
    """Budgets through delegation: with 4 model calls, the parent's own 2 and its child's 2
    spend the budget, so its third call is never made: it fails by its budget, which names
    its delegated tasks' spend (it used to see only its own 2 and go on)."""
    parent, child, _ = budget_family(script, {"model_calls": 4})
    info = charlie.wait(parent, timeout=90)
    assert api.get_task(child).status is TaskStatus.SUCCEEDED
    assert api.get_task(child).budget == {"model_calls": 3}
    assert info.status is TaskStatus.FAILED, info
    assert info.error["reason"] == "budget exceeded" and info.error["budget"] == "model_calls"
    assert info.error["used"] == 4 and info.error["limit"] == 4
    assert "delegated tasks" in info.error["message"]
    assert info.model_calls == 2
    # A resume needs room for what its child spent too: 4 calls are spent, 5 leave one.
    with pytest.raises(api.NotResumable, match="model_calls budget exceeded"):
        charlie.resume(parent, budget={"model_calls": 4})
    charlie.resume(parent, budget={"model_calls": 5})
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.model_calls == 3


def test_a_child_stops_when_its_parents_budget_is_spent_though_its_own_has_room(
    cluster: Cluster, script
) -> None:
    """Budgets through delegation: the child's budget (2 calls: its parent's 3 less the 1
    spent) still has room after its first call, but its parent's second call has meanwhile
    spent the rest of the parent's 3, so the child's second call is never made: it fails
    naming its parent's budget. (The approve its parent asked for holds the child's first
    turn until the parent is waiting, so the order is certain.)"""
    child_model, child_ledger = script(
        [
            {"tool_calls": [call("w", "ledger_write", key=f"k-{uuid.uuid4().hex[:8]}")]},
            {"tool_calls": [call("s", "sleep_then", seconds=0, value="v")]},
            {"say": "child done"},
        ]
    )
    parent_model, _ = script(
        [
            {"tool_calls": [call("d", "delegate", prompt="spend", model=child_model)]},
            {"tool_calls": [call("wt", "wait_for_task", task_id="{task_id}.0.d")]},
            {"say": "parent done"},
        ]
    )
    parent = charlie.submit(
        "shared budget", model=parent_model, budget={"model_calls": 3}, approve=["ledger_write"]
    )
    child = f"{parent}.0.d"
    wait_for(
        lambda: (
            _exists(child)
            and any(c.hold == "approval" for c in api.calls(child))
            and api.get_task(parent).status is TaskStatus.WAITING
            and api.get_task(parent).model_calls == 2
        ),
        timeout=60,
    )
    assert api.get_task(child).budget == {"model_calls": 2}
    charlie.approve(child, "w")
    info = charlie.wait(child, timeout=60)
    assert info.status is TaskStatus.FAILED, info
    assert info.error["reason"] == "budget exceeded" and info.error["budget_of"] == parent
    assert info.error["used"] == 3 and info.error["limit"] == 3
    assert info.model_calls == 1 and len(model_calls(child_ledger)) == 1
    assert charlie.wait(parent, timeout=60).status is TaskStatus.FAILED
