"""The phases as plain functions: durable state in, next durable state out (no Celery, no DB)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from charlie.domain import (
    CallState,
    CallView,
    Hold,
    Item,
    ItemKind,
    NewItem,
    Outcome,
    Phase,
    RunView,
    TaskStatus,
    TaskView,
)
from charlie.executor import boundary
from charlie.executor.phases import (
    advance_turn,
    await_tools,
    call_model,
    dispatch_tools,
    report_terminal,
)
from charlie.models.base import ModelResponse, TransientModelError, tool_call_item
from charlie.ports import PhaseDeps, PhaseLimits
from charlie.testing import FakeModel, FakeScheduler
from charlie.tools.registry import ToolRegistry, build_tool

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def a_tool(path: str, count: int = 1) -> str:
    """Reads."""
    return path


def a_wait(task: str) -> str:
    return task


def registry() -> ToolRegistry:
    tools = ToolRegistry()
    tools.add(build_tool(a_tool, name="read", deadline=10))
    tools.add(build_tool(a_wait, name="wait", effect="wait", resumable=True))
    return tools


def deps(
    model: FakeModel | None = None, scheduler: FakeScheduler | None = None, **limits: Any
) -> PhaseDeps:
    m = model or FakeModel(ModelResponse(output=[]))
    return PhaseDeps(
        model_for=lambda spec: m,
        tools=registry(),
        scheduler=scheduler or FakeScheduler(),
        limits=PhaseLimits(**limits),
        sleep=lambda s: None,
    )


def view(
    phase: Phase,
    *,
    calls: list[CallView] | None = None,
    items: list[Item] | None = None,
    state: dict[str, Any] | None = None,
    status: TaskStatus = TaskStatus.RUNNING,
    timeout_at: datetime | None = None,
    tools: list[str] | None = None,
    attempts: int = 1,
) -> RunView:
    return RunView(
        execution_id="x-t",
        phase=phase,
        version=3,
        turn=1,
        state=state or {},
        attempts=attempts,
        task=TaskView("t", "prompt", "fake:1", tools, {}, status, None, timeout_at),
        now=NOW,
        items=items or [],
        calls=calls or [],
    )


def call(
    call_id: str,
    index: int,
    *,
    state: CallState = CallState.PENDING,
    queued: bool = False,
    outcome: Outcome | None = None,
    settled_at: datetime | None = None,
    deadline_at: datetime | None = None,
    name: str = "read",
) -> CallView:
    return CallView(
        call_id,
        1,
        index,
        name,
        {"path": call_id},
        state,
        outcome,
        {"v": call_id} if outcome else None,
        NOW if queued else None,
        None,
        settled_at,
        deadline_at,
    )


def test_call_model_persists_calls_and_validates_them() -> None:
    response = ModelResponse(
        output=[
            NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "hi"}),
            tool_call_item("a", "read", {"path": "x"}),
            tool_call_item("b", "nope", {}),
            tool_call_item("c", "read", {"path": 3}),
            tool_call_item("d", "read", "{broken"),
            tool_call_item("a", "read", {"path": "dup"}),
        ]
    )
    t = call_model.run(view(Phase.CALL_MODEL), deps(FakeModel(response)))
    assert t.to is Phase.DISPATCH_TOOLS and t.model_calls == 1
    ids = [c.call_id for c in t.calls]
    assert ids == ["a", "b", "c", "d", "a#2"]  # duplicate ids are made unique, never dropped
    assert [c.index for c in t.calls] == [0, 1, 2, 3, 4]
    settled = {c.call_id: c.settled for c in t.calls}
    assert settled["a"] is None and settled["a#2"] is None
    assert settled["b"][0] is Outcome.ERROR and "unknown tool" in settled["b"][1]["error"]
    assert "invalid arguments" in settled["c"][1]["error"]
    assert "not a JSON object" in settled["d"][1]["error"]
    # Items keep the model's order, and the call items carry the unique ids.
    assert [i.call_id for i in t.items if i.kind is ItemKind.TOOL_CALL] == ids


def test_call_model_final_answer_becomes_the_final_item() -> None:
    response = ModelResponse(
        output=[NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "done"})]
    )
    t = call_model.run(view(Phase.CALL_MODEL, attempts=2), deps(FakeModel(response)))
    assert t.to is Phase.REPORT_TERMINAL
    assert [i.kind for i in t.items] == [ItemKind.FINAL]
    assert t.items[0].payload == {"content": "done"}
    assert t.model_repeats == 1  # I3: a second claim of this version is a counted repeat


def test_a_model_turn_asking_for_a_held_call_makes_the_task_wait_in_its_own_commit() -> None:
    # I23/I25: the call is held from the model's commit on; the task says so from then, not
    # from the dispatch tick, which a kill may delay (caught by chaos, every step published).
    tools = registry()
    tools.add(build_tool(a_tool, name="write", effect="write", approval=True))
    response = ModelResponse(
        output=[
            tool_call_item("a", "read", {"path": "x"}),
            tool_call_item("b", "write", {"path": "y"}),
        ]
    )
    d = deps(FakeModel(response))
    d = PhaseDeps(
        model_for=d.model_for, tools=tools, scheduler=d.scheduler, limits=d.limits, sleep=d.sleep
    )
    t = call_model.run(view(Phase.CALL_MODEL), d)
    assert [c.hold for c in t.calls] == [None, Hold.APPROVAL]
    assert t.task_status is TaskStatus.WAITING
    plain = ModelResponse(output=[tool_call_item("a", "read", {"path": "x"})])
    assert call_model.run(view(Phase.CALL_MODEL), deps(FakeModel(plain))).task_status is None


def test_call_model_disallowed_tool_is_an_error_result() -> None:
    response = ModelResponse(output=[tool_call_item("a", "wait", {"task": "x"})])
    t = call_model.run(view(Phase.CALL_MODEL, tools=["read"]), deps(FakeModel(response)))
    assert (
        t.calls[0].settled is not None and "unknown tool 'wait'" in t.calls[0].settled[1]["error"]
    )


def test_call_model_transient_error_waits_with_a_wake_up_time() -> None:
    t = call_model.run(
        view(Phase.CALL_MODEL), deps(FakeModel(TransientModelError("429", retry_after=90)))
    )
    assert t.to is None and t.wake_at == NOW + timedelta(seconds=90)
    assert t.state["model_retries"] == 1 and not t.publish_next


def test_call_model_gives_up_after_bounded_retries() -> None:
    from charlie.models.base import ModelError

    with pytest.raises(ModelError):
        call_model.run(
            view(Phase.CALL_MODEL, state={"model_retries": 7}),
            deps(FakeModel(TransientModelError("503")), model_retries=8),
        )


def test_call_model_retry_records_the_error_attempts_and_next_attempt() -> None:
    """I36: what status, list, watch, the console and doctor show of a retried model call."""
    from charlie.models import retrying

    failure = TransientModelError("conn refused", evidence={"attempts": 2})
    failed_at = NOW + timedelta(seconds=1)
    on_w1 = replace(deps(FakeModel(failure)), worker="w1", clock=lambda: failed_at)
    t = call_model.run(view(Phase.CALL_MODEL), on_w1)
    retry = retrying.from_state(t.state)
    assert retry is not None and retry.error == "conn refused"
    assert retry.attempts == 2 and retry.since == NOW and retry.next_at == t.wake_at
    assert retry.until == NOW + timedelta(seconds=600)
    # the try and the wait after it, for the timeline: who tried, when, to when
    (wait,) = retry.waits
    assert (wait.worker, wait.turn, wait.attempts) == ("w1", 1, 2)
    assert (wait.began, wait.failed_at, wait.next_at) == (NOW, failed_at, t.wake_at)
    t = call_model.run(view(Phase.CALL_MODEL, state=t.state), deps(FakeModel(failure)))
    again = retrying.from_state(t.state)
    assert again is not None and again.attempts == 4 and again.since == NOW
    assert [w.attempts for w in again.waits] == [2, 4]
    line = again.describe(NOW)
    assert "4 attempts failed" in line and "last error: conn refused" in line
    assert "next attempt at 00:00:02 UTC (in 2 s)" in line and "gives up at 00:10:00" in line
    # the transition's note counts as the state does
    assert t.note is not None and "4 attempts failed" in t.note


def test_call_model_retry_ends_at_its_time_bound_naming_it() -> None:
    """I36: the whole retry is bounded in time; its end is a failure that names the bound."""
    from charlie.models import retrying
    from charlie.models.base import ModelError

    since = NOW - timedelta(seconds=55)
    state = {
        "model_retries": 3,
        retrying.STATE_KEY: retrying.Retrying("x", 6, since, NOW, 60.0).as_state(),
    }
    failure = TransientModelError("HTTP 503: overloaded", retry_after=10)
    with pytest.raises(ModelError) as raised:
        call_model.run(
            view(Phase.CALL_MODEL, state=state),
            deps(FakeModel(failure), model_retry_seconds=60.0),
        )
    message = str(raised.value)
    assert "CHARLIE_MODEL_RETRY_SECONDS=60" in message and "7 attempts over 55 s" in message
    assert message.endswith("last error: HTTP 503: overloaded")
    # within the bound, the same failure waits for its retry
    t = call_model.run(
        view(Phase.CALL_MODEL, state=state), deps(FakeModel(failure), model_retry_seconds=70.0)
    )
    assert t.wake_at == NOW + timedelta(seconds=10)


def test_a_model_answer_clears_the_retry_state() -> None:
    from charlie.models import retrying

    retry = retrying.Retrying("x", 1, NOW, NOW, 60.0).as_state()
    t = call_model.run(
        view(Phase.CALL_MODEL, state={"model_retries": 1, retrying.STATE_KEY: retry}), deps()
    )
    assert retrying.STATE_KEY not in t.state and "model_retries" not in t.state


def test_model_sees_the_committed_transcript() -> None:
    model = FakeModel(ModelResponse(output=[]))
    items = [Item(0, 0, ItemKind.INPUT, None, {"role": "user", "content": "x"})]
    call_model.run(view(Phase.CALL_MODEL, items=items), deps(model))
    assert model.requests[0].items == items and model.requests[0].turn == 1
    assert {t.name for t in model.requests[0].tools} == {"read", "wait"}


def test_dispatch_queues_at_most_k_in_call_order() -> None:
    calls = [call(f"c{n}", n) for n in range(10)]
    calls[0] = call("c0", 0, queued=True)
    calls[1] = call("c1", 1, state=CallState.SETTLED, outcome=Outcome.ERROR)
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=calls), deps(dispatch_batch=4))
    assert [c for c, _ in t.queue_calls] == ["c2", "c3", "c4", "c5"]
    assert all(d == NOW + timedelta(seconds=10) for _, d in t.queue_calls)
    assert t.to is Phase.DISPATCH_TOOLS  # more left for the next tick
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=calls[:4]), deps(dispatch_batch=4))
    assert t.to is Phase.AWAIT_TOOLS


def test_dispatch_publishes_the_await_tick_only_when_nothing_is_open() -> None:
    """I7: while calls are open, the settler of the last one runs the await tick; when the
    last dispatch finds every call already settled, nobody else would, so it does."""
    queued_open = [call("a", 0, queued=True), call("b", 1)]
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=queued_open), deps())
    assert t.to is Phase.AWAIT_TOOLS and not t.publish_next  # b just queued: b's settler
    earlier_open = [call("a", 0, queued=True)]
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=earlier_open), deps())
    assert t.queue_calls == [] and not t.publish_next  # a's settler runs it
    all_settled = [
        call("a", 0, state=CallState.SETTLED, outcome=Outcome.OK),
        call("b", 1, state=CallState.SETTLED, outcome=Outcome.ERROR),
    ]
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=all_settled), deps())
    assert t.to is Phase.AWAIT_TOOLS and t.publish_next


def test_dispatching_a_wait_marks_the_task_waiting() -> None:
    t = dispatch_tools.run(view(Phase.DISPATCH_TOOLS, calls=[call("w", 0, name="wait")]), deps())
    assert t.task_status is TaskStatus.WAITING


def test_await_settles_deadlines_and_waits_for_the_rest() -> None:
    past, future = NOW - timedelta(seconds=1), NOW + timedelta(seconds=30)
    calls = [
        call("late", 0, queued=True, deadline_at=past),
        call("open", 1, queued=True, deadline_at=future),
    ]
    t = await_tools.run(view(Phase.AWAIT_TOOLS, calls=calls), deps())
    assert t.to is None and t.wake_at == future
    assert [(s.call_id, s.outcome) for s in t.settle] == [("late", Outcome.DEADLINE_EXCEEDED)]
    done = [call("a", 0, state=CallState.SETTLED, outcome=Outcome.OK)]
    assert await_tools.run(view(Phase.AWAIT_TOOLS, calls=done), deps()).to is Phase.ADVANCE_TURN


def test_advance_orders_results_by_call_not_by_finish() -> None:
    calls = [
        call(
            "first",
            0,
            state=CallState.SETTLED,
            outcome=Outcome.OK,
            settled_at=NOW + timedelta(seconds=3),
        ),
        call(
            "second",
            1,
            state=CallState.SETTLED,
            outcome=Outcome.INTERRUPTED,
            settled_at=NOW + timedelta(seconds=1),
        ),
        call(
            "third",
            2,
            state=CallState.SETTLED,
            outcome=Outcome.OK,
            settled_at=NOW + timedelta(seconds=2),
        ),
    ]
    t = advance_turn.run(view(Phase.ADVANCE_TURN, calls=calls), deps())
    assert [i.call_id for i in t.items] == ["first", "second", "third"]
    assert t.finish_order == {"second": 1, "third": 2, "first": 3}
    assert t.next_turn and t.to is Phase.CALL_MODEL
    assert "INTERRUPTED" in t.items[1].payload["content"]


def test_advance_refuses_a_partial_turn() -> None:
    calls = [
        call("a", 0, state=CallState.SETTLED, outcome=Outcome.OK),
        call("b", 1, state=CallState.STARTED),
    ]
    t = advance_turn.run(view(Phase.ADVANCE_TURN, calls=calls), deps())
    assert t.to is Phase.AWAIT_TOOLS and not t.items


def test_report_terminal_retries_then_reports() -> None:
    final = [Item(5, 2, ItemKind.FINAL, None, {"content": "answer"})]
    sched = FakeScheduler(failures=2)
    t = report_terminal.run(
        view(Phase.REPORT_TERMINAL, items=final), deps(scheduler=sched, report_retries=4)
    )
    assert t.to is Phase.DONE and len(sched.calls) == 3
    assert sched.calls[-1][1] is TaskStatus.SUCCEEDED and sched.calls[-1][2]["answer"] == "answer"


def test_report_terminal_stores_a_wake_up_when_retries_run_out() -> None:
    final = [Item(5, 2, ItemKind.FINAL, None, {"content": "answer"})]
    t = report_terminal.run(
        view(Phase.REPORT_TERMINAL, items=final),
        deps(scheduler=FakeScheduler(failures=9), report_retries=3),
    )
    assert t.to is None and t.wake_at is not None and t.state["report_attempts"] == 3


def test_report_terminal_already_terminal_is_benign() -> None:
    final = [Item(5, 2, ItemKind.FINAL, None, {"content": "answer"})]
    t = report_terminal.run(
        view(Phase.REPORT_TERMINAL, items=final), deps(scheduler=FakeScheduler(accept=False))
    )
    assert t.to is Phase.DONE and t.state["accepted"] is False


def test_boundary_stops_canceled_and_timed_out_runs() -> None:
    calls = [
        call("done", 0, state=CallState.SETTLED, outcome=Outcome.OK),
        call("open", 1, state=CallState.STARTED),
    ]
    v = view(Phase.AWAIT_TOOLS, calls=calls, status=TaskStatus.CANCELED)
    assert boundary.stop_reason(v) is TaskStatus.CANCELED
    t = boundary.stop(v, TaskStatus.CANCELED)
    assert t.to is Phase.REPORT_TERMINAL and t.state["stop"] == "canceled"
    assert [(s.call_id, s.outcome) for s in t.settle] == [("open", Outcome.CANCELED)]
    assert [i.call_id for i in t.items] == ["done", "open"]  # every call keeps one result (I8)
    late = view(Phase.CALL_MODEL, timeout_at=NOW - timedelta(seconds=1))
    assert boundary.stop_reason(late) is TaskStatus.TIMED_OUT
    assert boundary.stop_reason(view(Phase.REPORT_TERMINAL, status=TaskStatus.CANCELED)) is None


def test_a_stop_takes_the_waiting_mail_in_once_after_the_closed_turn() -> None:
    """I22, I18: a stop at a tool phase's or call_model's boundary takes the waiting messages
    in after the results of the turn it closed, once, and stays a stop (the final answer's
    reopen does not apply to it); a closed call tells the model what closed it (I15)."""
    from charlie.domain import Message
    from charlie.executor.phases.mailbox import reopen_final

    mail = [Message(7, "m-1", "also this", "ann")]
    open_call = [call("open", 0, state=CallState.STARTED)]
    v = replace(
        view(Phase.AWAIT_TOOLS, calls=open_call, status=TaskStatus.TIMED_OUT), messages=mail
    )
    t = boundary.stop(v, TaskStatus.TIMED_OUT)
    assert [(i.kind, i.call_id) for i in t.items] == [
        (ItemKind.TOOL_RESULT, "open"),
        (ItemKind.INPUT, None),
    ]
    assert t.take_messages == [(7, 1)]
    assert "the task timed out" in t.items[0].payload["content"]
    assert "canceled" not in t.items[0].payload["content"].split(":", 1)[1]
    at_model = replace(view(Phase.CALL_MODEL, status=TaskStatus.CANCELED), messages=mail)
    stopped = boundary.stop(at_model, TaskStatus.CANCELED)
    assert [i.payload.get("content") for i in stopped.items] == ["also this"]
    assert reopen_final(at_model, stopped) is stopped  # still a stop, its mail taken once
    # and at call_model's boundary without a stop, the mail goes in before the model call
    taken = boundary.take_mail(replace(view(Phase.CALL_MODEL), messages=mail))
    assert taken is not None and taken.to is Phase.CALL_MODEL and taken.take_messages == [(7, 0)]
    assert boundary.take_mail(view(Phase.CALL_MODEL)) is None


def test_failure_and_poison_transitions_carry_structured_errors() -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        t = boundary.fail(view(Phase.DISPATCH_TOOLS), exc)
    error = t.state["error"]
    assert t.to is Phase.REPORT_FAILURE
    assert (error["phase"], error["type"], error["attempt"]) == ("dispatch_tools", "KeyError", 1)
    assert "Traceback" in error["traceback"]
    p = boundary.poison(view(Phase.CALL_MODEL, attempts=6), 5)
    assert p.to is Phase.REPORT_FAILURE and p.state["error"]["type"] == "PoisonMessage"
