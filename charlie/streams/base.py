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
    "tool_started",  # a tool call's start was recorded (I9), by whoever started it: call_id
    "tool_settled",  # a tool call has its outcome, once a call (I12): call_id, name, outcome
    "tool_late_report",  # a call's handler reported after it had its outcome: call_id, outcome
    "retrying",  # a failed model call is asked again later (I36): error, attempts, next_at, until
    "final",  # the final answer committed (I16): text
    "waiting",  # the task waits for people: calls (call_id, name, hold, question)
    "verdict",  # a person's approve, deny, reply or reconcile committed: call_id, action, by
    "end",  # the task ended (a reader adds its status)
    "resumed",  # an end a resume went on from (a reader's name for it): the watch goes on
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


#: a list field of an event that can grow without bound (a ``waiting`` event's held calls)
_LISTS = ("calls",)
#: what a cut text ends with
_CUT = "…"


def bound_event(event: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """``event`` as events each encoded in at most ``limit`` bytes (``limit`` of a few KiB at
    least): itself when it fits; else, where it lists what can grow (``calls``), several of the
    same type, each with a part of the list and ``part`` / ``parts`` (and its own ``id``,
    ``<id>:<part>``), the list's items themselves cut to fit; else its longest texts cut, and
    ``clipped`` set."""
    if _size(event) <= limit:
        return [event]
    for name in _LISTS:
        items = event.get(name)
        if isinstance(items, list) and items:
            return _split(event, name, items, limit)
    return [_clipped(event, limit)]


def _size(value: Any) -> int:
    return len(encode(value).encode())


def _split(event: dict[str, Any], name: str, items: list[Any], limit: int) -> list[dict[str, Any]]:
    shell = {k: v for k, v in event.items() if k != name}
    # room for the list's brackets, the part fields and a longer id
    room = limit - _size({**shell, name: [], "part": 10**6, "parts": 10**6, "id": "x" * 80})
    room = max(room, limit // 4)
    groups: list[list[Any]] = [[]]
    used = 0
    for item in items:
        if _size(item) + 1 > room:
            item = _clipped(item, room - 1) if isinstance(item, dict) else _cut(item, room // 2)
        size = _size(item) + 1
        if groups[-1] and used + size > room:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size
    base = str(event.get("id", ""))
    return [
        {**shell, name: group, "id": f"{base}:{n}", "part": n, "parts": len(groups)}
        for n, group in enumerate(groups, start=1)
    ]


def _clipped(value: dict[str, Any], limit: int) -> dict[str, Any]:
    """``value`` with its longest texts cut (halved, longest first) until it fits, and
    ``clipped`` set; what cannot be cut (numbers, names) stays."""
    out = {**value, "clipped": True}
    while _size(out) > limit:
        texts = [(len(v), k) for k, v in out.items() if isinstance(v, str) and len(v) > 16]
        nested = [k for k, v in out.items() if isinstance(v, (list, dict))]
        if texts:
            _, key = max(texts)
            out[key] = _cut(out[key], len(out[key]) // 2)
        elif nested:
            # a nested value is shown as its JSON text, to be cut as texts are
            key = max(nested, key=lambda k: _size(out[k]))
            out[key] = encode(out[key])
        else:
            break
    return out


def _cut(value: Any, chars: int) -> str:
    text = value if isinstance(value, str) else encode(value)
    return text if len(text) <= chars else text[: max(0, chars - 1)] + _CUT


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
