"""Delegation (I19): one child per delegation; the parent waits without holding a worker."""

from __future__ import annotations

import time

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
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
    time.sleep(1)
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
