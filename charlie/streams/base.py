"""What a stream transport is, and the events it carries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

#: the event types (``type``) a reader may see; see charlie/streams/sink.py for their fields.
#: Every event also has an ``id`` (the same fact told twice has the same one), ``task_id`` and
#: ``at``.
EVENT_TYPES = (
    "model_start",  # a model call attempt began: turn, call, attempt, model
    "text",  # model text delta: call, text
    "reasoning",  # reasoning text delta: call, text
    "tool_args",  # tool-call argument delta: call, call_id, name, text
    "model_restart",  # the call's stream was cut and is asked again: what came so far is void
    "model_end",  # call, status ("completed" or "abandoned"), reason
    "tool_call",  # a tool call the model made, committed: call_id, name, arguments, held
    "tool_started",  # a tool call was dispatched (I9): call_id
    "tool_settled",  # a tool call has its outcome, once a call (I12): call_id, name, outcome
    "tool_late_report",  # a call's handler reported after it had its outcome: call_id, outcome
    "retrying",  # a failed model call is asked again later (I36): error, attempts, next_at, until
    "final",  # the final answer committed (I16): text
    "waiting",  # the task waits for people: calls (call_id, name, hold, question)
    "verdict",  # a person's approve, deny, reply or reconcile committed: call_id, action, by
    "end",  # the task ended (a reader adds its status)
    "truncated",  # the task's log was full: deltas after this were dropped
)


class StreamUnavailable(RuntimeError):
    """The transport cannot be read (Redis down, no transport configured)."""


@dataclass(frozen=True)
class StreamEvent:
    """One event as a reader gets it: ``offset`` is where to resume after it."""

    offset: str
    data: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.data.get("type", ""))


def encode(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


def decode(raw: str | bytes) -> dict[str, Any] | None:
    """An event written by a worker, or None for anything else (a torn line)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Transport(Protocol):
    """A bounded, expiring, per-task append-only log with offsets."""

    #: a short name for messages ("redis", "file")
    name: str

    def append(self, task_id: str, events: list[dict[str, Any]]) -> None:
        """Append events to a task's log (may raise; the sink catches and logs)."""
        ...

    def read(self, task_id: str, after: str | None, block: float) -> list[StreamEvent]:
        """The events after ``after`` (None: from the start), waiting up to ``block`` seconds
        for one when there is none yet. Raises StreamUnavailable."""
        ...

    def close(self) -> None: ...
