"""The telemetry seam without a cluster: trace contexts, the observers, the observed model."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from charlie import logs, telemetry
from charlie.domain import Phase
from charlie.models.base import ModelResponse, TransientModelError, Usage, tool_call_item
from charlie.observe import NOOP, CallEvent, ModelCallEvent, Observer, TickScope, new_trace
from charlie.telemetry import tracing


def test_a_new_trace_without_a_current_span_is_a_new_root() -> None:
    first, second = new_trace(), new_trace()
    version, trace_id, span_id, flags = first["traceparent"].split("-")
    assert (version, flags) == ("00", "01") and len(trace_id) == 32 and len(span_id) == 16
    assert "parent" not in first
    assert first["traceparent"] != second["traceparent"]
    parsed = tracing.parse_trace(first, "t")
    assert format(parsed.span.trace_id, "032x") == trace_id
    assert format(parsed.span.span_id, "016x") == span_id and parsed.parent is None


def test_a_new_trace_inside_a_span_continues_it() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        stored = new_trace()
    context = span.get_span_context()
    assert stored["traceparent"].split("-")[1] == format(context.trace_id, "032x")
    assert stored["parent"] == format(context.span_id, "016x")
    parsed = tracing.parse_trace(stored, "t")
    assert parsed.parent is not None and parsed.parent.span_id == context.span_id


def test_a_task_without_a_stored_trace_gets_the_same_ids_on_every_worker() -> None:
    a, b = tracing.parse_trace(None, "task-1"), tracing.parse_trace({"traceparent": "x"}, "task-1")
    assert a.span.trace_id == b.span.trace_id and a.span.span_id == b.span.span_id
    assert tracing.parse_trace(None, "task-2").span.trace_id != a.span.trace_id


def test_tracing_is_wanted_only_when_the_environment_names_an_exporter() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert not tracing.wanted(
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    )


def _runtime() -> Any:
    return SimpleNamespace(observer=NOOP, _models={}, engine=None, worker="test:1")


def test_without_telemetry_the_runtime_keeps_the_no_op_observer() -> None:
    rt = _runtime()
    assert telemetry.install(rt, {}) is NOOP and rt.observer is NOOP
    assert NOOP.enabled is False


def test_telemetry_that_cannot_start_leaves_the_process_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = _runtime()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    with caplog.at_level(logging.ERROR, logger="charlie.telemetry"):
        assert telemetry.install(rt, env) is NOOP
    assert "opentelemetry-exporter-otlp-proto-grpc" in caplog.text


class Recorder(Observer):
    enabled = True

    def __init__(self) -> None:
        self.events: list[Any] = []

    def model_call(self, event: ModelCallEvent) -> None:
        self.events.append(event)

    def call_settled(self, event: CallEvent) -> None:
        raise RuntimeError("a broken observer")


class FlakyModel:
    def __init__(self, *responses: Any) -> None:
        self.responses = list(responses)

    def complete(self, request: Any) -> ModelResponse:
        response = self.responses.pop(0)
        if isinstance(response, Exception):
            raise response
        return response  # type: ignore[no-any-return]


def test_an_observed_model_reports_each_call_and_a_broken_observer_is_ignored() -> None:
    recorder = Recorder()
    observers = telemetry.Observers([recorder, Recorder()])
    answer = ModelResponse(
        output=[tool_call_item("a", "read", {})],
        usage=Usage(input_tokens=10, output_tokens=3),
    )
    model = observers.wrap_model("scripted:x", FlakyModel(TransientModelError("429"), answer))
    request = SimpleNamespace(task_id="t", execution_id="x-t", turn=2)
    with pytest.raises(TransientModelError):
        model.complete(request)
    assert model.complete(request) is answer
    retry, ok = recorder.events
    assert (retry.outcome, retry.finish_reason) == ("retry", None)
    assert (ok.outcome, ok.finish_reason, ok.tool_calls) == ("ok", "tool_calls", 1)
    assert (ok.input_tokens, ok.output_tokens, ok.turn, ok.model) == (10, 3, 2, "scripted:x")
    event = CallEvent("t", "x-t", 1, "c", "read", "ok", "w", 0.0)
    observers.call_settled(event)  # both raise: logged, not raised


def test_log_lines_carry_the_current_trace_id() -> None:
    provider = TracerProvider()
    record = logging.LogRecord("charlie.tick", logging.INFO, "", 0, "moved", None, None)
    record.task_id = "t"
    assert "trace_id" not in logs.context_of(record)
    with provider.get_tracer("test").start_as_current_span("tick") as span:
        context = logs.context_of(record)
        foreign = logs.context_of(logging.LogRecord("celery", 20, "", 0, "x", None, None))
    expected = format(span.get_span_context().trace_id, "032x")
    assert context["trace_id"] == expected and foreign == {"trace_id": expected}
    assert trace.get_current_span().get_span_context().is_valid is False


def test_a_tick_scope_reaches_every_observer() -> None:
    seen = []

    class Scoped(Observer):
        enabled = True

        def tick(self, scope: TickScope) -> Any:
            seen.append(scope.phase)
            return super().tick(scope)

    observers = telemetry.Observers([Scoped(), Scoped()])
    with observers.tick(TickScope("x-t", Phase.CALL_MODEL, 3, "w")) as scope:
        scope.result = "moved"
    assert seen == [Phase.CALL_MODEL, Phase.CALL_MODEL]


def test_an_observer_can_neither_break_a_tick_nor_hide_what_it_raised() -> None:
    from contextlib import contextmanager, suppress

    class Broken(Observer):
        enabled = True

        @contextmanager
        def tick(self, scope: TickScope) -> Any:
            try:
                yield scope
            finally:
                raise RuntimeError("the observer's own failure")

    class Swallowing(Observer):
        enabled = True

        @contextmanager
        def tick(self, scope: TickScope) -> Any:
            with suppress(Exception):  # would hide the tick's exception if it were obeyed
                yield scope

    observers = telemetry.Observers([Broken(), Swallowing()])
    with observers.tick(TickScope("x-t", Phase.CALL_MODEL, 3, "w")) as scope:
        scope.result = "moved"  # the observer's failure is logged, the tick goes on
    with pytest.raises(KeyError), observers.tick(TickScope("x-t", Phase.CALL_MODEL, 3, "w")):
        raise KeyError("the tick's own failure")
