"""Recovery: real worker processes SIGKILLed at the points each invariant is about.

Every kill here is SIGKILL to a worker's whole process group (its main process and pool
children), either from the test, aimed at the pid that a ledger says is doing the work, or from
a fault point inside the worker, which fires exactly where the invariant is at stake.
"""

from __future__ import annotations

import time

import pytest

import charlie
from charlie import api
from charlie.domain import Phase, TaskStatus
from tests.conftest import model_calls, wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(180)]


def test_kill_during_model_call_repeats_only_that_call(cluster: Cluster, script) -> None:
    """I3: a worker killed during a model call: the run continues elsewhere, only that call
    repeats, and the repeat is counted on the run."""
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "x"}}
                ]
            },
            {"say": "thinking slowly", "sleep": 3, "tool_calls": []},
        ]
    )
    task_id = charlie.submit("kill during model", model=model)
    calls = wait_for(lambda: [c for c in model_calls(ledger) if c["turn"] == 1])
    cluster.kill_pid_group(calls[0]["pid"])

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    turns = [c["turn"] for c in model_calls(ledger)]
    assert turns.count(0) == 1  # the committed turn was not redone
    assert turns.count(1) == 2  # only the uncommitted call repeated
    assert info.model_calls == 2 and info.model_repeats == 1
    assert len(read_ledger_for(task_id, "sleep_then.end")) == 1  # the settled tool did not rerun


def read_ledger_for(task_id: str, event: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e.get("event") == event]


def test_kill_inside_a_write_tool_settles_interrupted_and_never_reruns(
    cluster: Cluster, script
) -> None:
    """I9, I10: a write tool killed after dispatch-started (and after its side effect) settles
    `interrupted` with its evidence, is never invoked again, and the model sees it."""
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "w",
                        "name": "ledger_write",
                        "arguments": {"key": "k-interrupt", "hold": 30},
                    }
                ]
            },
            {"say": "I will check whether the write happened."},
        ]
    )
    task_id = charlie.submit("kill in write", model=model)
    writes = wait_for(lambda: read_ledger_for(task_id, "write"))
    call = api.calls(task_id)[0]
    assert call.state == "started" and call.started_by  # I9: marked before acting
    cluster.kill_pid_group(int(writes[0]["pid"]))

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    call = api.calls(task_id)[0]
    assert call.outcome == "interrupted"
    assert call.result["started_by"] == call.started_by
    assert call.result["started_at"]
    assert len(read_ledger_for(task_id, "write")) == 1  # never run again
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "interrupted" and "INTERRUPTED" in result.payload["content"]
    assert len(model_calls(ledger)) == 2
    assert_every_call_has_one_result(task_id)


def test_interrupted_call_with_reconcile_hook_settles_with_what_it_finds(
    cluster: Cluster, script
) -> None:
    """I10: a tool with a read-back reconcile hook: recovery calls the hook, not the handler."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "w",
                        "name": "idempotent_write",
                        "arguments": {"key": "k-reconcile", "hold": 30},
                    }
                ]
            },
            {"say": "done"},
        ]
    )
    task_id = charlie.submit("reconcile", model=model)
    writes = wait_for(lambda: read_ledger_for(task_id, "write"))
    cluster.kill_pid_group(int(writes[0]["pid"]))

    assert charlie.wait(task_id, timeout=90).status is TaskStatus.SUCCEEDED
    call = api.calls(task_id)[0]
    assert call.outcome == "ok"
    assert call.result["reconciled"] is True and call.result["found_by"] == "read-back"
    assert len(read_ledger_for(task_id, "write")) == 1


def test_kill_after_commit_before_publish_is_found_by_the_sweep(cluster: Cluster, script) -> None:
    """I4: a transition committed but its next tick never published: the sweep moves it."""
    cluster.set_faults(
        {"tick.after_commit": {"action": "kill", "times": 1, "match": {"phase": "call_model"}}}
    )
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "after the sweep"},
        ]
    )
    task_id = charlie.submit("lost publish", model=model)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.after_commit") == 1
    assert len(model_calls(ledger)) == 2  # the committed model output was not redone
    assert info.model_repeats == 0


def test_kill_during_report_terminal_does_not_call_the_model_again(
    cluster: Cluster, script
) -> None:
    """I16: a worker killed in report_terminal: the answer was durable; it is reported once and
    the model is not called again."""
    cluster.set_faults(
        {"tick.before_work": {"action": "kill", "times": 1, "match": {"phase": "report_terminal"}}}
    )
    model, ledger = script([{"say": "the durable answer"}])
    task_id = charlie.submit("kill in report", model=model)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result["answer"] == "the durable answer"
    assert cluster.fault_count("tick.before_work") == 1
    assert len(model_calls(ledger)) == 1
    assert info.model_calls == 1


def test_deadline_settles_and_late_completion_is_a_late_report(cluster: Cluster, script) -> None:
    """I13, I12: a tool past its deadline settles deadline_exceeded, the run moves on, and its
    later completion is recorded as a late report that changes nothing."""
    model, ledger = script(
        [
            {"tool_calls": [{"id": "d", "name": "outlive_deadline", "arguments": {"seconds": 4}}]},
            {"say": "moved on"},
        ]
    )
    task_id = charlie.submit("deadline", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    call = api.calls(task_id)[0]
    assert call.outcome == "deadline_exceeded"
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert "DEADLINE EXCEEDED" in result.payload["content"]
    wait_for(lambda: api.calls(task_id)[0].late_reports == 1, timeout=30)
    late = api.calls(task_id)[0]
    assert late.outcome == "deadline_exceeded"  # first result wins
    assert len(model_calls(ledger)) == 2


def test_timeout_while_a_tool_runs(cluster: Cluster, script) -> None:
    """I18: a task past its timeout while a tool runs ends timed_out; no more model calls."""
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "s", "name": "sleep_then", "arguments": {"seconds": 6, "value": "v"}}
                ]
            },
            {"say": "must not happen"},
        ]
    )
    task_id = charlie.submit("time out", model=model, timeout=2)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.TIMED_OUT
    wait_for(lambda: api.get_task(task_id).phase is Phase.DONE, timeout=30)
    assert api.calls(task_id)[0].outcome == "canceled"
    assert len(model_calls(ledger)) == 1
    assert_every_call_has_one_result(task_id)


def test_poison_tick_stops_after_bounded_attempts(cluster: Cluster, script) -> None:
    """A tick that kills its worker every time ends the run in report_failure with the evidence
    (the cluster allows 3 attempts), instead of looping forever."""
    cluster.set_faults(
        {"tick.before_work": {"action": "kill", "times": 50, "match": {"phase": "call_model"}}}
    )
    model, ledger = script([{"say": "never answered"}])
    task_id = charlie.submit("poison", model=model)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.FAILED
    assert info.error["type"] == "PoisonMessage"
    assert info.error["phase"] == "call_model"
    assert cluster.fault_count("tick.before_work") == 3
    assert model_calls(ledger) == []


def test_kill_inside_a_resumable_wait_observes_the_same_child(cluster: Cluster, script) -> None:
    """I10, I19: a worker killed inside a resumable wait: the wait is dispatched again with the
    same call identity and observes the same, single child."""
    from tests.integration.test_delegation import parent_turns

    cluster.set_faults(
        {"tool.after_started": {"action": "kill", "times": 1, "match": {"tool": "wait_for_task"}}}
    )
    child_model, child_ledger = script([{"say": "compatible", "sleep": 1}])
    model, _ = script(parent_turns(child_model))
    parent = charlie.submit("kill in wait", model=model)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tool.after_started") == 1
    wait_call = next(c for c in api.calls(parent) if c.call_id == "w1")
    assert wait_call.outcome == "ok" and wait_call.handle == f"{parent}.0.d1"
    assert wait_call.result["result"]["answer"] == "compatible"
    from charlie.runtime import get_runtime
    from charlie.scheduler import descendants

    assert descendants(get_runtime().engine, parent) == [f"{parent}.0.d1"]  # one child
    child_calls = model_calls(child_ledger)
    assert {c["task_id"] for c in child_calls} == {f"{parent}.0.d1"}
    # The kill took the whole worker, which may have been running the child's model call too:
    # that call may repeat (I3), and every repeat is counted.
    child = api.get_task(f"{parent}.0.d1")
    assert len(child_calls) == child.model_calls + child.model_repeats
    assert len([c for c in api.calls(parent) if c.name == "delegate"]) == 1


@pytest.mark.parametrize(
    ("point", "child_before_the_kill"),
    [("tool.after_started", False), ("tool.before_settle", True)],
)
def test_kill_inside_delegate_leaves_exactly_one_child(
    cluster: Cluster, script, point: str, child_before_the_kill: bool
) -> None:
    """I10, I19: a worker killed inside ``delegate``, before the child was created or after it
    but before the call settled: recovery finishes the delegation (the child's id comes from the
    call, so it cannot make a second), and the parent's wait observes that one child."""
    from tests.integration.test_delegation import parent_turns

    cluster.set_faults({point: {"action": "kill", "times": 1, "match": {"tool": "delegate"}}})
    child_model, child_ledger = script([{"say": "compatible"}])
    model, _ = script(parent_turns(child_model))
    parent = charlie.submit("kill in delegate", model=model)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count(point) == 1
    from charlie.runtime import get_runtime
    from charlie.scheduler import descendants

    child = f"{parent}.0.d1"
    assert descendants(get_runtime().engine, parent) == [child]
    delegate_call = next(c for c in api.calls(parent) if c.call_id == "d1")
    assert delegate_call.outcome == "ok", delegate_call.result
    assert delegate_call.result["reconciled"] is True
    assert delegate_call.result["task_id"] == child
    # `created` is this attempt's answer: the recovery made the child only if the kill came first.
    assert delegate_call.result["created"] is not child_before_the_kill
    wait_call = next(c for c in api.calls(parent) if c.call_id == "w1")
    assert wait_call.outcome == "ok" and wait_call.result["result"]["answer"] == "compatible"
    assert {c["task_id"] for c in model_calls(child_ledger)} == {child}


def test_kill_after_the_last_settle_before_its_poke(cluster: Cluster, script) -> None:
    """I4: the worker that settles a turn's last call dies before publishing the await tick;
    the sweep moves the run long before the call's deadline (60 s) would."""
    cluster.set_faults(
        {"tool.after_settle": {"action": "kill", "times": 1, "match": {"tool": "sleep_then"}}}
    )
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "moved on"},
        ]
    )
    started = time.monotonic()
    task_id = charlie.submit("lost poke", model=model)
    info = charlie.wait(task_id, timeout=40)
    assert info.status is TaskStatus.SUCCEEDED
    assert cluster.fault_count("tool.after_settle") == 1
    assert time.monotonic() - started < 40
    assert len(read_ledger_for(task_id, "sleep_then.end")) == 1


def test_kill_after_a_published_turns_last_settle_before_its_poke(cluster: Cluster, script) -> None:
    """I4, I7: a turn of two published calls (not threadsafe: each goes through the broker to
    a worker that holds no lease on the run); the worker that settles the last one dies before
    publishing the await tick. Its settle stored the run's wake-up a stall period ahead, and
    the sweeps' wake scan moves the run by it, long before the calls' deadline (60 s)."""
    cluster.set_faults(
        {"tool.after_settle": {"action": "kill", "times": 1, "match": {"call_id": "b"}}}
    )
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "idempotent_write", "arguments": {"key": "a"}},
                    {"id": "b", "name": "idempotent_write", "arguments": {"key": "b", "hold": 1}},
                ]
            },
            {"say": "moved on"},
        ]
    )
    started = time.monotonic()
    task_id = charlie.submit("lost poke of a published turn", model=model)
    info = charlie.wait(task_id, timeout=40)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tool.after_settle") == 1
    assert time.monotonic() - started < 40
    assert [c.outcome for c in api.calls(task_id)] == ["ok", "ok"]


def test_poison_inside_a_fast_phase_is_bounded(cluster: Cluster, script) -> None:
    """A tick that dies inside its own transaction (its claim rolls back with it) is still
    counted, by the sweep, and ends in report_failure; no tool is started after that."""
    cluster.set_faults(
        {
            "tick.in_transaction": {
                "action": "kill",
                "times": 50,
                "match": {"phase": "dispatch_tools"},
            }
        }
    )
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "never"}}]},
            {"say": "never"},
        ]
    )
    task_id = charlie.submit("fast poison", model=model)
    info = charlie.wait(task_id, timeout=150)
    assert info.status is TaskStatus.FAILED
    assert info.error["type"] == "PoisonMessage" and info.error["phase"] == "dispatch_tools"
    call = api.calls(task_id)[0]
    assert call.outcome == "canceled" and call.started_at is None
    assert read_ledger_for(task_id, "write") == []
    assert_every_call_has_one_result(task_id)


def test_duplicated_invoke_messages_run_a_tool_once(cluster: Cluster, script) -> None:
    """I2, I9: redelivered or duplicated invoke messages for a call change nothing."""
    from charlie.runtime import get_runtime

    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "w", "name": "ledger_write", "arguments": {"key": "dup", "hold": 1}}
                ]
            },
            {"say": "once"},
        ]
    )
    task_id = charlie.submit("dupes", model=model)
    wait_for(lambda: read_ledger_for(task_id, "write"))
    rt = get_runtime()
    for mode in ("start", "start", "resume", "reconcile"):
        rt.publisher.invoke(f"x-{task_id}", 0, "w", mode)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    time.sleep(1)
    assert len(read_ledger_for(task_id, "write")) == 1
    assert api.calls(task_id)[0].outcome == "ok"


def test_a_paused_holder_whose_call_was_taken_over_changes_nothing(
    cluster: Cluster, script
) -> None:
    """I5, I10, I12: a worker is SIGSTOPped inside a write tool until its
    lease lapses; recovery takes the call over (its reconcile hook, slow on purpose, is still
    reading back when the old holder wakes). SIGCONT: the old holder sees it lost the lease,
    does not do the tool's second step, and its result is at most a late report; the
    reconcile's finding is the one outcome."""
    import os
    import signal

    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "w",
                        "name": "fenced_write",
                        "arguments": {"key": "k-fenced", "hold": 4, "reconcile_hold": 4},
                    }
                ]
            },
            {"say": "checked"},
        ]
    )
    task_id = charlie.submit("pause in write", model=model)
    writes = wait_for(lambda: read_ledger_for(task_id, "write"))
    holder = int(writes[0]["pid"])
    os.kill(holder, signal.SIGSTOP)
    try:
        # recovery has taken the call over: the reconcile hook runs elsewhere
        wait_for(lambda: read_ledger_for(task_id, "fenced_write.reconcile"), timeout=30)
        assert api.calls(task_id)[0].state == "started"
    finally:
        os.kill(holder, signal.SIGCONT)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    time.sleep(1)  # room for anything the old holder might still do
    call = api.calls(task_id)[0]
    assert call.outcome == "ok" and call.result.get("reconciled") is True, call.result
    assert call.result["found_by"] == "read-back"
    assert call.late_reports <= 1
    if call.late_reports:
        assert call.late_result["outcome"] == "error"  # the old holder's: it stopped
    assert read_ledger_for(task_id, "fenced_write.second") == []  # it did not act again
    assert len(read_ledger_for(task_id, "write")) == 1
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok"
    assert_every_call_has_one_result(task_id)
