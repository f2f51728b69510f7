"""The writer's side: what the executor hands events to (never raising, never blocking).

:class:`TaskEvents` queues them for a writer thread that appends them to a transport;
:data:`NO_EVENTS` drops everything (streaming off). A transport that fails is logged and left
alone for a while: a watcher's stream is never worth slowing a run down for (I28).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import Any, Protocol

from charlie.models.base import Deltas
from charlie.streams.base import Transport

log = logging.getLogger("charlie.streams")

#: a field's text (arguments, results, reasons) is cut to this many characters in an event
FIELD_CHARS = 4000
#: after a failed append, appends are skipped this long
BACKOFF_SECONDS = 30.0
#: events waiting for the writer thread past which deltas are dropped
MAX_QUEUED = 10000
#: how long an exiting process waits for its queued events
EXIT_WAIT = 2.0
#: the writer thread gathers what comes within this long into one batch. Each batch costs the
#: tick's thread more than its round trip: the writer's wake-up and its turn at the GIL. At 5 ms
#: a one-call turn of a few ms paid about a batch a turn (1.2 ms of worker CPU, 1.5 to 2 ms of
#: wall, on 2 cores); at 50 ms, a batch per several turns, and a watcher still sees text
#: arrive 20 times a second.
LINGER_SECONDS = 0.05
DELTA_TYPES = frozenset({"text", "reasoning", "tool_args"})


def clip(text: str, limit: int = FIELD_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class EventSink(Protocol):
    """Where events go. ``event_id`` names what the event says: the same fact told twice
    (a call's settle, the task's end) carries the same id, so a reader that gets it twice (a
    transport is at-least-once) drops the second; left out, the event gets an id of its own."""

    enabled: bool

    def emit(
        self, task_id: str, kind: str, *, event_id: str | None = None, **fields: Any
    ) -> None: ...

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream: ...

    def flush(self, timeout: float = 5.0) -> bool: ...


class NoEvents:
    """Streaming is off: nothing is built or sent."""

    enabled = False

    def emit(self, task_id: str, kind: str, *, event_id: str | None = None, **fields: Any) -> None:
        pass

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream:
        return ModelStream(self, task_id, turn, call)

    def flush(self, timeout: float = 5.0) -> bool:
        return True


NO_EVENTS: EventSink = NoEvents()


class TaskEvents:
    """Appends events from a writer thread of this process: a tick only queues its events (no
    round trip to Redis or the disk on its way), and the thread sends what queued, in order,
    a batch per task per round trip. Bounded: past ``MAX_QUEUED`` waiting events, deltas are
    dropped. A process that exits waits a moment for what it queued (at exit); one that is
    killed loses it, as it loses its stream anyway (I28)."""

    enabled = True

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._failed_at = -BACKOFF_SECONDS
        self._queue: deque[dict[str, Any]] = deque()
        self._ready = threading.Condition()
        self._busy = False
        self._pid = 0
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # a lock held by a thread of the parent at the fork would never be released here
        self._ready = threading.Condition()
        self._queue = deque()
        self._busy = False

    def emit(self, task_id: str, kind: str, *, event_id: str | None = None, **fields: Any) -> None:
        if time.monotonic() - self._failed_at < BACKOFF_SECONDS:
            return
        event = {
            "type": kind,
            "id": event_id or uuid.uuid4().hex,
            "task_id": task_id,
            "at": round(time.time(), 3),
            **fields,
        }
        with self._ready:
            if self._pid != os.getpid():  # first use in this process (a forked pool child)
                self._start()
            if len(self._queue) >= MAX_QUEUED and kind in DELTA_TYPES:
                return
            self._queue.append(event)
            self._ready.notify()

    def model_stream(self, task_id: str, turn: int, call: str, **fields: Any) -> ModelStream:
        return ModelStream(self, task_id, turn, call)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what was queued so far is sent (or dropped); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._pid != os.getpid():
                    return False
                self._ready.wait(min(left, 0.05))
        return True

    def _start(self) -> None:
        self._pid = os.getpid()
        self._queue.clear()  # a parent's queue is the parent's to send
        self._busy = False
        threading.Thread(target=self._send_loop, name="charlie-events", daemon=True).start()
        atexit.register(self.flush, EXIT_WAIT)

    def _send_loop(self) -> None:
        pid = os.getpid()
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                    if self._pid != pid:
                        return
            # let the step that woke this thread queue the rest of its events first: one
            # wake-up and one round trip for them all, not one each
            time.sleep(LINGER_SECONDS)
            with self._ready:
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                self._send(batch)
            finally:
                with self._ready:
                    self._busy = False
                    self._ready.notify_all()

    def _send(self, batch: list[dict[str, Any]]) -> None:
        by_task: dict[str, list[dict[str, Any]]] = {}
        for event in batch:
            by_task.setdefault(event["task_id"], []).append(event)
        for task_id, events in by_task.items():
            if time.monotonic() - self._failed_at < BACKOFF_SECONDS:
                return
            try:
                self.transport.append(task_id, events)
            except Exception as exc:
                self._failed_at = time.monotonic()
                log.warning(
                    "the %s event stream failed; events are dropped for %.0f s: %s",
                    self.transport.name,
                    BACKOFF_SECONDS,
                    exc,
                )


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
