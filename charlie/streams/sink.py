"""The writer's side: what the executor hands events to (never raising, never blocking long).

:class:`TaskEvents` appends to a transport; :data:`NO_EVENTS` drops everything (streaming off).
A transport that fails is logged and left alone for a while: a watcher's stream is never worth
slowing a run down for (I28).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from charlie.models.base import Deltas
from charlie.streams.base import Transport

log = logging.getLogger("charlie.streams")

#: a field's text (arguments, results, reasons) is cut to this many characters in an event
FIELD_CHARS = 4000
#: after a failed append, appends are skipped this long
BACKOFF_SECONDS = 30.0


def clip(text: str, limit: int = FIELD_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class EventSink(Protocol):
    enabled: bool

    def emit(self, task_id: str, kind: str, **fields: Any) -> None: ...

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream: ...


class NoEvents:
    """Streaming is off: nothing is built or sent."""

    enabled = False

    def emit(self, task_id: str, kind: str, **fields: Any) -> None:
        pass

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream:
        return ModelStream(self, task_id, turn, call)


NO_EVENTS: EventSink = NoEvents()


class TaskEvents:
    enabled = True

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._failed_at = -BACKOFF_SECONDS
        self._lock = threading.Lock()

    def emit(self, task_id: str, kind: str, **fields: Any) -> None:
        if time.monotonic() - self._failed_at < BACKOFF_SECONDS:
            return
        event = {"type": kind, "task_id": task_id, "at": round(time.time(), 3), **fields}
        try:
            self.transport.append(task_id, [event])
        except Exception as exc:
            with self._lock:
                self._failed_at = time.monotonic()
            log.warning(
                "the %s event stream failed; events are dropped for %.0f s: %s",
                self.transport.name,
                BACKOFF_SECONDS,
                exc,
            )

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream:
        return ModelStream(self, task_id, turn, call)


class ModelStream(Deltas):
    """One model call attempt's stream: the ``Deltas`` a client writes to, plus its start and
    end. ``call`` names the attempt (``turn.version.attempt``): a repeat after a crash is a new
    call, and marks the earlier one abandoned."""

    def __init__(self, sink: EventSink, task_id: str, turn: int, call: str) -> None:
        self.sink = sink
        self.task_id = task_id
        self.turn = turn
        self.call = call

    def _emit(self, kind: str, **fields: Any) -> None:
        self.sink.emit(self.task_id, kind, turn=self.turn, call=self.call, **fields)

    def start(self, **fields: Any) -> None:
        self._emit("model_start", **fields)

    def end(self, status: str, reason: str | None = None) -> None:
        self._emit("model_end", status=status, reason=clip(reason) if reason else None)

    def text(self, delta: str) -> None:
        if delta:
            self._emit("text", text=delta)

    def reasoning(self, delta: str) -> None:
        if delta:
            self._emit("reasoning", text=delta)

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        self._emit("tool_args", call_id=call_id, name=name, text=arguments_delta)

    def restart(self, reason: str) -> None:
        self._emit("model_restart", reason=clip(reason))
