"""The loop end to end through real worker processes, a real broker and a real database."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

import charlie
from charlie import api, scheduler
from charlie.domain import Phase, TaskStatus
from charlie.runtime import get_runtime
from tests.conftest import model_calls, wait_for
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def tid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def assert_every_call_has_one_result(task_id: str) -> None:
    """I8: each tool_call item is followed, within its turn, by exactly one tool_result."""
    items = charlie.transcript(task_id)
    calls = [(i.turn, i.call_id) for i in items if i.kind == "tool_call"]
    results = Counter((i.turn, i.call_id) for i in items if i.kind == "tool_result")
    assert all(results[c] == 1 for c in calls), (calls, results)
    assert set(results) == set(calls)
    # ...and before the next model item: results of turn t come before any item of turn t+1.
    for turn, call_id in calls:
        result_seq = next(
            i.seq
            for i in items
            if i.kind == "tool_result" and i.call_id == call_id and i.turn == turn
        )
        later_model = [
            i.seq
            for i in items
            if i.turn > turn and i.kind in ("message", "tool_call", "final", "reasoning")
        ]
        assert all(result_seq < s for s in later_model)


def test_whole_task_reads_writes_and_answers(cluster: Cluster, script, workspace: Path) -> None:
    (workspace / "notes.txt").write_text("alpha\n")
    model, ledger = script(
        [
            {
                "say": "look",
                "tool_calls": [
                    {"id": "r", "name": "read_file", "arguments": {"path": "notes.txt"}}
                ],
            },
            {
                "say": "write",
                "tool_calls": [
                    {
                        "id": "w",
                        "name": "write_file",
                        "arguments": {"path": "out/x.txt", "content": "beta"},
                    },
                    {"id": "l", "name": "list_files", "arguments": {}},
                ],
            },
            {"say": "All done."},
        ]
    )
    task_id = charlie.submit("copy notes", model=model, metadata={"workspace": str(workspace)})
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "All done."
    assert (workspace / "out" / "x.txt").read_text() == "beta"
    items = charlie.transcript(task_id)
    assert [i.seq for i in items] == list(range(len(items)))  # I6: dense
    kinds = [i.kind for i in items]
    assert kinds[:2] == ["input", "input"] and kinds[-1] == "final"
    read = next(i for i in items if i.kind == "tool_result" and i.call_id == "r")
    assert read.outcome == "ok" and read.payload["result"] == "alpha\n"
    assert len(model_calls(ledger)) == 3
    assert_every_call_has_one_result(task_id)
    # I21: every transition is recorded with its worker and duration.
    history = api.history(task_id)
    assert history[0]["to_phase"] == "call_model"
    assert history[-1]["to_phase"] == "done"
    assert all(h["worker"] and h["duration_ms"] >= 0 for h in history)


def test_results_enter_in_call_order_not_finish_order(cluster: Cluster, script) -> None:
    """I7: calls that finish out of order join the transcript in the order they were made."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "slow",
                        "name": "sleep_then",
                        "arguments": {"seconds": 1.5, "value": "A"},
                    },
                    {
                        "id": "mid",
                        "name": "sleep_then",
                        "arguments": {"seconds": 0.7, "value": "B"},
                    },
                    {
                        "id": "fast",
                        "name": "sleep_then",
                        "arguments": {"seconds": 0.0, "value": "C"},
                    },
                ]
            },
            {"say": "ok"},
        ]
    )
    task_id = charlie.submit("order", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    results = [i for i in charlie.transcript(task_id) if i.kind == "tool_result"]
    assert [r.call_id for r in results] == ["slow", "mid", "fast"]
    assert [r.payload["result"] for r in results] == ["A", "B", "C"]
    records = {c.call_id: c for c in api.calls(task_id)}
    # The finishing order is kept as evidence, and it really was different.
    assert records["fast"].finish_order < records["slow"].finish_order
    # The calls ran concurrently: whichever two of the three the workers took first, the slow
    # one started before the middle one finished (run one after another, with the fast one
    # first, it would not have).
    assert records["slow"].started_at < records["mid"].settled_at
    assert_every_call_has_one_result(task_id)


def test_tool_failures_are_results_and_the_task_succeeds(cluster: Cluster, script) -> None:
    """I15: an exception, an unknown tool, invalid or non-JSON arguments all reach the model."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "raise", "name": "boom", "arguments": {"message": "kaboom"}},
                    {"id": "unknown", "name": "no_such_tool", "arguments": {}},
                    {"id": "invalid", "name": "sleep_then", "arguments": {"seconds": "soon"}},
                    {"id": "notjson", "name": "read_file", "arguments": "{not json"},
                    {"id": "polite", "name": "fail_politely", "arguments": {"reason": "nope"}},
                ]
            },
            {"say": "coped"},
        ]
    )
    task_id = charlie.submit("fail", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    results = {i.call_id: i for i in charlie.transcript(task_id) if i.kind == "tool_result"}
    assert {r.outcome for r in results.values()} == {"error"}
    assert "kaboom" in results["raise"].payload["content"]
    assert "unknown tool 'no_such_tool'" in results["unknown"].payload["content"]
    assert "invalid arguments" in results["invalid"].payload["content"]
    assert "not a JSON object" in results["notjson"].payload["content"]
    assert results["polite"].payload["result"]["hint"] == "try something else"
    assert_every_call_has_one_result(task_id)


def test_fan_out_is_bounded_per_tick(cluster: Cluster, script) -> None:
    """I14: a turn of 20 calls with K = 4: no tick queues more than 4 (the cluster runs K=4)."""
    calls = [
        {"id": f"c{n:02d}", "name": "sleep_then", "arguments": {"seconds": 0.0, "value": str(n)}}
        for n in range(20)
    ]
    model, _ = script([{"tool_calls": calls}, {"say": "fanned"}])
    task_id = charlie.submit("fan out", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    records = api.calls(task_id)
    per_tick = Counter(c.dispatch_version for c in records)
    assert len(records) == 20 and None not in per_tick
    assert max(per_tick.values()) <= 4
    assert len(per_tick) == 5  # 20 calls, 4 per dispatch tick
    results = [i.call_id for i in charlie.transcript(task_id) if i.kind == "tool_result"]
    assert results == [f"c{n:02d}" for n in range(20)]
    dispatch_ticks = [h for h in api.history(task_id) if h["from_phase"] == "dispatch_tools"]
    assert len(dispatch_ticks) == 5


def test_stale_and_duplicated_ticks_change_nothing(cluster: Cluster, script) -> None:
    """I2: duplicates of the current tick and stale ticks of past versions are no-ops."""
    model, ledger = script([{"say": "slow thought", "sleep": 1.5, "tool_calls": []}])
    task_id = charlie.submit("dupes", model=model)
    rt = get_runtime()
    xid = f"x-{task_id}"
    wait_for(lambda: api.get_task(task_id).phase is Phase.CALL_MODEL)
    for _ in range(3):  # duplicates of the in-flight call_model tick
        rt.publisher.tick(xid, Phase.CALL_MODEL, 1)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    before = api.history(task_id)
    # Stale ticks for every phase and version the run has been through.
    for h in before:
        rt.publisher.tick(xid, Phase(h["from_phase"]), h["version"] - 1)
    rt.publisher.tick(xid, Phase.LOAD_CONTEXT, 0)
    marker = charlie.submit("marker", model=script([{"say": "m"}])[0])
    charlie.wait(marker, timeout=60)  # the queue has drained past the stale messages
    assert api.history(task_id) == before
    assert len(model_calls(ledger)) == 1
    assert api.get_task(task_id).model_calls == 1


def test_exception_in_a_phase_ends_in_report_failure(cluster: Cluster, script) -> None:
    """I17: an unexpected exception stores structured error state; report_failure runs as a
    tick of its own and the task fails."""
    model, _ = script([{"raise": "the model adapter broke"}])
    task_id = charlie.submit("break", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert info.error["phase"] == "call_model"
    assert info.error["type"] == "RuntimeError"
    assert info.error["message"] == "the model adapter broke"
    assert "Traceback" in info.error["traceback"] and info.error["attempt"] == 1
    phases = [(h["from_phase"], h["to_phase"]) for h in api.history(task_id)]
    assert ("call_model", "report_failure") in phases
    assert ("report_failure", "done") in phases
    # The worker's log line names the run and the phase, before the traceback.
    context = f"[task_id={task_id} execution_id=x-{task_id} phase=call_model version="
    wait_for(lambda: any(context in line for line in worker_log_lines(cluster)))
    line = next(line for line in worker_log_lines(cluster) if context in line)
    assert "phase raised; moving to report_failure" in line


def worker_log_lines(cluster: Cluster) -> list[str]:
    return [
        line
        for path in sorted(cluster.home.glob("worker-*.log"))
        for line in path.read_text(errors="replace").splitlines()
    ]


def test_transient_scheduler_failure_is_retried_without_calling_the_model(
    cluster: Cluster, script
) -> None:
    """I16: report_terminal retries a failing scheduler write; the model is called once for
    the final turn."""
    cluster.set_faults({"scheduler.finish": {"action": "raise", "times": 2}})
    model, ledger = script([{"say": "final answer"}])
    task_id = charlie.submit("retry report", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result["answer"] == "final answer"
    assert cluster.fault_count("scheduler.finish") == 2
    assert len(model_calls(ledger)) == 1
    assert api.get_task(task_id).model_calls == 1


def test_submitting_one_id_twice_runs_once(cluster: Cluster, script) -> None:
    model, ledger = script([{"say": "once"}])
    task_id = tid()
    assert charlie.submit("same", model=model, task_id=task_id) == task_id
    assert charlie.submit("same", model=model, task_id=task_id) == task_id
    charlie.wait(task_id, timeout=60)
    assert charlie.submit("same", model=model, task_id=task_id) == task_id
    marker = charlie.submit("marker", model=script([{"say": "m"}])[0])
    charlie.wait(marker, timeout=60)
    assert len(model_calls(ledger)) == 1
    with pytest.raises(scheduler.TaskConflict):
        charlie.submit("different prompt", model=model, task_id=task_id)


def test_celery_producer_can_submit_with_delay(cluster: Cluster, script) -> None:
    """A producer that has only Celery starts a task with .delay() and its own id."""
    from charlie.worker import submit_task

    model, ledger = script([{"say": "via celery"}])
    task_id = tid()
    submit_task.delay("from celery", model=model, task_id=task_id)
    submit_task.delay("from celery", model=model, task_id=task_id)  # redelivered: no-op
    wait_for(lambda: _exists(task_id))
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED and info.result["answer"] == "via celery"
    assert len(model_calls(ledger)) == 1


def _exists(task_id: str) -> bool:
    try:
        api.get_task(task_id)
        return True
    except scheduler.TaskNotFound:
        return False


def test_cancel_before_start(cluster: Cluster, script) -> None:
    """I18: a task canceled while queued never calls the model."""
    model, ledger = script([{"say": "never"}])
    rt = get_runtime()
    # The task is durable but its first tick not yet delivered, as if the publish were slow.
    submitted = scheduler.submit(
        rt.engine,
        prompt="cancel me",
        model=model,
        tools=None,
        task_id=tid(),
        timeout=None,
        metadata=None,
    )
    assert charlie.cancel(submitted.task_id) is True
    rt.publisher.tick(submitted.execution_id, Phase.LOAD_CONTEXT, 0)
    info = charlie.wait(submitted.task_id, timeout=60)
    assert info.status is TaskStatus.CANCELED
    wait_for(lambda: api.get_task(submitted.task_id).phase is Phase.DONE)
    assert model_calls(ledger) == []
    assert charlie.cancel(submitted.task_id) is False  # already terminal: benign


def test_cancel_mid_run_while_a_tool_runs(cluster: Cluster, script) -> None:
    """I18: cancel while a tool runs: the task ends canceled, the model is not called again,
    the open call settles canceled, and the tool's later completion is a late report (I12)."""
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "long",
                        "name": "sleep_then",
                        "arguments": {"seconds": 3, "value": "late"},
                    }
                ]
            },
            {"say": "must not happen"},
        ]
    )
    task_id = charlie.submit("cancel mid-run", model=model)
    wait_for(lambda: any(c.state == "started" for c in api.calls(task_id)))
    assert charlie.cancel(task_id) is True
    info = charlie.wait(task_id, timeout=30)
    assert info.status is TaskStatus.CANCELED
    wait_for(lambda: api.get_task(task_id).phase is Phase.DONE)
    call = api.calls(task_id)[0]
    assert call.outcome == "canceled"
    wait_for(lambda: api.calls(task_id)[0].late_reports == 1, timeout=20)
    assert api.calls(task_id)[0].outcome == "canceled"  # the first outcome stands
    assert len(model_calls(ledger)) == 1
    assert_every_call_has_one_result(task_id)
