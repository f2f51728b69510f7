"""OpenTelemetry traces: one trace per task, across workers and crashes.

A task's trace context is stored with it at submit (``tasks.trace``, see
:func:`charlie.observe.new_trace`): the trace id and the id of the task's own span, whose
parent is the producer's span when it had one. Every tick, on any worker and after any crash,
is a child of that span, so the trace survives the process in the middle dying; the worker
whose tick ends the task records the task's span itself, from its creation to its end.

- a span per tick, named by its phase, with task, execution, version, worker and what the
  tick did (``charlie.tick.result``: moved, waiting, stale, lost_lease, ...);
- a span per model call, inside its tick, after the GenAI semantic conventions
  (``gen_ai.request.model``, ``gen_ai.usage.*``, ``gen_ai.response.finish_reasons``);
- a span per tool call from its dispatch-start (I9) to its settlement, by whoever settled it
  (a worker, a sweep), with its effect and outcome; a late report is a span of its own;
- a span per sweep action (a trace of its own: a sweep serves many tasks).

Configured by the standard environment only (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``); OTLP over HTTP/protobuf,
or ``OTEL_TRACES_EXPORTER=console``. Spans are exported in batches by a thread of each process:
a SIGKILLed worker loses what it had not exported yet, never the trace.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from charlie.domain import Phase, task_id_of
from charlie.observe import CallEvent, ModelCallEvent, Observer, SweepEvent, TickScope, safely
from charlie.store import reads
from charlie.store.engine import read
from charlie.telemetry.environment import exporters
from charlie.telemetry.environment import wanted as wanted

log = logging.getLogger("charlie.telemetry")

#: tasks whose trace context a process keeps (one read per task per process beyond that).
CACHE_SIZE = 4096
#: outcomes a span marks as an error
FAILED_OUTCOMES = frozenset({"error", "interrupted", "deadline_exceeded", "denied", "canceled"})


def from_environment(env: dict[str, str]) -> TracingObserver:
    return TracingObserver.from_environment(env)


class _ChosenIds(IdGenerator):
    """Random ids, except the span id a task's own span was given at submit."""

    def __init__(self) -> None:
        self.next_span: ContextVar[int | None] = ContextVar("charlie_next_span", default=None)
        self.next_trace: ContextVar[int | None] = ContextVar("charlie_next_trace", default=None)

    def generate_span_id(self) -> int:
        chosen = self.next_span.get()
        if chosen is not None:
            self.next_span.set(None)
            return chosen
        return secrets.randbits(64) or 1

    def generate_trace_id(self) -> int:
        chosen = self.next_trace.get()
        if chosen is not None:
            self.next_trace.set(None)
            return chosen
        return secrets.randbits(128) or 1


class TaskTrace:
    """A task's stored trace context, as spans need it."""

    __slots__ = ("context", "parent", "span")

    def __init__(self, span: SpanContext, parent: SpanContext | None) -> None:
        self.span = span
        self.parent = parent
        #: the context a tick's span starts from: the task's span as a remote parent
        self.context = trace.set_span_in_context(NonRecordingSpan(span))


def parse_trace(stored: Any, task_id: str) -> TaskTrace:
    """The stored ``traceparent`` (and ``parent``, ``tracestate``); for a task stored without
    one (before migration 0008), ids derived from its id, the same on every worker."""
    trace_id = span_id = parent_id = 0
    flags = 1
    state = TraceState()
    if isinstance(stored, dict):
        try:
            _, t, s, f = str(stored.get("traceparent", "")).split("-")
            trace_id, span_id, flags = int(t, 16), int(s, 16), int(f, 16)
            parent_id = int(str(stored.get("parent") or "0"), 16)
            if stored.get("tracestate"):
                state = TraceState.from_header([str(stored["tracestate"])])
        except (ValueError, TypeError):
            trace_id = span_id = 0
    if not trace_id or not span_id:
        import hashlib

        digest = hashlib.sha256(f"charlie-task:{task_id}".encode()).hexdigest()
        trace_id, span_id, parent_id, flags = int(digest[:32], 16), int(digest[32:48], 16), 0, 1

    def remote(span: int) -> SpanContext:
        return SpanContext(
            trace_id, span, is_remote=True, trace_flags=TraceFlags(flags), trace_state=state
        )

    return TaskTrace(remote(span_id), remote(parent_id) if parent_id else None)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TracingObserver(Observer):
    enabled = True

    def __init__(self, provider: TracerProvider, ids: _ChosenIds) -> None:
        self.provider = provider
        self.ids = ids
        self.tracer = provider.get_tracer("charlie")
        self.engine: Any = None
        self.worker = ""
        self._traces: OrderedDict[str, TaskTrace] = OrderedDict()
        self._lock = threading.Lock()  # a threads pool's ticks share the cache

    @classmethod
    def from_environment(cls, env: dict[str, str]) -> TracingObserver:
        ids = _ChosenIds()
        attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": "charlie"}
        provider = TracerProvider(resource=Resource.create(attributes), id_generator=ids)
        for name in exporters(env):
            exporter = _exporter(name, env)
            if exporter is None:
                continue
            processor = (
                SimpleSpanProcessor(exporter) if name == "console" else BatchSpanProcessor(exporter)
            )
            provider.add_span_processor(processor)
        # Tools' own spans (an instrumented HTTP client in a handler) join the task's trace.
        if not isinstance(trace.get_tracer_provider(), TracerProvider):
            trace.set_tracer_provider(provider)
        return cls(provider, ids)

    def bind(self, rt: Any) -> None:
        """The runtime this observer reads task traces through (one read per task)."""
        self.engine = rt.engine
        self.worker = rt.worker

    def shutdown(self) -> None:
        self.provider.shutdown()

    # -- the task's trace --------------------------------------------------------------------

    def task_trace(self, task_id: str) -> TaskTrace:
        with self._lock:
            found = self._traces.get(task_id)
            if found is not None:
                self._traces.move_to_end(task_id)
                return found
        stored = None
        if self.engine is not None:
            try:
                with read(self.engine) as conn:
                    row = reads.task_trace(conn, task_id)
                stored = row.trace if row is not None else None
            except Exception:
                log.warning("could not read task %s's trace context", task_id, exc_info=True)
                return parse_trace(None, task_id)  # not cached: read again next time
        found = parse_trace(stored, task_id)
        with self._lock:
            self._traces[task_id] = found
            if len(self._traces) > CACHE_SIZE:
                self._traces.popitem(last=False)
        return found

    # -- hooks -------------------------------------------------------------------------------

    def tick(self, scope: TickScope) -> AbstractContextManager[TickScope]:
        return self._tick(scope)

    @contextmanager
    def _tick(self, scope: TickScope) -> Iterator[TickScope]:
        task_id = task_id_of(scope.execution_id)
        task = self.task_trace(task_id)
        span = self.tracer.start_span(
            scope.phase.value,
            context=task.context,
            attributes={
                "charlie.task.id": task_id,
                "charlie.execution.id": scope.execution_id,
                "charlie.phase": scope.phase.value,
                "charlie.version": scope.version,
                "charlie.worker": scope.worker,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield scope
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
            raise
        finally:
            otel_context.detach(token)
            span.set_attribute("charlie.tick.result", scope.result or "raised")
            if scope.to is not None:
                span.set_attribute("charlie.tick.to", scope.to.value)
            if scope.turn is not None:
                span.set_attribute("charlie.turn", scope.turn)
            if scope.attempts:
                span.set_attribute("charlie.attempt", scope.attempts)
            if scope.note:
                span.set_attribute("charlie.note", scope.note[:300])
            span.end()
            if scope.to is Phase.DONE and scope.result == "done":
                # after the tick's commit: a failure here costs the task's span, nothing else
                safely(self._task_span, task_id, task)

    def _task_span(self, task_id: str, task: TaskTrace) -> None:
        """The task's own span, recorded once by the worker whose tick ended it."""
        if self.engine is None:
            return
        with read(self.engine) as conn:
            row = reads.task_trace(conn, task_id)
            resumes = reads.task_resumes(conn, task_id) if row is not None else None
        if row is None:
            return
        attributes: dict[str, str | int] = {
            "charlie.task.id": task_id,
            "charlie.task.status": str(row.status),
            "gen_ai.request.model": str(row.model),
        }
        if resumes is not None and resumes.count:
            # A resumed task ends again: its span id was spent on its first end. This life is
            # a span of its own under the first (charlie.resume).
            attributes["charlie.task.resumes"] = int(resumes.count)
            name, context, started = "charlie task (resumed)", task.context, resumes.last
        else:
            name, started = "charlie task", row.created_at
            if task.parent is not None:
                context = trace.set_span_in_context(NonRecordingSpan(task.parent))
            else:
                # A root span: the SDK draws its trace id too; it draws the stored one.
                context = otel_context.Context()
                self.ids.next_trace.set(task.span.trace_id)
            self.ids.next_span.set(task.span.span_id)
        span = self.tracer.start_span(
            name, context=context, start_time=_time_ns(started), attributes=attributes
        )
        if str(row.status) != "succeeded":
            span.set_status(Status(StatusCode.ERROR, f"task {row.status}"))
        span.end(end_time=_time_ns(row.finished_at) if row.finished_at else None)
        with self._lock:
            self._traces.pop(task_id, None)

    def invocation(
        self, execution_id: str, turn: int, call_id: str
    ) -> AbstractContextManager[None]:
        return self._invocation(execution_id)

    @contextmanager
    def _invocation(self, execution_id: str) -> Iterator[None]:
        token = otel_context.attach(self.task_trace(task_id_of(execution_id)).context)
        try:
            yield
        finally:
            otel_context.detach(token)

    def model_call(self, event: ModelCallEvent) -> None:
        provider, _, name = event.model.partition(":")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider if name else "charlie",
            "gen_ai.request.model": name or event.model,
            "gen_ai.usage.input_tokens": event.input_tokens,
            "gen_ai.usage.output_tokens": event.output_tokens,
            "charlie.task.id": event.task_id,
            "charlie.turn": event.turn,
            "charlie.model.outcome": event.outcome,
        }
        if event.reasoning_tokens:
            attributes["gen_ai.usage.reasoning_tokens"] = event.reasoning_tokens
        if event.cache_read_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = event.cache_read_tokens
        if event.cache_write_tokens:
            attributes["gen_ai.usage.cache_creation.input_tokens"] = event.cache_write_tokens
        if event.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [event.finish_reason]
        if event.error:
            attributes["error.type"] = event.error.split(":", 1)[0]
        # Inside its tick: the tick's span is current.
        current = trace.get_current_span()
        context = (
            None if current.get_span_context().is_valid else self.task_trace(event.task_id).context
        )
        span = self.tracer.start_span(
            f"chat {name or event.model}",
            context=context,
            kind=SpanKind.CLIENT,
            start_time=_ns(event.started),
            attributes=attributes,
        )
        if event.outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, (event.error or event.outcome)[:500]))
        span.end(end_time=_ns(event.ended))

    def call_settled(self, event: CallEvent) -> None:
        task = self.task_trace(event.task_id)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": event.tool,
            "gen_ai.tool.call.id": event.call_id,
            "charlie.task.id": event.task_id,
            "charlie.turn": event.turn,
            "charlie.tool.outcome": event.outcome,
            "charlie.tool.settled_by": event.by,
            "charlie.tool.late_report": event.late,
        }
        if event.effect:
            attributes["charlie.tool.effect"] = event.effect
        if event.duration_ms is not None:
            attributes["charlie.tool.handler_ms"] = round(event.duration_ms, 3)
        name = f"{'late report' if event.late else 'execute_tool'} {event.tool}"
        start = event.settled if event.late or event.started is None else event.started
        span = self.tracer.start_span(
            name, context=task.context, start_time=_ns(start), attributes=attributes
        )
        if event.outcome in FAILED_OUTCOMES and not event.late:
            span.set_status(Status(StatusCode.ERROR, event.outcome))
        span.end(end_time=_ns(event.settled))

    def sweep(self, event: SweepEvent) -> None:
        span = self.tracer.start_span(
            f"sweep {event.sweep}",
            context=otel_context.Context(),  # a trace of its own
            start_time=_ns(event.started),
            attributes={
                "charlie.sweep": event.sweep,
                "charlie.sweep.action": event.action,
                "charlie.sweep.count": event.count,
                "charlie.worker": event.worker,
            },
        )
        span.end(end_time=_ns(event.ended))


def _time_ns(value: datetime | None) -> int | None:
    return None if value is None else _ns(value.timestamp())


def _exporter(name: str, env: dict[str, str]) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        if protocol == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            except ImportError as exc:
                raise RuntimeError(
                    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
                    "opentelemetry-exporter-otlp-proto-grpc; Charlie ships http/protobuf "
                    "(port 4318)"
                ) from exc
            exporter: SpanExporter = GrpcExporter()
            return exporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name != "none":
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
    return None
