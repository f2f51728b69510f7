"""Recovery: a worker SIGKILLed while it runs a turn's calls itself, at once.

A turn of up to CHARLIE_LOCAL_CALLS calls of threadsafe tools runs in the worker that
dispatched it, each call in a thread of its own: started in one commit (reads on PostgreSQL in
the model's commit), each settled as it ends, the last one's settle carrying the turn on. A kill
in the middle leaves what is committed: the calls that settled keep their results, the ones
that were running are started by a dead worker and settle interrupted (I10), never run again;
calls never started are started by the sweep (I11). Every call gets one result (I8), in call
order (I7), and every transition its own version (I1, I2).
"""

from __future__ import annotations

import itertools
import os
import uuid

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import BACKEND, model_calls
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster, fused_commits
from tests.support.tools import read_ledger

pytestmark = [
    pytest.mark.recovery,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        os.environ.get("CHARLIE_TEST_INLINE_PHASES") == "0",
        reason="with every step published no worker runs a turn's calls itself",
    ),
]


def _events(task_id: str, event: str) -> list[str]:
    return [
        str(e.get("call"))
        for e in read_ledger()
        if e.get("task") == task_id and e.get("event") == event
    ]


def _history_is_whole(task_id: str) -> None:
    history = api.history(task_id)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + len(versions))), history
    for before, after in itertools.pairwise(history):
        assert after["from_phase"] == before["to_phase"], history
    assert history[-1]["to_phase"] == "done"


def test_a_kill_while_a_turns_calls_run_at_once(cluster: Cluster, script) -> None:
    """One of three reads ends and settles; the worker dies while the other two run: they
    settle interrupted and never run again, the first keeps its result."""
    task_id = f"lc-{uuid.uuid4().hex[:12]}"
    match = {"call_id": "a", "tool": "sleep_then"}
    cluster.set_faults({"tool.after_settle": {"action": "kill", "times": 1, "match": match}})
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "A"}},
                    {"id": "b", "name": "sleep_then", "arguments": {"seconds": 3, "value": "B"}},
                    {"id": "c", "name": "sleep_then", "arguments": {"seconds": 3, "value": "C"}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "a", "outcome": "ok", "contains": "A"},
                        {"call_id": "b", "outcome": "interrupted"},
                        {"call_id": "c", "outcome": "interrupted"},
                    ]
                },
                "say": "coped",
            },
        ]
    )
    charlie.submit("a kill among local calls", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tool.after_settle") == 1
    records = {c.call_id: c for c in api.calls(task_id)}
    assert {k: r.outcome for k, r in records.items()} == {
        "a": "ok", "b": "interrupted", "c": "interrupted",
    }  # fmt: skip
    # all three started by the one worker that dispatched them, at once
    assert len({r.started_by for r in records.values()}) == 1
    assert records["b"].started_at < records["a"].settled_at
    assert sorted(_events(task_id, "sleep_then.start")) == ["a", "b", "c"]  # once each (I10)
    assert _events(task_id, "sleep_then.end") == ["a"]
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1]
    assert_every_call_has_one_result(task_id)
    _history_is_whole(task_id)


def test_a_kill_before_the_calls_start_leaves_them_free_to_start(cluster: Cluster, script) -> None:
    """Two writes run at once start in a commit of their own after the model's: killed before
    it, both are pending, and the sweep starts each normally (I11), each once."""
    task_id = f"lc-{uuid.uuid4().hex[:12]}"
    match = {"task_id": task_id}
    cluster.set_faults({"tick.merged.before_start": {"action": "kill", "times": 1, "match": match}})
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "w1", "name": "ledger_write", "arguments": {"key": f"{task_id}-1"}},
                    {"id": "w2", "name": "ledger_write", "arguments": {"key": f"{task_id}-2"}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "w1", "outcome": "ok"},
                        {"call_id": "w2", "outcome": "ok"},
                    ]
                },
                "say": "written",
            },
        ]
    )
    charlie.submit("a kill before local calls start", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.merged.before_start") == 1
    assert sorted(_events(task_id, "write")) == ["w1", "w2"]  # each ran once
    assert_every_call_has_one_result(task_id)
    _history_is_whole(task_id)


def test_a_kill_just_after_the_model_commit_of_reads_run_at_once(cluster: Cluster, script) -> None:
    """Fused (PostgreSQL), reads run at once start in the model's commit: killed just after
    it, they are started by a dead worker and settle interrupted (I10), never run. Stepwise
    they are still pending, and the sweep starts each (I11)."""
    task_id = f"lc-{uuid.uuid4().hex[:12]}"
    match = {"task_id": task_id, "phase": "await_tools", "first": "call_model"}
    cluster.set_faults({"tick.merged.after_commit": {"action": "kill", "times": 1, "match": match}})
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "r1", "name": "sleep_then", "arguments": {"seconds": 0, "value": "1"}},
                    {"id": "r2", "name": "sleep_then", "arguments": {"seconds": 0, "value": "2"}},
                ]
            },
            {"say": "done"},
        ]
    )
    charlie.submit("a kill after the model's commit", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.merged.after_commit") == 1
    outcomes = sorted(c.outcome or "" for c in api.calls(task_id))
    if fused_commits(BACKEND):
        assert outcomes == ["interrupted", "interrupted"]
        assert _events(task_id, "sleep_then.start") == []
    else:
        assert outcomes == ["ok", "ok"]
        assert sorted(_events(task_id, "sleep_then.start")) == ["r1", "r2"]
    assert_every_call_has_one_result(task_id)
    _history_is_whole(task_id)
