"""The model interface the call_model phase depends on.

Transcript item payloads (``charlie.domain.Item.payload``) are the wire-neutral form every client
maps to and from:

- ``input``:       ``{"role": "system" | "user", "content": str}``
- ``message``:     ``{"role": "assistant", "content": str}`` plus optional ``"raw"`` (provider item)
- ``reasoning``:   ``{"summary": str | None, "raw": {...}}`` (the provider item, replayed as is)
- ``tool_call``:   ``{"name": str, "arguments": dict | None, "raw_arguments": str}``
  (``call_id`` is on the item; ``arguments`` is ``None`` when the raw string was not JSON)
- ``tool_result``: ``{"name": str, "outcome": str, "result": JSON, "content": str}``
  (``content`` is what the model is shown; see :func:`render_tool_result`)
- ``final``:       ``{"content": str}``
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from charlie.domain import JSON, Item, ItemKind, NewItem, Outcome


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: JSON


class Deltas(Protocol):
    """Where a streaming client sends what the model writes while it writes it, for people
    watching the run. Never the answer: the durable response is what ``complete`` returns,
    written once (I16); a delta may be lost, and a repeated call streams again from the start.
    Methods must return quickly and never raise into the client."""

    def text(self, delta: str) -> None: ...

    def reasoning(self, delta: str) -> None: ...

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None: ...

    def restart(self, reason: str) -> None:
        """The stream was cut and the client asks again: every delta so far is void."""
        ...


class NoDeltas:
    """Nobody is watching: every delta is dropped."""

    def text(self, delta: str) -> None:
        pass

    def reasoning(self, delta: str) -> None:
        pass

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass


NO_DELTAS: Deltas = NoDeltas()


@dataclass(frozen=True)
class ModelRequest:
    task_id: str
    execution_id: str
    turn: int
    #: I6: the context plus the transcript as committed at the end of the previous turn.
    items: list[Item]
    tools: list[ToolSpec]
    #: where a streaming client sends deltas as they arrive (not part of the request's identity)
    deltas: Deltas = field(default=NO_DELTAS, compare=False, repr=False)
    #: ``"turn"``: the agent's next turn; ``"summary"``: a compaction's summary of older turns
    #: (executor/context.py), answered with text only
    purpose: str = "turn"
    #: told the seconds a provider asked to wait (a 429 or 529 with retry-after), so every
    #: caller of its limit waits, fleet-wide, not only this call (charlie/capacity.py)
    throttled: Callable[[float], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    #: input tokens read from the provider's prompt cache: part of ``input_tokens``, priced at
    #: the ``cache_read`` rate instead of the ``input`` one (as reasoning tokens are of output)
    cache_read_tokens: int = 0
    #: input tokens written to the provider's prompt cache: part of ``input_tokens`` too
    cache_write_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
        }


@dataclass(frozen=True)
class ModelResponse:
    """The model's output items in the order it produced them.

    Kinds are ``message``, ``reasoning`` and ``tool_call`` (with ``call_id``). A response with no
    ``tool_call`` item is the final answer; its last message becomes the ``final`` item.
    """

    output: list[NewItem]
    usage: Usage = field(default_factory=Usage)
    #: why the model stopped, as its provider says it ("stop", "tool_calls", "length",
    #: "content_filter"), for telemetry; None when it does not say.
    finish_reason: str | None = None

    @property
    def tool_calls(self) -> list[NewItem]:
        return [item for item in self.output if item.kind is ItemKind.TOOL_CALL]


class ModelError(Exception):
    """A model failure that retrying will not fix (bad request, auth, context too long,
    unusable output). Fails the run with ``evidence`` (e.g. the response body)."""

    def __init__(self, message: str, *, evidence: Any = None) -> None:
        super().__init__(message)
        self.evidence = evidence


class TransientModelError(Exception):
    """A failure worth retrying later (429, 5xx, connection). ``retry_after`` is in seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, evidence: Any = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.evidence = evidence


class Model(Protocol):
    """One model endpoint. ``complete`` is called outside any transaction (I5) and may be
    repeated after a crash before its output was committed (I3), so it must not act on the
    world itself. ``request.items`` are shared with the worker's transcript cache (the next
    turn's request reuses them): read them, never change them."""

    spec: str

    def complete(self, request: ModelRequest) -> ModelResponse: ...


def tool_call_item(call_id: str, name: str, raw_arguments: str | dict[str, Any]) -> NewItem:
    """Build a ``tool_call`` item, keeping the raw argument string the model sent."""
    if isinstance(raw_arguments, dict):
        arguments: dict[str, Any] | None = raw_arguments
        raw = json.dumps(raw_arguments)
    else:
        raw = raw_arguments
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else None
    return NewItem(
        ItemKind.TOOL_CALL,
        {"name": name, "arguments": arguments, "raw_arguments": raw},
        call_id=call_id,
    )


def render_tool_result(outcome: Outcome, result: Any) -> str:
    """The text a model is shown for a tool outcome: plain about what is and is not known."""
    if outcome is Outcome.OK:
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    detail = result if isinstance(result, dict) else {"detail": result}
    if outcome is Outcome.INTERRUPTED:
        return _render_interrupted(detail)
    if outcome is Outcome.DEADLINE_EXCEEDED:
        return (
            f"DEADLINE EXCEEDED: no result within {detail.get('deadline_seconds')} s. The work "
            "may still be running or may have finished; it was not canceled."
        )
    if outcome is Outcome.CANCELED:
        return f"CANCELED: {_ended_by(detail.get('reason'))} before this call finished."
    if outcome is Outcome.DENIED:
        # the person's name and reason are quoted as data, as an interrupted call's note is
        return (
            f"DENIED by {_quoted(detail.get('denied_by') or 'a person')}: "
            f"{_quoted(detail.get('reason') or '')}. This call was not run."
        )
    return f"ERROR: {detail.get('error', detail)}"


#: the reasons a closed call recorded before they were written as sentences
_OLD_REASONS = {
    "task canceled": "the task was canceled",
    "task timed_out": "the task timed out",
    "task failed": "the task failed",
    "the run ended before this call finished": "the run ended",
}


def _ended_by(reason: object) -> str:
    """What closed a canceled call, as its result records it (a cancel, a timeout, a failure
    of the run: the model is told which, never "canceled" for all of them). The reasons are
    the engine's own words; anything else is quoted as data."""
    if not isinstance(reason, str) or not reason:
        return "the task ended"
    reason = _OLD_REASONS.get(reason, reason)
    if reason.startswith(("the task ", "the run ")) and reason.isprintable() and len(reason) < 80:
        return reason
    return f"the call was closed ({_quoted(reason)})"


def _quoted(value: Any) -> str:
    """Text the model must read as data, not as instructions (a tool's own message, a
    person's note or name: attacker-controlled): one JSON string literal, quotes and newlines
    escaped, as an ``ok`` result's JSON is."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)


def _render_interrupted(detail: dict[str, Any]) -> str:
    """What is known of an interrupted call, from whoever said it was: its worker stopped (the
    evidence says where it started), its handler raised ``Interrupted`` (its message), or a
    person looked at a held call and could not tell (``reconcile(..., "unknown")``)."""
    started = "started_at" in detail  # the evidence of a worker that stopped (I10)
    if started:
        what = (
            f"was started (at {detail.get('started_at')} by {detail.get('started_by')}) but "
            "its worker stopped before a result was recorded."
        )
    elif "error" in detail:
        what = f"was interrupted; the tool reported: {_quoted(detail['error'])}."
    else:
        what = "was interrupted before a result was recorded."
    if detail.get("reconciled") == "unknown":
        note = detail.get("note")
        return (
            f"INTERRUPTED: this tool call {what} It was held for a person: the operator "
            f"{_quoted(detail.get('by') or 'unknown')} looked and could not tell whether it "
            "took effect"
            + (f"; their note: {_quoted(note)}." if note else " (no note).")
            + " Charlie did not run it again. Check the state before repeating it."
        )
    return (
        f"INTERRUPTED: this tool call {what} Charlie cannot tell whether it took effect, and "
        "did not run it again. Check the state before repeating it."
    )
