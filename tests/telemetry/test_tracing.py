"""Traces through real workers into a real OTLP receiver.

The session's workers export with the OpenTelemetry SDK's OTLP/HTTP exporter to the receiver in
this test process (tests/support/otlp.py decodes the protobuf). A task is one trace, whatever
worker runs which tick and whichever of them dies: its trace context is stored with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.support.cluster import Cluster
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(180)]

QUICK = {"seconds": 0, "value": "v"}
PHASE_SPANS = {"load_context", "call_model", "dispatch_tools", "await_tools", "advance_turn"}


def _stored_trace(task_id: str) -> dict[str, Any]:
    from sqlalchemy import select

    from charlie.runtime import get_producer
    from charlie.store.engine import read
    from charlie.store.schema import tasks

    with read(get_producer().engine) as conn:
        stored = conn.execute(select(tasks.c.trace).where(tasks.c.id == task_id)).scalar_one()
    assert isinstance(stored, dict) and stored["traceparent"].startswith("00-")
    return stored


def _task_span(receiver: OtlpReceiver, task_id: str) -> ReceivedSpan:
    spans = wait_for(
        lambda: [s for s in receiver.of_task(task_id) if s.name == "charlie task"], timeout=30
    )
    assert len(spans) == 1, spans  # recorded once, by the worker whose tick ended the task
    return spans[0]


def test_one_trace_per_task_across_a_sigkill(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    """A worker SIGKILLed inside a write: the task's spans, from the worker that died and from
    the one that finished it, are one trace whose id and root span were stored at submit."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "q", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {
                "tool_calls": [
                    {"id": "w", "name": "ledger_write", "arguments": {"key": "k-otel", "hold": 30}}
                ]
            },
            {"say": "checked the write"},
        ]
    )
    task_id = charlie.submit("traced across a kill", model=model)
    writes = wait_for(
        lambda: [e for e in read_ledger() if e.get("task") == task_id and e["event"] == "write"]
    )
    doomed = f":{writes[0]['pid']}"

    # What the doomed worker did before the write reaches the receiver (batches of 200 ms):
    # both model calls before the write, and the call_model ticks that hold them. One worker
    # runs a whole chain of turns, and a span still in its exporter's queue dies with it: a
    # chat span may leave in one batch and its tick's span only in the next.
    def doomed_calls_exported() -> bool:
        spans = otlp_receiver.of_task(task_id)
        chats = [s for s in spans if s.name.startswith("chat ")]  # only the doomed worker's yet
        received = {s.span_id for s in spans}
        return len(chats) >= 2 and all(c.parent_span_id in received for c in chats)

    wait_for(doomed_calls_exported, timeout=20)
    cluster.kill_pid_group(int(writes[0]["pid"]))

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert api.calls(task_id)[1].outcome == "interrupted"

    stored = _stored_trace(task_id)
    _, trace_id, task_span_id, _ = stored["traceparent"].split("-")
    root = _task_span(otlp_receiver, task_id)
    spans = otlp_receiver.of_task(task_id)

    assert {s.trace_id for s in spans} == {trace_id}  # one trace, the stored one
    assert root.span_id == task_span_id and root.parent_span_id == ""
    assert root.attributes["charlie.task.status"] == "succeeded"

    ticks = [s for s in spans if s.name in PHASE_SPANS or s.name == "report_terminal"]
    assert {s.parent_span_id for s in ticks} == {task_span_id}
    workers = {s.worker for s in ticks}
    assert len(workers) >= 2 and any(w and w.endswith(doomed) for w in workers), workers
    for tick in ticks:
        assert tick.attributes["charlie.execution.id"] == f"x-{task_id}"
        assert isinstance(tick.attributes["charlie.version"], int)
        assert tick.attributes["charlie.tick.result"] in {"moved", "waiting", "done", "stale"}
    assert {"load_context", "call_model", "report_terminal"} <= {s.name for s in ticks}

    # Model calls (GenAI conventions), inside their call_model ticks.
    chats = [s for s in spans if s.name.startswith("chat ")]
    assert len(chats) >= 3
    tick_ids = {s.span_id for s in ticks if s.name == "call_model"}
    for chat in chats:
        assert chat.parent_span_id in tick_ids
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "scripted"
        assert "gen_ai.usage.input_tokens" in chat.attributes
    assert {tuple(c.attributes["gen_ai.response.finish_reasons"]) for c in chats} >= {
        ("tool_calls",),
        ("stop",),
    }

    # Tool calls from dispatch-start to settlement: the write settled by the sweep.
    tools = {s.attributes["gen_ai.tool.call.id"]: s for s in spans if s.name.startswith("execute")}
    assert tools["q"].attributes["charlie.tool.outcome"] == "ok"
    write = tools["w"]
    assert write.name == "execute_tool ledger_write"
    assert write.attributes["charlie.tool.outcome"] == "interrupted"
    assert write.attributes["charlie.tool.effect"] == "write"
    assert str(write.attributes["charlie.tool.settled_by"]).startswith("sweep@")
    assert write.status == 2 and write.parent_span_id == task_span_id
    assert write.end_ns - write.start_ns > 1_000_000_000  # from its start, before the kill


def test_the_producers_span_is_the_tasks_parent(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("producer")  # unexported: only its ids matter
    model, _ = script([{"say": "hi"}])
    with tracer.start_as_current_span("producer request") as span:
        task_id = charlie.submit("traced from a producer", model=model)
        context = span.get_span_context()
    assert trace.get_current_span().get_span_context().is_valid is False
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED

    root = _task_span(otlp_receiver, task_id)
    assert root.trace_id == format(context.trace_id, "032x")
    assert root.parent_span_id == format(context.span_id, "016x")
    assert {s.trace_id for s in otlp_receiver.of_task(task_id)} == {root.trace_id}


def test_worker_log_lines_carry_the_trace_id(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "done"},
        ]
    )
    task_id = charlie.submit("traced log lines", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    trace_id = _stored_trace(task_id)["traceparent"].split("-")[1]

    def lines() -> list[str]:
        found = []
        for path in Path(cluster.home).glob("worker-*.log"):
            found += [
                line for line in path.read_text(errors="replace").splitlines() if task_id in line
            ]
        return found

    ours = wait_for(lambda: [line for line in lines() if "transition" in line], timeout=20)
    assert ours and all(f"trace_id={trace_id}" in line for line in ours), ours[:3]
    settled = [line for line in lines() if "call settled" in line]
    assert settled and all(re.search(f"trace_id={trace_id}", line) for line in settled)
    # Celery's own lines about the run's tasks say the trace too (task_prerun/postrun).
    celery = [
        line
        for path in Path(cluster.home).glob("worker-*.log")
        for line in path.read_text(errors="replace").splitlines()
        if "succeeded in" in line and f"trace_id={trace_id}" in line
    ]
    assert celery, "no Celery success line carries the run's trace id"


def test_a_celery_only_producer_passes_its_trace_in_the_message_headers(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    from charlie.app import app

    model, _ = script([{"say": "hi"}])
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    app.send_task(
        "charlie.submit",
        kwargs={"prompt": "traced from Celery", "model": model, "task_id": "otel-celery-1"},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )
    wait_for(lambda: charlie.list_tasks(search="otel-celery-1"))
    assert charlie.wait("otel-celery-1", timeout=60).status is TaskStatus.SUCCEEDED
    stored = _stored_trace("otel-celery-1")
    assert stored["traceparent"].split("-")[1] == trace_id and stored["parent"] == parent
    root = _task_span(otlp_receiver, "otel-celery-1")
    assert (root.trace_id, root.parent_span_id) == (trace_id, parent)


def test_a_call_a_person_denied_is_a_span_of_the_tasks_trace(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    """A deny settles the call in the operator's process, which exports nothing: the worker
    that takes the turn's results in reports it, once."""
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "k-deny"}}]},
            {"say": "not written, as told"},
        ]
    )
    task_id = charlie.submit("traced deny", model=model, approve=["ledger_write"])
    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    charlie.deny(task_id, "w", "not today")
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    _task_span(otlp_receiver, task_id)
    (denied,) = [s for s in otlp_receiver.of_task(task_id) if s.name.startswith("execute_tool")]
    assert denied.attributes["charlie.tool.outcome"] == "denied"
    assert str(denied.attributes["charlie.tool.settled_by"]).startswith("operator:")
    assert denied.status == 2


def test_a_resumed_task_records_its_second_life_under_its_first(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    model, _ = script(
        [
            {"tool_calls": [{"id": "a", "name": "sleep_then", "arguments": QUICK}]},
            {"say": "done"},
        ]
    )
    task_id = charlie.submit("traced resume", model=model, budget={"model_calls": 1})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.FAILED  # its budget
    first = _task_span(otlp_receiver, task_id)
    charlie.resume(task_id, budget={"model_calls": 5})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    second = wait_for(
        lambda: [s for s in otlp_receiver.of_task(task_id) if s.name == "charlie task (resumed)"]
    )
    assert len(second) == 1 and second[0].parent_span_id == first.span_id
    assert second[0].attributes["charlie.task.status"] == "succeeded"
    assert [s for s in otlp_receiver.of_task(task_id) if s.name == "charlie task"] == [first]
    assert {s.trace_id for s in otlp_receiver.of_task(task_id)} == {first.trace_id}


def test_a_delegated_child_joins_its_parents_trace(
    cluster: Cluster, script: Any, otlp_receiver: OtlpReceiver
) -> None:
    """The child is submitted inside the delegate call, whose trace context is the parent
    task's: the child's own span is a child of the parent task's span, in the same trace."""
    from tests.integration.test_delegation import parent_turns

    child_model, _ = script([{"say": "compatible with 2.3"}])
    model, _ = script(parent_turns(child_model))
    parent = charlie.submit("traced delegation", model=model)
    assert charlie.wait(parent, timeout=60).status is TaskStatus.SUCCEEDED
    parent_span = _task_span(otlp_receiver, parent)
    child_span = _task_span(otlp_receiver, f"{parent}.0.d1")
    assert child_span.trace_id == parent_span.trace_id
    assert child_span.parent_span_id == parent_span.span_id
    stored = _stored_trace(f"{parent}.0.d1")
    assert stored["parent"] == parent_span.span_id
