"""Telemetry operators already use: OpenTelemetry traces and Prometheus metrics.

:func:`install` gives a process's runtime the observer its environment asks for:

- traces (:mod:`charlie.telemetry.tracing`) when the standard ``OTEL_*`` environment names an
  exporter (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or
  ``OTEL_TRACES_EXPORTER=console``), unless ``OTEL_SDK_DISABLED=true``;
- metrics (:mod:`charlie.telemetry.metrics`) when ``CHARLIE_METRICS_PORT`` is set; the
  process that serves them (:func:`serve_metrics`, a worker's main process or the beat) must
  start serving before it forks the processes that count.

Neither: the runtime keeps :data:`charlie.observe.NOOP`, and the hot path pays nothing (the
benchmark's ``telemetry`` figures). Each prefork pool process installs its own after the fork:
exporter threads and sockets do not survive one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from charlie.models.base import TransientModelError
from charlie.observe import (
    NOOP,
    CallEvent,
    ModelCallEvent,
    Observer,
    SweepEvent,
    TickScope,
    safely,
)
from charlie.telemetry import environment, metrics
from charlie.telemetry.metrics import MetricsError as MetricsError
from charlie.telemetry.metrics import Server

log = logging.getLogger("charlie.telemetry")

#: each part, and whether an environment asks for it (read without importing the part)
_WANTED: dict[str, Callable[[dict[str, str]], bool]] = {
    "tracing": environment.wanted,
    "metrics": metrics.wanted,
}


class Observers(Observer):
    """Several observers as one: each hook goes to each, one failing never stops the others."""

    enabled = True

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers

    @contextmanager
    def _all(self, enter: Callable[[Observer], AbstractContextManager[Any]]) -> Any:
        with ExitStack() as stack:
            for observer in self.observers:
                try:
                    stack.enter_context(_Guarded(enter(observer)))
                except Exception:
                    log.warning("telemetry hook raised on entry; ignored", exc_info=True)
            yield

    def tick(self, scope: TickScope) -> AbstractContextManager[TickScope]:
        @contextmanager
        def entered() -> Any:
            with self._all(lambda o: o.tick(scope)):
                yield scope

        return entered()

    def invocation(
        self, execution_id: str, turn: int, call_id: str
    ) -> AbstractContextManager[None]:
        return self._all(lambda o: o.invocation(execution_id, turn, call_id))

    def wrap_model(self, spec: str, model: Any) -> Any:
        return ObservedModel(spec, model, self)

    def model_call(self, event: ModelCallEvent) -> None:
        for observer in self.observers:
            safely(observer.model_call, event)

    def call_settled(self, event: CallEvent) -> None:
        for observer in self.observers:
            safely(observer.call_settled, event)

    def sweep(self, event: SweepEvent) -> None:
        for observer in self.observers:
            safely(observer.sweep, event)

    def fused_commit(self, commit: str, applied: bool) -> None:
        for observer in self.observers:
            safely(observer.fused_commit, commit, applied)

    def gauges(self, read: Callable[[], dict[str, Any]]) -> None:
        for observer in self.observers:
            safely(observer.gauges, read)

    def shutdown(self) -> None:
        for observer in self.observers:
            stop = getattr(observer, "shutdown", None)
            if stop is not None:
                safely(stop)


class _Guarded:
    """An observer's context whose exit can neither raise nor swallow what the work raised:
    the work's exception passes through untouched, the observer's own is logged."""

    def __init__(self, inner: AbstractContextManager[Any]) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        try:
            self.inner.__exit__(kind, value, tb)
        except Exception as exc:
            if exc is not value:
                log.warning("telemetry hook raised on exit; ignored", exc_info=True)


class ObservedModel:
    """A model whose every call is reported (model_call) with its timing, usage and outcome."""

    def __init__(self, spec: str, model: Any, observer: Observer) -> None:
        self.spec = spec
        self.model = model
        self.observer = observer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def complete(self, request: Any) -> Any:
        started = time.time()
        try:
            response = self.model.complete(request)
        except Exception as exc:
            outcome = "retry" if isinstance(exc, TransientModelError) else "error"
            safely(self._report, request, started, outcome, None, exc)
            raise
        safely(self._report, request, started, "ok", response)
        return response

    def _report(
        self,
        request: Any,
        started: float,
        outcome: str,
        response: Any = None,
        error: BaseException | None = None,
    ) -> None:
        usage = getattr(response, "usage", None)
        calls = len(response.tool_calls) if response is not None else 0
        event = ModelCallEvent(
            task_id=request.task_id,
            execution_id=request.execution_id,
            turn=request.turn,
            model=self.spec,
            started=started,
            ended=time.time(),
            outcome=outcome,
            input_tokens=int(getattr(usage, "input_tokens", 0) or 0),
            output_tokens=int(getattr(usage, "output_tokens", 0) or 0),
            reasoning_tokens=int(getattr(usage, "reasoning_tokens", 0) or 0),
            cache_read_tokens=int(getattr(usage, "cache_read_tokens", 0) or 0),
            cache_write_tokens=int(getattr(usage, "cache_write_tokens", 0) or 0),
            finish_reason=None
            if response is None
            else (response.finish_reason or ("tool_calls" if calls else "stop")),
            tool_calls=calls,
            error=None if error is None else f"{type(error).__name__}: {error}"[:500],
            purpose=str(getattr(request, "purpose", "turn")),
        )
        self.observer.model_call(event)


def build_observer(environ: dict[str, str] | None = None, rt: Any = None) -> Observer:
    """The observer this environment asks for (NOOP when it asks for none)."""
    import os

    env = dict(os.environ if environ is None else environ)
    observers = [o for o in (_part("tracing", env), _part("metrics", env)) if o is not None]
    for observer in observers:
        bind = getattr(observer, "bind", None)
        if bind is not None and rt is not None:
            bind(rt)  # what it reads through: the database, the worker's name
    return Observers(observers) if observers else NOOP


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether this environment asks for any telemetry (else :func:`install` gives NOOP)."""
    import os

    env = dict(os.environ if environ is None else environ)
    return any(wanted_part(env) for wanted_part in _WANTED.values())


def serve_metrics(role: str, environ: dict[str, str] | None = None) -> Server | None:
    """Serve /metrics from this process for itself and the processes it forks from now on
    (a worker's main process, before its pool starts; the beat), when the environment asks:
    ``CHARLIE_METRICS_PORT`` (a worker), ``CHARLIE_BEAT_METRICS_PORT`` else
    ``CHARLIE_METRICS_PORT`` + 1 (the beat). None when it does not: nothing is imported.
    Raises MetricsError (a port taken, a bad value)."""
    import os

    from charlie.telemetry import metrics

    env = dict(os.environ if environ is None else environ)
    port = metrics.beat_port_of(env) if role == "beat" else metrics.port_of(env)
    if port is None:
        return None
    return metrics.serve(port, env, role)


def process_exit(pid: int | None = None) -> None:
    """A pool process ended: its metrics' live gauges go (its counters stay, and count)."""
    from charlie.telemetry import metrics

    safely(metrics.process_exit, pid)


def _part(name: str, env: dict[str, str]) -> Observer | None:
    """charlie.telemetry.<name>'s observer, if the environment asks for it (asked without
    importing the part: the OpenTelemetry SDK only for a process that traces)."""
    import importlib

    if not _WANTED[name](env):
        return None
    module = importlib.import_module(f"charlie.telemetry.{name}")
    observer: Observer = module.from_environment(env)
    return observer


def install(rt: Any, environ: dict[str, str] | None = None) -> Observer:
    """Give ``rt`` (a Runtime) the observer its environment asks for, once; returns it."""
    if getattr(rt, "telemetry_installed", False):
        current: Observer = rt.observer
        return current
    rt.telemetry_installed = True
    try:
        observer = build_observer(environ, rt)
    except Exception:
        # Telemetry never stops the work: a bad OTEL_* value or port is said, then ignored.
        log.exception("telemetry could not start; this process runs without it")
        observer = NOOP
    rt.observer = observer
    # models built before this are not observed: start from none
    rt._models.clear()
    if observer.enabled:
        log.info(
            "telemetry on: %s",
            ", ".join(type(o).__name__ for o in getattr(observer, "observers", [observer])),
        )
    return observer


def shutdown(rt: Any) -> None:
    """Flush what the observer holds (a worker process's exit)."""
    stop = getattr(rt.observer, "shutdown", None)
    if stop is not None:
        safely(stop)
    rt.observer = NOOP  # once: what comes after the flush is not observed


@contextmanager
def producer_context(request: Any) -> Any:
    """Inside it, the trace context a Celery message carried in its ``traceparent`` (and
    ``tracestate``) headers is current, so the task it submits stores it as its parent; a
    message without them changes nothing."""
    traceparent = getattr(request, "traceparent", None)
    if not isinstance(traceparent, str):
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    tracestate = getattr(request, "tracestate", None)
    if isinstance(tracestate, str):
        carrier["tracestate"] = tracestate
    token = context.attach(TraceContextTextMapPropagator().extract(carrier))
    try:
        yield
    finally:
        context.detach(token)
