"""Charlie's own views of a run: the transcript with each tool call and its result as one row."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from charlie import api
from charlie.terminal import printable


def short(value: Any, limit: int = 100) -> str:
    """One line of at most ``limit`` characters for a terminal: control and format characters
    shown, not obeyed (charlie.terminal; before whitespace is folded, so a CR is seen), runs of
    whitespace folded into one space."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(printable(str(text), multiline=True).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def transcript_rows(task_id: str, *, after_seq: int = -1) -> list[tuple[int, str]]:
    """(seq, line) rows; a tool call's row shows its outcome and timing once it has a result."""
    entries = api.transcript(task_id)
    by_call = {(c.turn, c.call_id): c for c in api.calls(task_id)}
    results = {(e.turn, e.call_id) for e in entries if e.kind == "tool_result"}
    rows: list[tuple[int, str]] = []
    for entry in entries:
        if entry.seq <= after_seq or entry.kind == "tool_result":
            continue
        payload = entry.payload
        if entry.kind == "tool_call":
            key = (entry.turn, entry.call_id or "")
            if key not in results:
                break  # shown once the turn has settled, so rows never change after printing
            call = by_call.get(key)
            outcome = (call.outcome or call.state) if call else "?"
            took = call_took(call) if call else "-"
            again = recovery(call) if call else None
            if again is not None:
                took += f", {again.badge}"
            result = short(call.result, 80) if call and call.result is not None else ""
            if call and call.late_reports:
                # I12: the outcome stands; what came after it is shown beside it.
                late = call.late_result or {}
                result += f"  (late report: {late.get('outcome')}, {short(late.get('result'), 60)})"
            line = (
                f"  ↳ {short(payload.get('name'), 80)}"
                f"({short(payload.get('raw_arguments', ''), 60)})"
                f"  [{outcome}, {took}]  {result}"
            )
        elif entry.kind == "input":
            line = f"{payload.get('role')}: {short(payload.get('content'), 100)}"
        elif entry.kind == "final":
            line = "final: " + _body(payload.get("content"), indent=" " * 8 + "| ")
        elif entry.kind == "compaction":
            line = f"{compaction_text(payload)}: {short(payload.get('content'), 100)}"
        else:
            text = payload.get("content") or payload.get("summary") or ""
            line = f"{entry.kind}: {short(text, 120)}"
        rows.append((entry.seq, f"{entry.seq:>3} t{entry.turn}  {line}"))
    return rows


def compaction_text(payload: dict[str, Any]) -> str:
    """What a compaction covers and what it saved: ``compaction of items 2-41 (about 5200 ->
    1300 tokens, by openai:gpt-4.1)``; the items it covers stay in the record (I29)."""
    covers = payload.get("covers") or ["?", "?"]
    return (
        f"compaction of items {covers[0]}-{covers[-1]} (about {payload.get('tokens_before')} -> "
        f"{payload.get('tokens_after')} tokens, by {short(payload.get('model'), 60)})"
    )


def _body(value: Any, *, indent: str) -> str:
    """A model's multi-line text under a row's prefix: its newlines kept, every other control
    shown (charlie.terminal), each further line indented, so no line of it can pass for a row
    of Charlie's own."""
    text = printable(value if isinstance(value, str) else str(value), multiline=True)
    return text.replace("\n", "\n" + indent)


def usd(amount: float | None) -> str:
    """A cost for people: ``$0.0123``; ``-`` when no price is known (CHARLIE_PRICES)."""
    if amount is None:
        return "-"
    return f"${amount:.4f}" if amount < 100 else f"${amount:,.2f}"


def tokens_text(usage: dict[str, Any], sep: str = ", ") -> str:
    """``in 1200, out 80, reasoning 20`` and, when a prompt cache was used, ``cache read 900,
    cache write 300`` (parts of the input tokens)."""
    parts = [
        f"in {usage.get('input_tokens', 0)}",
        f"out {usage.get('output_tokens', 0)}",
        f"reasoning {usage.get('reasoning_tokens', 0)}",
    ]
    read, written = usage.get("cache_read_tokens") or 0, usage.get("cache_write_tokens") or 0
    if read or written:
        parts += [f"cache read {read}", f"cache write {written}"]
    return sep.join(parts)


def budget_text(info: api.TaskInfo) -> str:
    """``model_calls 2 of 2, tokens 340 of 1000``; ``none`` without a budget."""
    parts = []
    for key, used, limit in info.budget_used():
        if key == "usd":
            parts.append(f"usd {usd(used)} of {usd(float(limit))}")
        else:
            parts.append(f"{key} {used} of {limit}")
    return ", ".join(parts) or "none"


#: how a person's verdict is recorded as a call's settler (charlie.people): ``operator:NAME``
PERSON_PREFIX = "operator:"


def span(ms: float | None) -> str:
    """A duration in milliseconds, in the unit a person reads it in."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def held_for_verdict(call: api.CallRecord) -> tuple[float, float] | None:
    """A call a person settled after it was held for a verdict: (ms it ran before it was held,
    ms it was held), so its run time is not read as the time it waited for a person."""
    info = call.hold_info if isinstance(call.hold_info, dict) else {}
    try:
        held_at = datetime.fromisoformat(str(info.get("held_at")))
    except ValueError:
        return None
    if (
        call.started_at is None
        or call.settled_at is None
        or not (call.settled_by or "").startswith(PERSON_PREFIX)
        or not call.started_at <= held_at <= call.settled_at
    ):
        return None
    ran = (held_at - call.started_at).total_seconds() * 1000
    if call.duration_ms is not None:
        ran = call.duration_ms
    return ran, (call.settled_at - held_at).total_seconds() * 1000


def call_took(call: api.CallRecord) -> str:
    """A call's one duration, as `charlie show`, the console's row and its timeline all say
    it: from its start to its settle (a call recovered after its worker died counts the time
    until it was settled, not the milliseconds its reconcile hook took); a call held for a
    person's verdict, how long it ran and how long it was held; a call not started (settled by
    a person, or refused) the handler's time, if any."""
    held = held_for_verdict(call)
    if held is not None:
        return f"{span(held[0])}, held {span(held[1])}"
    if call.started_at is not None and call.settled_at is not None:
        return span((call.settled_at - call.started_at).total_seconds() * 1000)
    return span(call.duration_ms)


@dataclass(frozen=True)
class Recovery:
    """A call that did not settle the ordinary way: its worker died, or a person decided it.
    ``badge``: its short name (``reconciled``, ``interrupted``, ``decided by a person``,
    ``repeated``); ``lost``: the worker that died holding it (None: unknown); ``settled``: the
    worker or person that settled it; ``why``: what happened, in a sentence."""

    badge: str
    lost: str | None
    settled: str | None
    why: str


def recovery(call: api.CallRecord) -> Recovery | None:
    """How a call was recovered, or None for a call that settled the ordinary way (I10, I24)."""
    result = call.result if isinstance(call.result, dict) else {}
    found = result.get("evidence")
    evidence = found if isinstance(found, dict) else {}
    by = call.settled_by or None
    if result.get("reconciled") is True:
        lost = str(evidence.get("started_by") or call.started_by or "") or None
        return Recovery(
            "reconciled",
            lost,
            by,
            f"its worker {lost or '?'} stopped before a result was recorded; "
            f"{by or 'a worker'} ran its reconcile hook, which found it {call.outcome}",
        )
    if by is not None and by.startswith(PERSON_PREFIX) and held_for_verdict(call) is not None:
        person = by[len(PERSON_PREFIX) :]
        return Recovery(
            "decided by a person",
            call.started_by,
            person,
            f"its worker {call.started_by or '?'} stopped before a result was recorded; "
            f"{person} gave the verdict ({call.outcome})",
        )
    if call.outcome == "interrupted":
        lost = str(result.get("started_by") or call.started_by or "") or None
        return Recovery(
            "interrupted",
            lost,
            by,
            f"its worker {lost or '?'} stopped before a result was recorded; {by or 'a sweep'} "
            "settled it interrupted: whether it took effect is unknown",
        )
    if call.attempts > 1 and call.outcome is not None:
        return Recovery(
            "repeated",
            None,
            call.started_by,
            f"run {call.attempts} times: a worker stopped before its result was recorded, and "
            f"{call.started_by or 'another'} ran it again",
        )
    return None
