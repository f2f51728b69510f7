"""What the engine tells telemetry: a thin observer, switched off at no cost.

The executor, the settlers and the sweeps call an :class:`Observer` at a few points: around a
tick, around a model call, when a tool call settles (or reports late), after a sweep action.
The default observer does nothing and allocates nothing; :mod:`charlie.telemetry` builds one
that records spans (OpenTelemetry) and metrics (Prometheus) when the environment asks for them.
Events carry plain values, never a connection or a lock: an observer runs after the commit it
reports on and can neither block nor undo it, and an observer that raises is logged and ignored
by :func:`safely`.

This module sits at the bottom of the layers (it imports only the domain) so that the executor
can call the observer it is handed without importing telemetry, which sits above it.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from charlie.domain import Phase

log = logging.getLogger("charlie.telemetry")


@dataclass(slots=True)
class TickScope:
    """One tick as an observer sees it; the tick shell fills it in as it goes."""

    execution_id: str
    phase: Phase
    version: int
    worker: str
    task_id: str | None = None
    #: "moved", "waiting", "done", "stale", "lost_lease", "refused" (tick.TickResult)
    result: str | None = None
    to: Phase | None = None
    #: the claim's attempt count (a repeat of this version when > 1)
    attempts: int = 0
    turn: int | None = None
    #: what the committed transition counted (I3: a repeat is a model call whose result a
    #: crash lost, made again)
    model_calls: int = 0
    model_repeats: int = 0
    #: the transition's note ("queued 3, 0 left", "poison", ...)
    note: str | None = None
    #: (tool, outcome) of each tool result the committed transition entered into the
    #: transcript (advance_turn, or a stop closing a turn): every call's outcome once, whoever
    #: settled it (a worker, a sweep, a person's deny). Filled only when an observer is on.
    results: tuple[tuple[str, str], ...] = ()
    #: compaction items the committed transition recorded (a summary of older turns, I29):
    #: (the model, tokens before, tokens after) of each
    compactions: tuple[tuple[str, int, int], ...] = ()
    #: whatever the observer keeps for itself between entering and leaving (a span, a timer)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelCallEvent:
    task_id: str
    execution_id: str
    turn: int
    model: str
    started: float  # time.time()
    ended: float
    #: "ok", "retry" (a transient failure, tried again later) or "error"
    outcome: str
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str | None = None
    tool_calls: int = 0
    error: str | None = None
    #: parts of input_tokens read from / written to the provider's prompt cache
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: "turn" (the agent's next turn) or "summary" (a compaction's summary call, I29)
    purpose: str = "turn"


@dataclass(frozen=True, slots=True)
class CallEvent:
    """A tool call's settlement (or a late report, I12/I13), recorded once it committed."""

    task_id: str
    execution_id: str
    turn: int
    call_id: str
    tool: str
    outcome: str
    #: who settled it: a worker, a sweep, a person
    by: str
    settled: float  # time.time()
    #: when it was marked started (dispatch-started, I9), if it was
    started: float | None = None
    duration_ms: float | None = None
    late: bool = False
    #: the tool's effect ("read", "write", "wait"), when this process knows the tool
    effect: str | None = None


@dataclass(frozen=True, slots=True)
class SweepEvent:
    sweep: str
    action: str
    count: int
    started: float
    ended: float
    worker: str


class Observer:
    """The engine's telemetry hooks. This base does nothing: the default, at no cost."""

    #: False: callers may skip building events at all.
    enabled: bool = False

    def tick(self, scope: TickScope) -> AbstractContextManager[TickScope]:
        """Entered around one tick (claim, phase, commit); the shell fills ``scope`` in."""
        return nullcontext(scope)

    def invocation(
        self, execution_id: str, turn: int, call_id: str
    ) -> AbstractContextManager[None]:
        """Entered around one tool invocation's claim, handler and settle (a published
        ``charlie.tool.invoke``); a turn's local call runs inside its dispatch tick's scope."""
        return nullcontext()

    def wrap_model(self, spec: str, model: Any) -> Any:
        """The model a worker calls for ``spec``: this one, or one that reports its calls
        (model_call) around it. Called once per model per process, only when enabled."""
        return model

    def model_call(self, event: ModelCallEvent) -> None:
        pass

    def call_settled(self, event: CallEvent) -> None:
        pass

    def sweep(self, event: SweepEvent) -> None:
        pass

    def fused_commit(self, commit: str, applied: bool) -> None:
        """A fused commit was sent: ``commit`` names which (``model_turn``: a model
        call's result with its dispatch; ``settle_turn``: a local call's settle with the next
        claim; ``settle_held``: a published call's settle), ``applied`` False when its rows
        were not as predicted and the steps were written one by one instead."""

    def model_limit(self, limit: str, event: str) -> None:
        """A provider limit the fleet keeps (CHARLIE_MODEL_LIMITS, I30) let a model call
        through (``granted``), held it back (``waited``), or its provider refused one for load
        and asked the fleet to pause (``throttled``: a 429 or 529)."""

    def gauges(self, read: Callable[[], dict[str, Any]]) -> None:
        """A sweep offers the fleet's gauges; ``read`` queries the database, so an observer
        that serves no metrics never calls it."""


NOOP = Observer()


def safely(hook: Callable[..., object], *args: Any) -> None:
    """Call an observer hook; telemetry never breaks the work it observes."""
    try:
        hook(*args)
    except Exception:
        name = getattr(hook, "__name__", hook)
        log.warning("telemetry hook %s raised; ignored", name, exc_info=True)


def new_trace() -> dict[str, str]:
    """A new task's trace context, stored with it (W3C ``traceparent``): the producer's current
    span, if it has one, is the task's parent (a delegate's child: its parent task's span);
    else a new trace. The span id is the task's own span, which the worker that ends the task
    records; every tick on any worker is its child. Costs no OpenTelemetry import: a producer
    that traces has imported it already."""
    trace_id, parent, flags, state = 0, 0, 1, ""
    otel = sys.modules.get("opentelemetry.trace")
    if otel is not None:
        current = otel.get_current_span().get_span_context()
        if current.is_valid:
            trace_id, parent, flags = current.trace_id, current.span_id, int(current.trace_flags)
            state = current.trace_state.to_header() if current.trace_state else ""
    trace_id = trace_id or secrets.randbits(128) or 1
    span_id = secrets.randbits(64) or 1
    trace = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"}
    if parent:
        trace["parent"] = f"{parent:016x}"
    if state:
        trace["tracestate"] = state
    return trace
