"""People in the loop: send, reply, approve, deny, reconcile, resume and fork (I22-I27).

Each action is one transaction that writes its effect and its evidence row together (I27), in
the tick's lock order (the run's row, then its calls, then the task), and publishes what it
allows only after the commit: a verdict that releases a call publishes its invoke; one that
completes a turn publishes the run's await tick; a resume or a fork publishes the run's next
tick. A lost publish is what the sweeps already recover (I4, I11).

The first verdict on a call wins (I24): approve, deny, reply and reconcile each check, under
the run's lock, for a verdict already recorded on the call, and refuse with an error that names
it. A retried request (``request_id``, a Celery message id) finds its own first commit and
returns it instead of acting twice.

Each action also records how it arrived (I32): ``origin``, its channel (the Python API by
default; the CLI, the console and the worker's Celery tasks pass their own) and whether that
channel established the actor's name (only the console's token does) or the caller merely
claimed it. A Celery message cannot set it: the worker's tasks refuse one that tries.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from charlie import faults, pricing
from charlie.domain import (
    JSON,
    MAX_TASK_ID,
    TASK_ID,
    Action,
    CallState,
    Channel,
    Hold,
    ItemKind,
    Origin,
    Outcome,
    Phase,
    TaskStatus,
    describe_actor,
    execution_id_for,
    utcnow,
)
from charlie.runtime import Producer, get_producer
from charlie.scheduler import TaskConflict, TaskNotFound
from charlie.store import people as store
from charlie.store import spend
from charlie.store.engine import again_if_disconnected, read, write
from charlie.store.types import Connection, ConstraintViolation

T = TypeVar("T")

Verdict = Literal["done", "not_done", "unknown"]
VERDICT_NAMES: tuple[str, ...] = ("done", "not_done", "unknown")

#: the longest text a message, reply, note or reason may carry (a prompt's limit is the
#: settings'; a person's note needs far less).
MAX_NOTE_BYTES = 64 * 1024


class ActionRefused(Exception):
    """An operator action that was refused before anything was written."""


class TaskFinished(ActionRefused):
    """A message to a task that can no longer take one in."""


class MessageConflict(ActionRefused):
    """A message id reused for a different text."""


class CallNotFound(ActionRefused, LookupError):
    pass


class NotHeld(ActionRefused):
    """The call does not wait for this verdict (it waits for another, or has its outcome)."""


class NotResumable(ActionRefused):
    pass


class StillReporting(NotResumable):
    """The task has ended but its run has not finished reporting it: the task's status is
    written a moment before the run's last step, so a resume right after ``wait`` can find
    the run one step short of ``done``. A resume waits up to ``REPORTING_WAIT`` for it."""


#: seconds a resume waits for a run that is still reporting its task's end (a report takes
#: milliseconds; one whose worker died is re-published by the sweep, later than this)
REPORTING_WAIT = 10.0


class ForkRefused(ActionRefused):
    pass


@dataclass(frozen=True)
class ActionRecord:
    """One operator action, as recorded (I27)."""

    id: int
    task_id: str
    action: Action
    call_id: str | None
    turn: int | None
    actor: str
    at: datetime
    note: str | None
    detail: JSON | None
    #: how it arrived (I32): ``api``, ``cli``, ``ui``, ``celery``; None: recorded before
    #: channels were
    channel: Channel | None = None
    #: whether the channel established ``actor`` (the console's token), or the caller only
    #: claimed it (I32)
    authenticated: bool = False

    @property
    def by(self) -> str:
        """Who, and how that is known: ``alice (console, signed in)``, ``ui:alice (claimed,
        via celery)`` (I32)."""
        return describe_actor(self.actor, self.channel, self.authenticated)

    def describe(self) -> str:
        what = self.action.value
        if self.action is Action.RECONCILE and self.detail:
            what += f" {self.detail.get('verdict')}"
        return f"{what} by {self.by} at {self.at.isoformat(timespec='seconds')}"


def shown_actor(actor: str, origin: Origin | None) -> str:
    """Who acted, rendered the one way every place shows it (I32): a result the model reads
    (``denied_by``), the event stream, the console's badges and the CLI all say
    ``alice (console, signed in)`` or ``ui:alice (claimed, via celery)``, as
    :attr:`ActionRecord.by` does for the action's record, which itself keeps the raw principal
    with its channel (``origin`` None: the record's default, an unauthenticated API call)."""
    origin = origin or Origin()
    return describe_actor(actor, origin.channel.value, origin.authenticated)


class VerdictConflict(ActionRefused):
    """A second verdict on a call: the first one stands (I24)."""

    def __init__(self, call_id: str, first: ActionRecord) -> None:
        super().__init__(
            f"call {call_id!r} was already decided: {first.describe()}"
            + (f" ({first.note})" if first.note else "")
            + "; the first verdict stands"
        )
        self.call_id = call_id
        self.first = first


def record_of(row: Any) -> ActionRecord:
    return ActionRecord(
        row.id,
        row.task_id,
        Action(row.action),
        row.call_id,
        row.turn,
        row.actor,
        row.at,
        row.note,
        row.detail,
        _channel(getattr(row, "channel", None)),
        bool(getattr(row, "authenticated", False)),
    )


def _channel(value: object) -> Channel | None:
    try:
        return None if value is None else Channel(str(value))
    except ValueError:  # a channel a later version wrote: shown as unknown, never trusted
        return None


def actor_name(operator: str | None, producer: Producer) -> str:
    """Who acted: the caller's ``operator``, else CHARLIE_OPERATOR, else the OS user."""
    if operator is not None:
        name = str(operator).strip()
        if not name:
            raise ActionRefused("operator must be a non-empty name")
        if not name.isprintable():
            # a record shows it on terminals and pages (I32): no line breaks, no escapes
            raise ActionRefused("operator must be printable text, without control characters")
        return name[:200]
    if producer.settings.operator:
        return producer.settings.operator[:200]
    try:
        return getpass.getuser()[:200]
    except Exception:  # no user name in this environment (a container without one)
        return "unknown"


def _text(value: object, what: str, limit: int = MAX_NOTE_BYTES, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise ActionRefused(f"{what} must be a non-empty string")
    size = len(value.encode())
    if size > limit:
        raise ActionRefused(f"{what} is {size} bytes; the limit is {limit}")
    return value


def _note(note: object) -> str | None:
    return None if note is None else _text(note, "note", empty=True)


def _once(
    rt: Producer, request_id: str | None, what: str, act: Callable[[Connection], T]
) -> tuple[T | None, ActionRecord | None]:
    """Run ``act`` in one write transaction, again on a fresh connection if the first died.
    With a ``request_id``, a request that already committed (its reply lost, a redelivered
    Celery message) returns its recorded action instead of acting twice."""

    def attempt() -> tuple[T | None, ActionRecord | None]:
        if request_id is not None:
            with read(rt.engine) as conn:
                done = store.action_by_request(conn, request_id)
            if done is not None:
                return None, record_of(done)
        try:
            with write(rt.engine) as conn:
                return act(conn), None
        except ConstraintViolation:
            if request_id is None:
                raise
            with read(rt.engine) as conn:
                done = store.action_by_request(conn, request_id)
            if done is None:
                raise
            return None, record_of(done)

    return again_if_disconnected(attempt, what)


# -- the mailbox (I22) ----------------------------------------------------------------------


def send(
    task_id: str,
    text: str,
    *,
    message_id: str | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> str:
    """Send a message to an active task; returns its message id. It enters the transcript as
    user input at the task's first turn boundary after this commit (after the current turn's
    results, before the next model call), exactly once: sending the same ``message_id`` again
    returns it without a second message (I22). A finished task takes no message: fork it."""
    rt = get_producer()
    text = _text(text, "message", rt.settings.max_prompt_bytes)
    if message_id is not None:
        message_id = _text(message_id, "message_id", 200)
    message_id = message_id or request_id or uuid.uuid4().hex
    actor = actor_name(operator, rt)
    xid = execution_id_for(task_id)

    def act(conn: Connection) -> str:
        existing = store.message_by_id(conn, task_id, message_id)
        if existing is not None:
            if existing.text != text:
                raise MessageConflict(
                    f"message id {message_id!r} of task {task_id!r} already names a different "
                    "message"
                )
            return message_id
        status = store.task_status(conn, task_id)
        if status is None:
            raise TaskNotFound(task_id)
        if TaskStatus(status).terminal or not store.open_mailbox(conn, xid):
            how = status if TaskStatus(status).terminal else "finishing"
            again = (
                f"resume it (charlie resume {task_id}) and send again, or "
                if status in _RESUMABLE
                else ""
            )
            raise TaskFinished(
                f"task {task_id!r} is {how} and takes no more messages; to go on, {again}fork "
                f"it from one of its turns: charlie.fork({task_id!r}, turn=N, message=...) or "
                f"`charlie fork {task_id} --turn N --message TEXT`"
            )
        now = utcnow()
        store.add_message(
            conn, task_id=task_id, message_id=message_id, text=text, actor=actor, now=now
        )
        store.record_action(
            conn,
            task_id=task_id,
            action=Action.SEND,
            actor=actor,
            now=now,
            detail={"message_id": message_id},
            request_id=request_id,
            origin=origin,
        )
        return message_id

    try:
        sent, recorded = _once(rt, request_id, "send a message", act)
    except ConstraintViolation:
        # Two sends of one message id raced and this one lost: the first one's message stands.
        with read(rt.engine) as conn:
            existing = store.message_by_id(conn, task_id, message_id)
        if existing is None or existing.text != text:
            raise
        return message_id
    if recorded is not None:
        return str((recorded.detail or {}).get("message_id"))
    assert sent is not None
    return sent


# -- verdicts on held calls (I23, I24) ------------------------------------------------------


@dataclass(frozen=True)
class _Decided:
    record_id: int
    #: what to publish after the commit: an invoke (the call released) or the run's await tick
    invoke: tuple[str, int, str] | None = None
    await_version: int | None = None
    late: bool = False
    #: the request had committed already (a redelivered twin): nothing to publish
    replayed: bool = False
    #: how the released call is invoked: ``start`` (it never started) or ``resume`` (a started
    #: call that parked asking a question goes on with the answer).
    invoke_mode: str = "start"
    #: the run's priority, as its locked row has it: what the verdict publishes carries it
    priority: int = 0


def _decide(
    rt: Producer,
    task_id: str,
    call_id: str,
    *,
    action: Action,
    operator: str | None,
    request_id: str | None,
    note: str | None,
    decide: Callable[[Connection, Any, Any, str, datetime], _Decided],
    origin: Origin | None = None,
) -> ActionRecord:
    """The frame of every verdict: lock the run, find the call, refuse a second verdict, let
    ``decide`` write the effect and its evidence, then publish what the verdict allows."""
    # A request id of its own even when the caller gave none: a try again after a lost
    # connection whose first commit went through then finds that commit, instead of being
    # refused by its own verdict (I24) and skipping the publish.
    request_id = request_id or f"{action.value}-{uuid.uuid4().hex}"
    actor = actor_name(operator, rt)
    xid = execution_id_for(task_id)

    def act(conn: Connection) -> _Decided:
        run = store.lock_run(conn, xid)
        if run is None:
            raise TaskNotFound(task_id)
        call = store.find_call(conn, xid, call_id, None)
        if call is None:
            raise CallNotFound(f"task {task_id!r} has no tool call {call_id!r}")
        if request_id is not None:
            done = store.action_by_request(conn, request_id)
            if done is not None:  # a twin of this request got the lock first
                return _Decided(int(done.id), replayed=True)
        first = _standing_verdict(store.verdicts_on(conn, task_id, call.call_id, call.turn), call)
        if first is not None:
            raise VerdictConflict(call_id, record_of(first))
        status = store.task_status(conn, task_id)  # after the call: the tick's lock order
        open_call = call.state != CallState.SETTLED.value
        if open_call and status is not None and TaskStatus(status).terminal:
            raise TaskFinished(
                f"task {task_id!r} is {status}: its calls take no more verdicts"
                + (f" (resume it first: charlie resume {task_id})" if status in _RESUMABLE else "")
            )
        return replace(decide(conn, run, call, actor, utcnow()), priority=run.priority)

    decided, recorded = _once(rt, request_id, f"{action.value} a call", act)
    if recorded is not None:
        return recorded  # this request committed before: nothing more to do
    assert decided is not None
    if decided.replayed:
        return _record(rt, decided.record_id)
    # after the verdict's commit, for people watching (I28)
    shown = shown_actor(actor, origin)
    rt.events.emit(task_id, "verdict", call_id=call_id, action=action.value, by=shown)
    if decided.invoke is not None:
        # Lost, the sweep finds a released call that was queued and never started (I11), or
        # an answered started call, whose lease it finds lapsed (I10).
        rt.publisher.invoke(*decided.invoke, decided.invoke_mode, priority=decided.priority)
    if decided.await_version is not None:
        rt.publisher.tick(xid, Phase.AWAIT_TOOLS, decided.await_version, priority=decided.priority)
    return _record(rt, decided.record_id)


def _not_done(row: Any) -> bool:
    verdict = (row.detail or {}).get("verdict")
    return bool(row.action == Action.RECONCILE.value and verdict == "not_done")


#: the verdicts that answer each kind of hold
_ANSWERS = {
    Hold.APPROVAL.value: (Action.APPROVE.value, Action.DENY.value),
    Hold.REPLY.value: (Action.REPLY.value,),
    Hold.RECONCILE.value: (Action.RECONCILE.value,),
}


def _standing_verdict(rows: list[Any], call: Any) -> Any:
    """The verdict that already decides this call, if any (I24).

    A call may wait for a person more than once: approved, it runs, is interrupted and is held
    for a reconcile; repeated after ``not_done``, it may be held again. Each hold is a round of
    its own: only verdicts of the kind it asks for, recorded after it began (``after_action``,
    the last action on the call when it was held), decide it. A call no longer held was decided
    by the last verdict recorded on it."""
    if not rows:
        return None
    if call.hold is None:
        return rows[-1]
    after = int((call.hold_info or {}).get("after_action") or 0)
    answers = _ANSWERS.get(call.hold, ())
    this_round = [r for r in rows if r.id > after and r.action in answers]
    question = (call.hold_info or {}).get("question_id")
    if question is not None and call.hold == Hold.REPLY.value:
        # a started call may ask more than one question (an MCP server's input_required):
        # each is answered once, by a reply to that question
        this_round = [r for r in this_round if (r.detail or {}).get("question_id") == question]
    return this_round[0] if this_round else None


def _after_settle(conn: Connection, run: Any, call: Any, recheck_at: datetime) -> int | None:
    """The run's await tick, when settling this call completed a turn the run waits on (I7);
    ``recheck_at``: when the sweeps publish it again if it is lost."""
    from charlie.store.calls import await_version_if_complete

    if run.turn != call.turn:
        return None
    return await_version_if_complete(
        conn, call.execution_id, call.turn, run.phase, run.version, recheck_at
    )


def _verdict_row(
    conn: Connection,
    task_id: str,
    call: Any,
    action: Action,
    actor: str,
    now: datetime,
    request_id: str | None,
    *,
    note: str | None = None,
    detail: JSON | None = None,
    origin: Origin | None = None,
) -> int:
    """The evidence row of a verdict on ``call``, in the verdict's own transaction (I27),
    with how it arrived (I32)."""
    return store.record_action(
        conn,
        task_id=task_id,
        action=action,
        actor=actor,
        now=now,
        call_id=call.call_id,
        turn=call.turn,
        note=note,
        detail=detail,
        request_id=request_id,
        origin=origin,
    )


def _deadline_seconds(rt: Producer, call: Any) -> float:
    """A released call's deadline: its tool's, as the worker that planned it recorded it."""
    seconds = (call.hold_info or {}).get("deadline_seconds")
    return float(seconds) if seconds else rt.settings.tool_deadline


def _not_held(task_id: str, call: Any, wanted: Hold) -> NotHeld:
    name = f"call {call.call_id!r} ({call.name}) of task {task_id!r}"
    if call.state == CallState.SETTLED.value:
        return NotHeld(f"{name} already has its outcome: {call.outcome}")
    if call.hold is None:
        return NotHeld(f"{name} does not wait for a person (it is {call.state})")
    verbs = {
        Hold.APPROVAL: "charlie approve / charlie deny",
        Hold.REPLY: "charlie reply",
        Hold.RECONCILE: "charlie reconcile",
    }
    held = Hold(call.hold)
    return NotHeld(
        f"{name} waits for {held.value}, not {wanted.value}; answer it with {verbs[held]}"
    )


def approve(
    task_id: str,
    call_id: str,
    *,
    note: str | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> ActionRecord:
    """Approve a call held for approval: it is dispatched now, and marked started only by the
    worker that runs it (I9, I23)."""
    rt = get_producer()
    note = _note(note)

    def decide(conn: Connection, run: Any, call: Any, actor: str, now: datetime) -> _Decided:
        if call.hold != Hold.APPROVAL.value or call.state != CallState.PENDING.value:
            raise _not_held(task_id, call, Hold.APPROVAL)
        deadline = now + timedelta(seconds=_deadline_seconds(rt, call))
        store.release_call(
            conn,
            call.execution_id,
            call.turn,
            call.call_id,
            held=Hold.APPROVAL,
            now=now,
            deadline_at=deadline,
            version=run.version,
        )
        rid = _verdict_row(
            conn,
            task_id,
            call,
            Action.APPROVE,
            actor,
            now,
            request_id,
            note=note,
            detail={"tool": call.name, "deadline_at": deadline.isoformat()},
            origin=origin,
        )
        return _Decided(rid, invoke=(call.execution_id, call.turn, call.call_id))

    return _decide(
        rt, task_id, call_id, action=Action.APPROVE, operator=operator,
        request_id=request_id, note=note, decide=decide, origin=origin,
    )  # fmt: skip


def deny(
    task_id: str,
    call_id: str,
    reason: str,
    *,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> ActionRecord:
    """Deny a call held for approval: its one result is a ``denied`` outcome with the reason,
    which the model sees; it never runs (I23), and the run goes on."""
    rt = get_producer()
    reason = _text(reason, "reason")

    def decide(conn: Connection, run: Any, call: Any, actor: str, now: datetime) -> _Decided:
        if call.hold != Hold.APPROVAL.value or call.state != CallState.PENDING.value:
            raise _not_held(task_id, call, Hold.APPROVAL)
        store.settle_held_call(
            conn,
            call.execution_id,
            call.turn,
            call.call_id,
            held=Hold.APPROVAL,
            outcome=Outcome.DENIED.value,
            result={"reason": reason, "denied_by": shown_actor(actor, origin)},
            by=f"operator:{actor}"[:200],
            now=now,
        )
        rid = _verdict_row(
            conn,
            task_id,
            call,
            Action.DENY,
            actor,
            now,
            request_id,
            note=reason,
            detail={"tool": call.name},
            origin=origin,
        )
        return _Decided(rid, await_version=_after_settle(conn, run, call, now + rt.stall))

    return _decide(
        rt, task_id, call_id, action=Action.DENY, operator=operator,
        request_id=request_id, note=reason, decide=decide, origin=origin,
    )  # fmt: skip


def reply(
    task_id: str,
    call_id: str,
    text: str,
    *,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> ActionRecord:
    """Answer a question: an ``ask_human`` call, whose result the answer is, or a started call
    that parked asking one (an MCP server's ``input_required``), which goes on with it: the
    answer is recorded on the call, its hold lifted, and the call resumed (I9, I23). A reply
    after the question's deadline settled it is recorded as its late report (I12, I13); its
    detail says ``late``. One reply per question (I24)."""
    rt = get_producer()
    text = _text(text, "reply", rt.settings.max_result_bytes)

    def decide(conn: Connection, run: Any, call: Any, actor: str, now: datetime) -> _Decided:
        info = dict(call.hold_info or {})
        asked = call.hold == Hold.REPLY.value or info.get("question") is not None
        if not asked:
            raise _not_held(task_id, call, Hold.REPLY)
        late = call.state == CallState.SETTLED.value
        resumes = not late and call.state == CallState.STARTED.value
        if late:
            from charlie.store.calls import record_late_report

            record_late_report(
                conn, call.execution_id, call.turn, call.call_id, Outcome.OK.value, text
            )
        elif resumes:
            if call.hold != Hold.REPLY.value:
                raise _not_held(task_id, call, Hold.REPLY)
            answered = {
                **info,
                "answer": text,
                "answered_by": shown_actor(actor, origin),
                "answered_at": now.isoformat(),
            }
            store.answer_parked_call(
                conn, call.execution_id, call.turn, call.call_id, info=answered, now=now
            )
        else:
            store.settle_held_call(
                conn,
                call.execution_id,
                call.turn,
                call.call_id,
                held=Hold.REPLY,
                outcome=Outcome.OK.value,
                result=text,
                by=f"operator:{actor}"[:200],
                now=now,
            )
        detail: JSON = {"late": late, "outcome": call.outcome} if late else {"late": False}
        if info.get("question_id") is not None:
            detail["question_id"] = info["question_id"]
        if resumes:
            detail["resumes"] = True
        rid = _verdict_row(
            conn, task_id, call, Action.REPLY, actor, now, request_id, detail=detail, origin=origin
        )
        if resumes:
            return _Decided(
                rid, invoke=(call.execution_id, call.turn, call.call_id), invoke_mode="resume"
            )
        return _Decided(
            rid, await_version=None if late else _after_settle(conn, run, call, now + rt.stall)
        )

    return _decide(
        rt, task_id, call_id, action=Action.REPLY, operator=operator,
        request_id=request_id, note=None, decide=decide, origin=origin,
    )  # fmt: skip


def reconcile(
    task_id: str,
    call_id: str,
    verdict: Verdict | str,
    *,
    result: Any = None,
    note: str | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> ActionRecord:
    """Decide an interrupted call held for an operator (a tool with ``on_interrupt="hold"``):

    - ``"done"``: it happened; ``result`` is its result (the model sees it as the call's);
    - ``"not_done"``: it did not; it is dispatched again under the same call id, a repeat the
      operator authorised, and from there an ordinary dispatch (I9, I10);
    - ``"unknown"``: nobody can tell; it settles ``interrupted`` with its evidence and the note.
    """
    rt = get_producer()
    if verdict not in VERDICT_NAMES:
        raise ActionRefused(f"verdict must be one of {', '.join(VERDICT_NAMES)}, got {verdict!r}")
    note = _note(note)
    if result is not None:
        try:
            size = len(json.dumps(result))
        except (TypeError, ValueError) as exc:
            raise ActionRefused(f"result must be JSON-serialisable: {exc}") from exc
        if size > rt.settings.max_result_bytes:
            raise ActionRefused(
                f"result is {size} bytes; the limit is {rt.settings.max_result_bytes}"
            )

    def decide(conn: Connection, run: Any, call: Any, actor: str, now: datetime) -> _Decided:
        if call.hold != Hold.RECONCILE.value or call.state == CallState.SETTLED.value:
            raise _not_held(task_id, call, Hold.RECONCILE)
        evidence = (call.hold_info or {}).get("evidence")
        by = f"operator:{actor}"[:200]
        detail: JSON = {"verdict": verdict, "tool": call.name, "evidence": evidence}
        invoke = None
        await_version = None
        if verdict == "not_done" and call.late_reports:
            raise NotHeld(
                f"call {call.call_id!r} of task {task_id!r} reported after it was held: "
                f"{json.dumps(call.late_result)[:500]}; it may well have happened, so it is not "
                "run again: decide it with --done (its result) or --unknown"
            )
        if verdict == "not_done":
            seconds = _deadline_seconds(rt, call)
            store.release_call(
                conn,
                call.execution_id,
                call.turn,
                call.call_id,
                held=Hold.RECONCILE,
                now=now,
                deadline_at=now + timedelta(seconds=seconds),
                version=run.version,
            )
            detail["repeat"] = {"authorised_by": actor, "attempts_before": call.attempts}
            invoke = (call.execution_id, call.turn, call.call_id)
        else:
            if verdict == "done":
                outcome = Outcome.OK
                value: Any = result if result is not None else {"done": True, "note": note}
            else:
                outcome = Outcome.INTERRUPTED
                value = {
                    **(evidence if isinstance(evidence, dict) else {"evidence": evidence}),
                    "reconciled": "unknown",
                    "by": shown_actor(actor, origin),
                    "note": note,
                }
            store.settle_held_call(
                conn,
                call.execution_id,
                call.turn,
                call.call_id,
                held=Hold.RECONCILE,
                outcome=outcome.value,
                result=value,
                by=by,
                now=now,
            )
            await_version = _after_settle(conn, run, call, now + rt.stall)
        rid = _verdict_row(
            conn,
            task_id,
            call,
            Action.RECONCILE,
            actor,
            now,
            request_id,
            note=note,
            detail=detail,
            origin=origin,
        )
        return _Decided(rid, invoke=invoke, await_version=await_version)

    return _decide(
        rt, task_id, call_id, action=Action.RECONCILE, operator=operator,
        request_id=request_id, note=note, decide=decide, origin=origin,
    )  # fmt: skip


# -- resume ---------------------------------------------------------------------------------

#: state a finished run carries that a resumed one must not: why it ended, the report's tries
_ENDING_STATE = (
    "error",
    "stop",
    "stopped_in",
    "poison",
    "report_attempts",
    "accepted",
    "last_report_error",
    "report_failure_retries",
    "model_retries",
    "last_model_error",
    "model_retry",
)

_RESUMABLE = (TaskStatus.FAILED.value, TaskStatus.TIMED_OUT.value)

_TOOL_PHASES = (Phase.DISPATCH_TOOLS.value, Phase.AWAIT_TOOLS.value, Phase.ADVANCE_TURN.value)


def resume(
    task_id: str,
    *,
    timeout: float | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
    note: str | None = None,
    budget: JSON | None = None,
) -> ActionRecord:
    """Resume a task that ``failed`` or ``timed_out``: its run re-enters at the phase it ended
    in, with a fresh attempt budget (and, for a timeout, ``timeout`` seconds from now, or none).
    ``budget`` changes the task's budget: the limits it names replace those stored (a limit
    given as None is dropped), the others stay; a task whose budget its usage has
    already reached (one that failed by its budget) is refused unless given one with room, so
    a resume never just fails again at the next model call.
    A turn whose calls were closed when it ended keeps their results (the model was shown
    them, I8): the run re-enters at that turn's next model call, and no call runs again. A
    succeeded or canceled task is refused (fork it instead). Right after the task ends its run
    may be a step short of ``done`` (reporting the end): the resume waits for it, up to
    ``REPORTING_WAIT`` seconds."""
    rt = get_producer()
    note = _note(note)
    if timeout is not None and (isinstance(timeout, bool) or timeout <= 0):
        raise ActionRefused(f"timeout must be positive seconds, got {timeout!r}")
    if budget is not None:
        try:
            pricing.validate_budget(budget)
        except pricing.BudgetError as exc:
            raise ActionRefused(str(exc)) from None
    request_id = request_id or f"resume-{uuid.uuid4().hex}"
    actor = actor_name(operator, rt)
    xid = execution_id_for(task_id)

    def act(conn: Connection) -> tuple[int, Phase, int, int]:
        run = store.lock_run(conn, xid)
        status = store.task_status(conn, task_id, lock=True)
        if run is None or status is None:
            raise TaskNotFound(task_id)
        if status in (TaskStatus.SUCCEEDED.value, TaskStatus.CANCELED.value):
            raise NotResumable(
                f"task {task_id!r} {status}: only a failed or timed-out task resumes; to go on "
                f"from one of its turns, fork it (charlie fork {task_id} --turn N)"
            )
        if status not in (TaskStatus.FAILED.value, TaskStatus.TIMED_OUT.value):
            raise NotResumable(f"task {task_id!r} is {status}, not failed or timed out")
        if run.phase != Phase.DONE.value:
            raise StillReporting(
                f"task {task_id!r} is {status} but its run is still reporting it "
                f"({run.phase}); try again in a moment"
            )
        limits = _budget_for_resume(rt, conn, task_id, budget)
        state = dict(run.state or {})
        phase, turn = _reentry(conn, xid, state, run.turn)
        now = utcnow()
        fresh = {k: v for k, v in state.items() if k not in _ENDING_STATE}
        fresh["resumed"] = int(state.get("resumed", 0)) + 1
        store.reenter_run(
            conn,
            execution_id=xid,
            version=run.version,
            phase=phase,
            turn=turn,
            state=fresh,
            actor=actor,
            now=now,
            note=f"resumed by {actor}" + (f": {note}" if note else ""),
        )
        timeout_at = store.task_timeout_at(conn, task_id)
        if timeout is not None:
            timeout_at = now + timedelta(seconds=timeout)
        elif timeout_at is not None and timeout_at <= now:
            raise NotResumable(
                f"task {task_id!r} is past its timeout ({timeout_at.isoformat()}); resume it "
                f"with a new one: charlie.resume({task_id!r}, timeout=SECONDS) or "
                f"`charlie resume {task_id} --timeout SECONDS`"
            )
        store.reopen_task(
            conn,
            task_id,
            status=TaskStatus.QUEUED if phase is Phase.LOAD_CONTEXT else TaskStatus.RUNNING,
            timeout_at=timeout_at,
        )
        previous = state.get("error") or state.get("poison") or {"reason": state.get("stop")}
        rid = store.record_action(
            conn,
            task_id=task_id,
            action=Action.RESUME,
            actor=actor,
            now=now,
            note=note,
            detail={
                "from_status": status,
                "phase": phase.value,
                "turn": turn,
                "version": run.version + 1,
                "ended_with": _summary(previous),
                **({"budget": limits} if budget is not None else {}),
            },
            request_id=request_id,
            origin=origin,
        )
        return rid, phase, run.version + 1, run.priority

    waited_until = time.monotonic() + REPORTING_WAIT
    while True:
        try:
            done, recorded = _once(rt, request_id, "resume a task", act)
            break
        except StillReporting:
            if time.monotonic() >= waited_until:
                raise
            time.sleep(0.1)
    if recorded is not None:
        return recorded
    assert done is not None
    rid, phase, version, priority = done
    rt.publisher.tick(xid, phase, version, priority=priority)
    return _record(rt, rid)


def _budget_for_resume(
    rt: Producer, conn: Connection, task_id: str, change: JSON | None
) -> JSON | None:
    """The budget a resumed task runs under (a new one stored); refused if its usage has
    reached it already, since its next model call would fail the task again at once."""
    row = store.task_budget_usage(conn, task_id)
    if row is None:
        raise TaskNotFound(task_id)
    given = change is not None
    limits = pricing.with_defaults(change, row.budget or {}) if given else row.budget
    if not limits:
        if given:
            store.set_task_budget(conn, task_id, None)
        return None
    try:
        prices = pricing.price_table(rt.settings.prices)
        if given:
            pricing.check_priced(limits, row.model, prices)
    except (pricing.PriceError, pricing.BudgetError) as exc:
        raise NotResumable(f"task {task_id!r}: {exc}") from None
    # Its budget counts its delegated tasks' spend too (store.spend): a parent that failed
    # by what its children spent resumes only with room for that.
    tree = spend.subtree_spend(conn, task_id)
    reached = pricing.exceeded_by(limits, pricing.spent([(t.model, t.usage) for t in tree], prices))
    if reached is not None:
        key = reached["budget"]
        raise NotResumable(
            f"task {task_id!r}: {reached['message']}. Resume it with a larger budget: "
            f"charlie.resume({task_id!r}, budget={{{key!r}: MORE}}) or `charlie resume "
            f"{task_id} --budget-{key.replace('_', '-')} MORE` (the usage so far counts "
            "against it)"
        )
    if given:
        store.set_task_budget(conn, task_id, limits)
    return limits


def _summary(ended: object) -> JSON | None:
    if not isinstance(ended, dict):
        return None
    keys = ("phase", "type", "message", "reason", "budget", "limit", "used")
    return {k: ended[k] for k in keys if k in ended}


def _reentry(conn: Connection, xid: str, state: JSON, turn: int) -> tuple[Phase, int]:
    """Where a finished run re-enters: the phase it ended in, except that a tool turn the
    ending closed (its calls settled, their results written) goes on at the next model call."""
    ended = state.get("error") or {}
    poison = state.get("poison")
    where = state.get("stopped_in") or ended.get("phase")
    if where is None and isinstance(poison, dict):
        where = poison.get("phase")
    if where in (None, Phase.REPORT_FAILURE.value, Phase.DONE.value):
        # The failure's own report failed: the original failure says where the run was.
        where = (ended.get("last_error") or {}).get("phase") if isinstance(ended, dict) else None
        where = where or Phase.CALL_MODEL.value
    if where in _TOOL_PHASES:
        if store.has_results(conn, xid, turn):
            return Phase.CALL_MODEL, turn + 1
        return Phase.ADVANCE_TURN, turn
    if where == Phase.CALL_MODEL.value and store.has_calls(conn, xid, turn):
        # Defensive: a model turn that committed its calls moved on; never overwrite them.
        return Phase.ADVANCE_TURN, turn
    return Phase(where), turn


def _record(rt: Producer, record_id: int) -> ActionRecord:
    with read(rt.engine) as conn:
        row = store.action_by_id(conn, record_id)
    assert row is not None
    return record_of(row)


# -- fork (I26) -----------------------------------------------------------------------------


def fork(
    source: str,
    /,
    *,
    turn: int,
    message: str | None = None,
    model: str | None = None,
    task_id: str | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> str:
    """A new task (``task_id``, or a generated id) whose transcript is ``source``'s through the
    end of turn ``turn`` (tool results as recorded, each item marked as copied from the source),
    whose first model call is turn ``turn + 1`` (with ``message`` as user input, if given) and
    which runs no tool call of the source again (I26). The source is unchanged, whatever its
    state."""
    from charlie.models import normalise_model

    rt = get_producer()
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise ForkRefused(f"turn must be a whole number from 0, got {turn!r}")
    if message is not None:
        message = _text(message, "message", rt.settings.max_prompt_bytes)
    model = normalise_model(model) if model is not None else None
    if task_id is not None and not TASK_ID.match(task_id):
        raise ForkRefused(
            f"task id {task_id!r} must be 1-{MAX_TASK_ID} characters of letters, digits and ._:-"
        )
    new_id = task_id or request_id or uuid.uuid4().hex
    actor = actor_name(operator, rt)
    # What the fork is, so a second fork under the same id must be the same one.
    forked_from: JSON = {"task": source, "turn": turn, "model": model}
    if message is not None:
        forked_from["message_sha256"] = hashlib.sha256(message.encode()).hexdigest()

    def act(conn: Connection) -> tuple[str, bool, int]:
        src = store.source_of_fork(conn, source)
        if src is None:
            raise TaskNotFound(source)
        existing = store.source_of_fork(conn, new_id)
        if existing is not None:
            if (existing.metadata or {}).get("forked_from") == forked_from:
                return new_id, False, existing.priority  # this fork was made already
            raise TaskConflict(f"task id {new_id!r} is taken by another task")
        _check_turn_settled(conn, src, turn)
        faults.hit("people.fork.before_insert", task_id=new_id)
        if model is not None and src.budget:
            # The fork inherits the source's budget (its own usage starts at 0): a usd limit
            # needs a price for its model too.
            try:
                pricing.check_priced(src.budget, model, pricing.price_table(rt.settings.prices))
            except (pricing.PriceError, pricing.BudgetError) as exc:
                raise ForkRefused(str(exc)) from None
        items = _copied_items(conn, src, turn)
        if message is not None:
            items.append(
                {
                    "seq": len(items),
                    "turn": turn,
                    "kind": ItemKind.INPUT.value,
                    "call_id": None,
                    "payload": {"role": "user", "content": message, "sent_by": actor},
                }
            )
        now = utcnow()
        store.insert_forked_run(
            conn,
            task_id=new_id,
            execution_id=execution_id_for(new_id),
            prompt=src.prompt,
            model=model or src.model,
            tools=src.tools,
            approve=src.approve,
            metadata={**(src.metadata or {}), "forked_from": forked_from},
            turn=turn + 1,
            items=items,
            state={"forked_from": forked_from, **_context_at_fork(src, items, model)},
            now=now,
            budget=src.budget,
            priority=src.priority,  # a fork goes on as its source would have
        )
        store.record_action(
            conn,
            task_id=source,
            action=Action.FORK,
            actor=actor,
            now=now,
            turn=turn,
            detail={
                "fork": new_id,
                "turn": turn,
                "model": model or src.model,
                "message": message is not None,
                "items_copied": len(items) - (message is not None),
            },
            request_id=request_id,
            origin=origin,
        )
        return new_id, True, src.priority

    try:
        made, recorded = _once(rt, request_id, "fork a task", act)
    except ConstraintViolation:
        # Another fork under this id committed between this one's check and its insert: the
        # same fork (a retried request) is this one, made; another one holds the id.
        with read(rt.engine) as conn:
            existing = store.source_of_fork(conn, new_id)
        if existing is None:
            raise
        if (existing.metadata or {}).get("forked_from") != forked_from:
            raise TaskConflict(f"task id {new_id!r} is taken by another task") from None
        return new_id
    if recorded is not None:
        return str((recorded.detail or {}).get("fork"))
    assert made is not None
    fork_id, created, priority = made
    if created:
        rt.publisher.tick(execution_id_for(fork_id), Phase.CALL_MODEL, 0, priority=priority)
    return fork_id


def _check_turn_settled(conn: Connection, source: Any, turn: int) -> None:
    """Only a settled turn can be copied: its calls' results are in the transcript."""
    at = int(source.x_turn)
    if turn < at:
        return
    finals = [
        i
        for i in store.items_through(conn, source.x_id, turn)
        if i.turn == turn and i.kind == ItemKind.FINAL.value
    ]
    closed = turn == at and (
        bool(finals)
        or (
            source.x_phase == Phase.DONE.value
            and store.open_calls_in(conn, source.x_id, turn) == 0
            and store.has_results(conn, source.x_id, turn)
        )
    )
    if not closed:
        raise ForkRefused(
            f"turn {turn} of task {source.id!r} has not settled (the run is at turn {at}, "
            f"{source.x_phase}); fork from an earlier turn"
            if at > 0
            else f"turn {turn} of task {source.id!r} has not settled (the run is at turn {at}, "
            f"{source.x_phase}); wait for it to settle"
        )


#: what a run learned of its model's context window (docs/models/long-runs.md): true of the
#: model wherever the fork starts, so a fork keeps it (a fork to another model does not)
_LEARNED_CONTEXT = ("window", "ratio", "summary_tokens", "planned")


def _context_at_fork(source: Any, items: list[dict[str, Any]], model: str | None) -> JSON:
    """The context state the fork plans its first model call with (I29): what the source
    learned of its model (a window a refusal showed, the estimate's ratio, the settings its
    calls planned with), and how far results were elided if that is within the copied
    history; a fork from before it elides its own (the plan works it out from the items)."""
    learned = (source.x_state or {}).get("context")
    if not isinstance(learned, dict):
        return {}
    kept: dict[str, Any] = {}
    if model is None or model == source.model:
        kept = {k: learned[k] for k in _LEARNED_CONTEXT if k in learned}
    elide_through = learned.get("elide_through")
    copied = [i for i in items if "copied_from" in i["payload"]]
    if isinstance(elide_through, int) and copied and elide_through <= copied[-1]["seq"]:
        kept["elide_through"] = elide_through
    return {"context": kept} if kept else {}


def _copied_items(conn: Connection, source: Any, turn: int) -> list[dict[str, Any]]:
    """The source's transcript through ``turn``, each item marked as copied history. A final
    answer becomes an assistant message: the fork's own answer is still to come."""
    copied = []
    for n, item in enumerate(store.items_through(conn, source.x_id, turn)):
        kind, payload = item.kind, dict(item.payload or {})
        if kind == ItemKind.FINAL.value:
            kind = ItemKind.MESSAGE.value
            payload = {"role": "assistant", "content": payload.get("content", "")}
        payload["copied_from"] = {"task": source.id, "seq": item.seq}
        copied.append(
            {"seq": n, "turn": item.turn, "kind": kind, "call_id": item.call_id, "payload": payload}
        )
    return copied


# -- reading ----------------------------------------------------------------------------------


def actions(task_id: str) -> list[ActionRecord]:
    """Every operator action on a task, oldest first (I27)."""
    rt = get_producer()

    def load() -> list[ActionRecord]:
        with read(rt.engine) as conn:
            if store.task_status(conn, task_id) is None:
                raise TaskNotFound(task_id)
            return [record_of(r) for r in store.actions_of(conn, task_id)]

    return again_if_disconnected(load, "read a task's actions")


def action_for_request(request_id: str) -> ActionRecord | None:
    """The action a request (its ``request_id``) recorded, if it recorded one: how a caller of
    ``send``, ``cancel`` or ``fork``, which return no record, finds the one it made (I27)."""
    rt = get_producer()

    def load() -> ActionRecord | None:
        with read(rt.engine) as conn:
            row = store.action_by_request(conn, request_id)
        return None if row is None else record_of(row)

    return again_if_disconnected(load, "read an action")


# -- provider limits: what an operator sees of them, and lifting a pause (I27, I32, I36) ------

#: at most this many of a limit's waiters are woken at once when its pause is lifted; the
#: others follow as those release their slots (each release wakes the next in line)
RESUME_WAKES = 32


class LimitNotPaused(ActionRefused):
    """``charlie limits resume KEY`` on a limit that is not paused (or was never used)."""


@dataclass(frozen=True)
class LimitState:
    """One provider limit as an operator sees it: what is in flight and waiting, and until
    when the provider paused it (None: not paused)."""

    key: str
    in_flight: int
    waiting: int
    recent: int
    paused_until: datetime | None
    throttles: int

    def describe(self, now: datetime | None = None) -> str:
        now = now or utcnow()
        text = f"{self.in_flight} in flight, {self.waiting} waiting"
        if self.paused_until is not None and self.paused_until > now:
            left = (self.paused_until - now).total_seconds()
            text += (
                f", paused by the provider until {self.paused_until.isoformat(timespec='seconds')}"
                f" ({left:.0f} s left; lift: charlie limits resume {self.key})"
            )
        return text


@dataclass(frozen=True)
class LimitActionRecord:
    """An operator's action on a limit, as recorded (I27, I32)."""

    id: int
    key: str
    action: str
    actor: str
    at: datetime
    note: str | None
    detail: JSON | None
    channel: Channel
    authenticated: bool

    @property
    def by(self) -> str:
        return describe_actor(self.actor, self.channel, self.authenticated)


def limit_states() -> list[LimitState]:
    """Every provider limit used so far (CHARLIE_MODEL_LIMITS), as it is now."""
    from charlie.store import limits as limits_store

    rt = get_producer()
    with read(rt.engine) as conn:
        rows = limits_store.statuses(conn, utcnow())
    return [
        LimitState(
            r.key,
            r.in_flight,
            r.waiting,
            r.recent,
            limits_store._aware(r.paused_until),
            r.throttles,
        )
        for r in sorted(rows, key=lambda r: r.key)
    ]


def limit_actions(key: str | None = None, last: int = 20) -> list[LimitActionRecord]:
    """The last operator actions on limits (on ``key`` only, when given), newest first."""
    from charlie.store import limits as limits_store

    rt = get_producer()
    with read(rt.engine) as conn:
        rows = limits_store.limit_action_rows(conn, key, last)
    return [
        LimitActionRecord(
            r.id,
            r.key,
            r.action,
            r.actor,
            r.at,
            r.note,
            r.detail,
            Channel(r.channel),
            r.authenticated,
        )
        for r in rows
    ]


def resume_limit(
    key: str,
    *,
    operator: str | None = None,
    origin: Origin | None = None,
    note: str | None = None,
) -> LimitActionRecord:
    """Lift the pause a provider put on limit ``key`` (a 429 / 529's wait): its callers may
    send again at once. Recorded as an operator action with its channel (I27, I32); the first
    waiters in line are woken (their stored wake-up was the pause's end), the others follow as
    slots are released. Refused, recording nothing, when the limit is not paused."""
    from charlie.limits import limit_for, limit_table
    from charlie.store import limits as limits_store

    rt = get_producer()
    note = _note(note)
    key = _text(key, "limit key", 500)
    actor = actor_name(operator, rt)
    origin = origin or Origin()

    def act(conn: Connection) -> tuple[int, list[limits_store.Woken]]:
        now = utcnow()
        used, until = limits_store.paused(conn, key)
        if not used:
            raise LimitNotPaused(
                f"no limit {key!r} has been used here (see `charlie limits` for those that have)"
            )
        if until is None or until <= now:
            raise LimitNotPaused(f"limit {key!r} is not paused")
        lifted = limits_store.lift_pause(conn, key)
        woken = limits_store.next_in_line(conn, key, now, RESUME_WAKES, timedelta(0))
        # the throttled call's own retry (and any waiter not in line) was stored for the
        # pause's end: woken too, those of this limit by their task's model
        table = limit_table(rt.settings.model_limits)
        seen = {w.execution_id for w in woken}
        for run in limits_store.held_until(conn, now, lifted or until, RESUME_WAKES):
            limit = limit_for(run.model, table)
            if run.execution_id not in seen and limit is not None and limit.key == key:
                woken.append(limits_store.Woken(run.execution_id, run.version, run.priority))
        rid = limits_store.record_limit_action(
            conn,
            key=key,
            action=Action.RESUME.value,
            actor=actor,
            now=now,
            channel=origin.channel.value,
            authenticated=origin.authenticated,
            note=note,
            detail={
                "paused_until": (lifted or until).isoformat(),
                "woken": len(woken),
            },
        )
        return rid, woken

    rid, woken = again_if_disconnected(lambda: _in_write(rt, act), "lift a limit's pause")
    for waiter in woken:
        rt.publisher.tick(
            waiter.execution_id, Phase.CALL_MODEL, waiter.version, priority=waiter.priority
        )
    return next(r for r in limit_actions(key, 50) if r.id == rid)


def _in_write(rt: Producer, act: Callable[[Connection], T]) -> T:
    with write(rt.engine) as conn:
        return act(conn)
