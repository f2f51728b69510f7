"""The run as a person reads it: semantic rows built from the API's records.

A tool call and its result are one row (as ``charlie show`` pairs them, charlie.views): the
name, the arguments in short, an outcome badge, the duration, the worker, the finishing order
and a late report beside the outcome, with the full arguments and result behind it. Messages,
reasoning (collapsed) and the final answer are rows of their own. Open calls are listed with
their dispatch state and, when they wait for a person, what that person can do.

Everything here is plain data: the templates escape every string they are given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from charlie import api
from charlie.views import (
    PERSON_PREFIX,
    Recovery,
    call_took,
    compaction_text,
    held_for_verdict,
    recovery,
    short,
    span,
)

#: the badge of each outcome, and of each state a call is in before it has one
OUTCOME_LABELS = {
    "ok": "ok",
    "error": "error",
    "interrupted": "interrupted",
    "deadline_exceeded": "deadline exceeded",
    "denied": "denied",
    "canceled": "canceled",
}

#: how much of a long value a page carries in full (a result is at most
#: CHARLIE_MAX_RESULT_BYTES already; a page of 2,000 of them must still load)
FULL_LIMIT = 64 * 1024


def pretty(value: Any, limit: int = FULL_LIMIT) -> str:
    """A value in full, as a person reads it: text as it is, anything else as indented JSON."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)
    if len(text) > limit:
        return text[:limit] + f"\n… ({len(text) - limit} more characters; the API has it all)"
    return text


def model_label(model: str, limit: int = 40) -> str:
    """A model as a list shows it: a scripted model by its file's name, not its whole path."""
    kind, _, rest = model.partition(":")
    if kind == "scripted" and "/" in rest:
        model = f"scripted:…/{rest.rsplit('/', 1)[-1]}"
    return short(model, limit)


def when(value: datetime | None) -> str:
    """A time as a page shows it: UTC, to the millisecond."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def clock(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def call_state(call: api.CallRecord) -> tuple[str, str]:
    """(badge text, badge class) of a call: its outcome once it has one, else where it is."""
    if call.outcome:
        return OUTCOME_LABELS.get(call.outcome, call.outcome), call.outcome
    if call.hold == "approval":
        return "awaiting approval", "held"
    if call.hold == "reply":
        return "awaiting reply", "held"
    if call.hold == "reconcile":
        return "held: interrupted", "held"
    if call.state == "started":
        return ("waiting (parked)" if call.lease_owner is None else "started"), "started"
    if call.queued_at is not None:
        return "queued", "queued"
    return "pending", "pending"


def decided_by(call: api.CallRecord, verdict: api.ActionRecord | None = None) -> str | None:
    """A person's verdict that settled a call, as a person reads it: what they did and their
    name (``denied by ui:ana``, not the record's ``operator:ui:ana``); with the verdict's
    record, how that name is known (``denied by ana (console, signed in)``, ``denied by ui:ana
    (claimed, via celery)``, I32). None when no person settled it."""
    by = call.settled_by or ""
    if not by.startswith(PERSON_PREFIX):
        return None
    name = by[len(PERSON_PREFIX) :] if verdict is None else verdict.by
    if call.outcome == "denied":
        return f"denied by {name}"
    if call.started_at is None:
        return f"answered by {name}"
    return f"reconciled by {name}"


@dataclass(frozen=True)
class CallView:
    """One tool call with its result and evidence."""

    call_id: str
    turn: int
    name: str
    args_short: str
    arguments: str
    badge: str
    badge_class: str
    duration: str
    worker: str
    finish_order: int | None
    late: str | None
    result_short: str
    result: str
    settled: bool
    #: (label, value) lines of evidence behind the row
    evidence: list[tuple[str, str]]
    #: how it was recovered after its worker died or a person decided it (views.recovery):
    #: a badge of its own, and a marker on the timeline
    recovered: Recovery | None = None


def interrupted_in_words(call: api.CallRecord) -> str | None:
    """What happened to an interrupted call, in a sentence (its evidence is the opened row's
    result): who started it and when, when it was found lost, and that whether it took effect
    is unknown (I10); or the handler's own word, or the person who looked and could not tell.
    None for any other outcome."""
    if call.outcome != "interrupted":
        return None
    detail = call.result if isinstance(call.result, dict) else {}
    if detail.get("reconciled") == "unknown":
        note = detail.get("note")
        return (
            f"{detail.get('by') or 'an operator'} looked and could not tell whether it took "
            "effect" + (f" (“{short(note, 80)}”)" if note else "") + "; it was not run again"
        )
    if "started_at" in detail or call.started_at is not None:
        by = detail.get("started_by") or call.started_by or "a worker"
        started = _parse_time(detail.get("started_at")) or call.started_at
        why = str(detail.get("reason") or "its worker stopped")
        return (
            f"started by {by} at {clock(started)}; {why} before a result was recorded "
            f"(found lost at {clock(call.settled_at)}): Charlie cannot tell whether it took "
            "effect"
        )
    if detail.get("error"):
        return f"interrupted, the tool said: {short(detail['error'], 100)}"
    return "interrupted before a result was recorded"


def _reconciled_in_words(call: api.CallRecord, recovered: Recovery | None) -> str | None:
    """A call its reconcile hook settled: what the hook found, without the bookkeeping (the
    evidence of the lost attempt is in the opened row)."""
    if recovered is None or recovered.badge != "reconciled" or not isinstance(call.result, dict):
        return None
    found = {k: v for k, v in call.result.items() if k not in ("reconciled", "evidence")}
    return f"its reconcile hook found: {short(found, 100)}"


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def call_view(
    call: api.CallRecord,
    raw_arguments: str | None = None,
    *,
    full: bool = True,
    verdict: api.ActionRecord | None = None,
) -> CallView:
    """A call's row; ``full=False`` leaves out what only its opened row shows (the whole
    arguments and result, the evidence), which a task page loads when a row is opened.
    ``verdict``: the person's action that settled it, if one did (who, and how it arrived)."""
    badge, badge_class = call_state(call)
    args = raw_arguments if raw_arguments is not None else json.dumps(call.arguments)
    late = None
    if call.late_reports:
        report = call.late_result if isinstance(call.late_result, dict) else {}
        outcome = report.get("outcome")
        late = f"late report: {OUTCOME_LABELS.get(str(outcome), outcome)}"
        if report.get("result") is not None:
            late += f", {short(report.get('result'), 60)}"
    wall = None
    if call.started_at is not None and call.settled_at is not None:
        wall = (call.settled_at - call.started_at).total_seconds() * 1000
    held = held_for_verdict(call)
    took = f"{span(wall)} from start to settle; handler {span(call.duration_ms)}"
    # one duration for a call everywhere (charlie show, this row, the timeline): views.call_took
    duration = call_took(call)
    if held is not None:
        took = f"{span(held[0])} from start until held; held {span(held[1])} for a verdict"
    # a person's verdict says so beside the worker that ran it (if one did)
    person = decided_by(call, verdict)
    recovered = recovery(call)
    # a worker that settled what another started (its reconcile hook, a sweep) says so too
    settler = None
    if recovered is not None and person is None and recovered.settled != call.started_by:
        settler = f"{recovered.badge} by {recovered.settled}" if recovered.settled else None
    worker = (
        " · ".join(w for w in (call.started_by, person or settler) if w) or call.settled_by or "-"
    )
    evidence = (
        []
        if not full
        else [
            ("call", f"{call.call_id} (turn {call.turn}, #{call.index})"),
            ("took", took),
            ("effect", call.effect + (", resumable" if call.resumable else "")),
            ("state", call.state + (f", held for {call.hold}" if call.hold else "")),
            ("queued", when(call.queued_at)),
            ("started", f"{when(call.started_at)} by {call.started_by or '-'}"),
            ("settled", f"{when(call.settled_at)} {person or 'by ' + (call.settled_by or '-')}"),
            ("deadline", when(call.deadline_at)),
            ("attempts", str(call.attempts)),
        ]
    )
    if full and call.lease_owner:
        evidence.append(("lease", f"{call.lease_owner} until {when(call.lease_until)}"))
    if full and call.handle:
        evidence.append(("handle", call.handle))
    if full and call.late_reports:
        evidence.append(("late reports", f"{call.late_reports}: {short(call.late_result, 300)}"))
    if full and call.hold_info:
        evidence.append(("held because", short(call.hold_info, 600)))
    if full and recovered is not None:
        evidence.insert(0, ("recovered", recovered.why))
    return CallView(
        call_id=call.call_id,
        turn=call.turn,
        name=call.name,
        args_short=short(args, 90),
        arguments=pretty(call.arguments) if full else "",
        badge=badge,
        badge_class=badge_class,
        duration=duration,
        worker=worker,
        finish_order=call.finish_order,
        late=late,
        result_short=interrupted_in_words(call)
        or _reconciled_in_words(call, recovered)
        or (short(call.result, 120) if call.result is not None else ""),
        result=pretty(call.result) if full else "",
        settled=call.state == "settled",
        evidence=evidence,
        recovered=recovered,
    )


@dataclass(frozen=True)
class Row:
    """One row of the transcript. ``kind``: system, user, message (a person's, sent to the
    run), assistant, reasoning, call, result (a result whose call item is missing), final."""

    key: str
    seq: int
    turn: int
    kind: str
    who: str
    text: str = ""
    call: CallView | None = None
    copied: str | None = None
    #: a call row's result item (the row shows both items' numbers, so none seems missing)
    result_seq: int | None = None


#: the actions that settle a call themselves (an approve releases it; a worker settles it)
SETTLING = ("deny", "reply", "reconcile")


def verdicts_of(actions: list[api.ActionRecord]) -> dict[tuple[int, str], api.ActionRecord]:
    """The person's action that settled each call a person settled, by (turn, call id): the
    last deny, reply or reconcile recorded on it."""
    found: dict[tuple[int, str], api.ActionRecord] = {}
    for a in actions:
        if a.action.value in SETTLING and a.call_id is not None and a.turn is not None:
            found[(a.turn, a.call_id)] = a
    return found


def transcript_rows(
    entries: list[api.TranscriptEntry],
    calls: list[api.CallRecord],
    *,
    full: bool = False,
    actions: list[api.ActionRecord] | None = None,
) -> list[Row]:
    """The transcript's semantic rows, in its one chronology (I6); with ``full``, each call's
    whole arguments, result and evidence too (what an opened row shows). With the task's
    ``actions``, a person's verdict on a call and a person's message say who and how that is
    known (signed in to the console, or a name a caller claimed, I32)."""
    by_call = {(c.turn, c.call_id): c for c in calls}
    verdicts = verdicts_of(actions or [])
    senders: dict[str, api.ActionRecord] = {}
    for a in actions or []:
        if a.action.value == "send" and (a.detail or {}).get("message_id") is not None:
            senders.setdefault(str((a.detail or {})["message_id"]), a)
    has_call_item = {(e.turn, e.call_id) for e in entries if e.kind == "tool_call"}
    result_seqs = {(e.turn, e.call_id): e.seq for e in entries if e.kind == "tool_result"}
    rows: list[Row] = []
    for e in entries:
        p = e.payload or {}
        copied = None
        if isinstance(p.get("copied_from"), dict):
            origin = p["copied_from"]
            copied = f"copied from {origin.get('task')} #{origin.get('seq')}"
        key = f"s{e.seq}"
        if e.kind == "tool_call":
            record = by_call.get((e.turn, e.call_id or ""))
            view = (
                call_view(
                    record,
                    str(p.get("raw_arguments") or ""),
                    full=full,
                    verdict=verdicts.get((e.turn, e.call_id or "")),
                )
                if record is not None
                else _call_from_items(e, entries)
            )
            rows.append(
                Row(
                    key,
                    e.seq,
                    e.turn,
                    "call",
                    str(p.get("name")),
                    call=view,
                    copied=copied,
                    result_seq=result_seqs.get((e.turn, e.call_id)),
                )
            )
        elif e.kind == "tool_result":
            if (e.turn, e.call_id) in has_call_item:
                continue  # shown in its call's row
            text = f"{p.get('name')} ({e.call_id}): {p.get('outcome')}\n{pretty(p.get('result'))}"
            rows.append(Row(key, e.seq, e.turn, "result", "tool result", text, copied=copied))
        elif e.kind == "input":
            role = str(p.get("role") or "user")
            if p.get("message_id") or p.get("sent_by"):
                sent = senders.get(str(p.get("message_id")))
                who = f"message from {sent.by if sent else p.get('sent_by') or 'a person'}"
                rows.append(Row(key, e.seq, e.turn, "message", who, _text(p), copied=copied))
            elif role == "system":
                rows.append(Row(key, e.seq, e.turn, "system", "system", _text(p), copied=copied))
            else:
                rows.append(Row(key, e.seq, e.turn, "user", role, _text(p), copied=copied))
        elif e.kind == "reasoning":
            text = _text(p) or pretty(p.get("summary"))
            rows.append(Row(key, e.seq, e.turn, "reasoning", "reasoning", text, copied=copied))
        elif e.kind == "final":
            rows.append(Row(key, e.seq, e.turn, "final", "final answer", _text(p), copied=copied))
        elif e.kind == "compaction":
            # the model's summary stood for these items in later inputs; they stay below (I29)
            rows.append(
                Row(key, e.seq, e.turn, "compaction", compaction_text(p), _text(p), copied=copied)
            )
        else:
            who = str(p.get("role") or e.kind)
            kind = "assistant" if e.kind == "message" else e.kind
            rows.append(Row(key, e.seq, e.turn, kind, who, _text(p), copied=copied))
    return rows


def _text(payload: dict[str, Any]) -> str:
    content = payload.get("content")
    if content is None:
        content = payload.get("summary")
    return pretty(content)


def _call_from_items(item: api.TranscriptEntry, entries: list[api.TranscriptEntry]) -> CallView:
    """A call item without a call record (a fork's copied history): what the items say."""
    p = item.payload or {}
    result = next(
        (
            e
            for e in entries
            if e.kind == "tool_result" and e.call_id == item.call_id and e.turn == item.turn
        ),
        None,
    )
    outcome = result.outcome if result is not None else None
    value = (result.payload or {}).get("result") if result is not None else None
    return CallView(
        call_id=item.call_id or "",
        turn=item.turn,
        name=str(p.get("name")),
        args_short=short(p.get("raw_arguments") or p.get("arguments") or "", 90),
        arguments=pretty(p.get("arguments")),
        badge=OUTCOME_LABELS.get(str(outcome), str(outcome or "no result")),
        badge_class=str(outcome or "pending"),
        duration="-",
        worker="-",
        finish_order=None,
        late=None,
        result_short=short(value, 120) if value is not None else "",
        result=pretty(value),
        settled=result is not None,
        evidence=[("call", f"{item.call_id} (turn {item.turn}), from the transcript only")],
    )


@dataclass(frozen=True)
class OpenCall:
    """An open call: where it is in its dispatch, and what a person may do about it."""

    call: CallView
    state: str
    #: "approval", "reply", "reconcile" or None (nothing for a person to do)
    needs: str | None
    question: str | None
    evidence: str | None
    #: "deadline <when>", what stands in for one while it waits for a person, or None
    deadline: str | None
    lines: list[str] = field(default_factory=list)


def open_calls(calls: list[api.CallRecord], now: datetime) -> list[OpenCall]:
    found = []
    for c in calls:
        if c.state == "settled":
            continue
        view = call_view(c)
        info = c.hold_info if isinstance(c.hold_info, dict) else {}
        lines: list[str] = []
        if c.hold == "approval":
            state = "awaiting approval: not dispatched, no worker holds it"
            if info.get("why"):
                lines.append(f"why: {short(info.get('why'), 300)}")
        elif c.hold == "reply":
            state = "awaiting a reply: queued to no worker"
        elif c.hold == "reconcile":
            # what a person needs to decide, in words: the evidence below has the details
            ev = info.get("evidence", info)
            ev = ev if isinstance(ev, dict) else {}
            by = ev.get("started_by") or c.started_by or "a worker"
            state = (
                f"held: started by {by}, {ev.get('reason') or 'its worker stopped'} before a "
                "result was recorded; whether it took effect is unknown. Check, then give a "
                "verdict: done / not done (run it again) / unknown (report it interrupted)"
            )
        elif c.state == "started":
            if c.lease_owner:
                left = (c.lease_until - now).total_seconds() if c.lease_until else None
                state = f"started by {c.started_by or '-'}, lease held by {c.lease_owner}"
                lease = f"lease until {when(c.lease_until)}"
                if left is not None:
                    lease += f" ({left:+.1f} s)"
                lines.append(lease)
            else:
                state = f"started by {c.started_by or '-'}; parked, observed again by polls"
            if c.handle:
                lines.append(f"handle {c.handle}")
        elif c.queued_at is not None:
            state = f"queued at {when(c.queued_at)} (dispatch v{c.dispatch_version})"
        else:
            state = "pending: not dispatched yet"
        if c.attempts > 1:
            lines.append(f"attempts {c.attempts}")
        evidence = None
        if c.hold == "reconcile":
            evidence = pretty(info.get("evidence", info))
        found.append(
            OpenCall(
                call=view,
                state=state,
                needs=c.hold,
                question=str(info.get("question")) if c.hold == "reply" else None,
                evidence=evidence,
                deadline=_deadline(c),
                lines=lines,
            )
        )
    return found


def _deadline(call: api.CallRecord) -> str | None:
    if call.deadline_at is not None:
        return f"deadline {when(call.deadline_at)}"
    if call.hold == "reconcile":
        return "no deadline: waits for a verdict"
    if call.hold == "approval":
        return "no deadline yet: it counts from the approve"
    return None


def settled_turns(info: api.TaskInfo, entries: list[api.TranscriptEntry]) -> list[int]:
    """The turns a fork may start after: those before the run's current one, and the current
    one once the run has its final answer or has ended (people.fork checks again)."""
    turns = sorted({e.turn for e in entries})
    current = info.turn
    done = info.terminal or any(e.kind == "final" for e in entries if e.turn == current)
    return [t for t in turns if t < current or (t == current and done)]
