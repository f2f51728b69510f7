"""The statements of people in the loop: the mailbox, held calls and verdicts, resume, fork,
and the operators' evidence rows (I22-I27).

The rules (what may be decided when, in which order the rows are locked) are charlie.people's;
these are the statements it runs, each inside the caller's transaction. Lock order is the
tick's: the run's row first, then its calls, then the task.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert, select, update

from charlie.domain import (
    ENDING_PHASES,
    JSON,
    VERDICTS,
    Action,
    CallState,
    Hold,
    ItemKind,
    Origin,
    Phase,
    TaskStatus,
)
from charlie.observe import new_trace
from charlie.store.schema import (
    executions,
    messages,
    operator_actions,
    tasks,
    tool_calls,
    transcript_items,
    transitions,
)
from charlie.store.tasks import insert_task_and_run

_e, _t, _c, _m, _a = executions.c, tasks.c, tool_calls.c, messages.c, operator_actions.c
_i = transcript_items.c
ENDING = tuple(p.value for p in ENDING_PHASES)
ACTIVE = (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value, TaskStatus.WAITING.value)
RESUMABLE = (TaskStatus.FAILED.value, TaskStatus.TIMED_OUT.value)
VERDICT_VALUES = tuple(sorted(a.value for a in VERDICTS))


# -- evidence (I27) -----------------------------------------------------------------------


def record_action(
    conn: Connection,
    *,
    task_id: str,
    action: Action,
    actor: str,
    now: datetime,
    call_id: str | None = None,
    turn: int | None = None,
    note: str | None = None,
    detail: JSON | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> int:
    """The evidence row of one operator action (I27), with how it arrived (I32)."""
    origin = origin or Origin()
    row = conn.execute(
        insert(operator_actions)
        .values(
            task_id=task_id,
            action=action.value,
            call_id=call_id,
            turn=turn,
            actor=actor,
            at=now,
            note=note,
            detail=detail,
            request_id=request_id,
            channel=origin.channel.value,
            authenticated=origin.authenticated,
        )
        .returning(_a.id)
    ).first()
    assert row is not None
    return int(row.id)


def action_by_request(conn: Connection, request_id: str) -> Any | None:
    return conn.execute(select(operator_actions).where(_a.request_id == request_id)).first()


def action_by_id(conn: Connection, record_id: int) -> Any | None:
    return conn.execute(select(operator_actions).where(_a.id == record_id)).first()


def actions_of(conn: Connection, task_id: str) -> list[Any]:
    return list(
        conn.execute(select(operator_actions).where(_a.task_id == task_id).order_by(_a.id)).all()
    )


def verdicts_on(conn: Connection, task_id: str, call_id: str, turn: int) -> list[Any]:
    """The verdicts recorded on this call, oldest first (I24)."""
    return list(
        conn.execute(
            select(operator_actions)
            .where(
                _a.task_id == task_id,
                _a.call_id == call_id,
                _a.turn == turn,
                _a.action.in_(VERDICT_VALUES),
            )
            .order_by(_a.id)
        ).all()
    )


# -- the mailbox (I22) ----------------------------------------------------------------------


def message_by_id(conn: Connection, task_id: str, message_id: str) -> Any | None:
    return conn.execute(
        select(messages).where(_m.task_id == task_id, _m.message_id == message_id)
    ).first()


def open_mailbox(conn: Connection, execution_id: str) -> bool:
    """Count one more message in the run's inbox, if the run can still take it in (it has not
    reached its final report). The row's lock orders this send against the run's boundaries
    (a boundary whose claim came first takes the message at the next boundary) and against
    other sends, so message ids follow commit order."""
    done = conn.execute(
        update(executions)
        .where(_e.id == execution_id, _e.phase.not_in(ENDING))
        .values(inbox=_e.inbox + 1)
    )
    return bool(done.rowcount == 1)


def add_message(
    conn: Connection, *, task_id: str, message_id: str, text: str, actor: str, now: datetime
) -> int:
    row = conn.execute(
        insert(messages)
        .values(task_id=task_id, message_id=message_id, text=text, sent_at=now, sent_by=actor)
        .returning(_m.id)
    ).first()
    assert row is not None
    return int(row.id)


def messages_of(conn: Connection, task_id: str) -> list[Any]:
    return list(conn.execute(select(messages).where(_m.task_id == task_id).order_by(_m.id)).all())


# -- held calls (I23-I25) -------------------------------------------------------------------


def task_status(conn: Connection, task_id: str, *, lock: bool = False) -> str | None:
    stmt = select(_t.status).where(_t.id == task_id)
    if lock:
        stmt = stmt.with_for_update()
    return conn.execute(stmt).scalar()


def lock_run(conn: Connection, execution_id: str) -> Any | None:
    """The run's row, locked: phase, version, turn, state (and its task's priority, for what
    a verdict publishes)."""
    priority = select(_t.priority).where(_t.id == _e.task_id).scalar_subquery()
    return conn.execute(
        select(
            _e.phase,
            _e.version,
            _e.turn,
            _e.state,
            _e.next_seq,
            _e.model_calls,
            priority.label("priority"),
        )
        .where(_e.id == execution_id)
        .with_for_update()
    ).first()


def find_call(conn: Connection, execution_id: str, call_id: str, turn: int | None) -> Any | None:
    """The call with this id (of this turn, or of the latest turn that has one), locked."""
    stmt = select(tool_calls).where(_c.execution_id == execution_id, _c.call_id == call_id)
    if turn is not None:
        stmt = stmt.where(_c.turn == turn)
    return conn.execute(stmt.order_by(_c.turn.desc()).limit(1).with_for_update()).first()


def _key(execution_id: str, turn: int, call_id: str) -> Any:
    return (_c.execution_id == execution_id) & (_c.turn == turn) & (_c.call_id == call_id)


def release_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    *,
    held: Hold,
    now: datetime,
    deadline_at: datetime,
    version: int,
) -> bool:
    """Dispatch a held call after a verdict that allows it (an approve, a ``not_done``): queued
    again, never started by this, so a worker's claim marks it started (I9, I23). A ``not_done``
    keeps the attempt count, so the lease fence of the interrupted attempt stays behind."""
    stmt = update(tool_calls).where(_key(execution_id, turn, call_id), _c.hold == held.value)
    return bool(
        conn.execute(
            stmt.values(
                hold=None,
                state=CallState.PENDING.value,
                queued_at=now,
                dispatch_version=version,
                deadline_at=deadline_at,
                lease_owner=None,
                lease_until=None,
                swept_at=None,
                # the outside work's id of the interrupted attempt stays in the evidence
                # (hold_info), not as the repeat's handle
                handle=None,
            )
        ).rowcount
        == 1
    )


def settle_held_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    *,
    held: Hold,
    outcome: str,
    result: Any,
    by: str,
    now: datetime,
) -> bool:
    """Settle a held call with a person's verdict (a deny, a reply, a reconcile): its one
    outcome (I12, I23)."""
    return bool(
        conn.execute(
            update(tool_calls)
            .where(
                _key(execution_id, turn, call_id),
                _c.hold == held.value,
                _c.state != CallState.SETTLED.value,
            )
            .values(
                state=CallState.SETTLED.value,
                outcome=outcome,
                result=result,
                settled_at=now,
                settled_by=by,
                lease_owner=None,
                lease_until=None,
                hold=None,
            )
        ).rowcount
        == 1
    )


def answer_parked_call(
    conn: Connection, execution_id: str, turn: int, call_id: str, *, info: JSON, now: datetime
) -> bool:
    """A person answered the question a started call parked with: the answer is recorded with
    the question and the hold lifted, so a resume may claim the call (hold IS NULL, I23). Its
    lease reads as lapsed now: should the resume's publish be lost, the sweep resumes it."""
    return bool(
        conn.execute(
            update(tool_calls)
            .where(
                _key(execution_id, turn, call_id),
                _c.hold == Hold.REPLY.value,
                _c.state == CallState.STARTED.value,
            )
            .values(hold=None, hold_info=info, lease_owner=None, lease_until=now, swept_at=None)
        ).rowcount
        == 1
    )


def held_calls(conn: Connection, execution_ids: list[str]) -> list[Any]:
    """The open calls of these runs that wait for a person, in call order."""
    if not execution_ids:
        return []
    return list(
        conn.execute(
            select(
                _c.execution_id,
                _c.call_id,
                _c.turn,
                _c.idx,
                _c.name,
                _c.arguments,
                _c.hold,
                _c.hold_info,
                _c.queued_at,
                _c.deadline_at,
                _c.started_at,
            )
            .where(
                _c.execution_id.in_(execution_ids),
                _c.hold.is_not(None),
                _c.state != CallState.SETTLED.value,
            )
            .order_by(_c.execution_id, _c.turn, _c.idx)
        ).all()
    )


# -- resume ---------------------------------------------------------------------------------


def has_results(conn: Connection, execution_id: str, turn: int) -> bool:
    return (
        conn.execute(
            select(_i.id)
            .where(
                _i.execution_id == execution_id,
                _i.turn == turn,
                _i.kind == ItemKind.TOOL_RESULT.value,
            )
            .limit(1)
        ).first()
        is not None
    )


def has_calls(conn: Connection, execution_id: str, turn: int) -> bool:
    return (
        conn.execute(
            select(_c.id).where(_c.execution_id == execution_id, _c.turn == turn).limit(1)
        ).first()
        is not None
    )


def reenter_run(
    conn: Connection,
    *,
    execution_id: str,
    version: int,
    phase: Phase,
    turn: int,
    state: JSON,
    actor: str,
    now: datetime,
    note: str,
) -> None:
    """Move a finished run back to ``phase`` at ``version + 1`` with a fresh attempt budget,
    recorded as a transition of its own (I21)."""
    conn.execute(
        update(executions)
        .where(_e.id == execution_id, _e.version == version)
        .values(
            phase=phase.value,
            version=version + 1,
            turn=turn,
            state=state,
            attempts=0,
            lease_owner=None,
            lease_until=None,
            wake_at=None,
            swept_at=None,
            error=None,
            updated_at=now,
        )
    )
    conn.execute(
        insert(transitions).values(
            execution_id=execution_id,
            from_phase=Phase.DONE.value,
            to_phase=phase.value,
            version=version + 1,
            at=now,
            worker=f"operator:{actor}"[:200],
            duration_ms=0.0,
            note=note,
        )
    )


def task_timeout_at(conn: Connection, task_id: str) -> datetime | None:
    value = conn.execute(select(_t.timeout_at).where(_t.id == task_id)).scalar()
    return value if isinstance(value, datetime) else None


def task_budget_usage(conn: Connection, task_id: str) -> Any | None:
    """A task's budget, model and token usage, with its run's model calls."""
    return conn.execute(
        select(
            _t.budget,
            _t.model,
            _t.input_tokens,
            _t.output_tokens,
            _t.reasoning_tokens,
            _e.model_calls,
        )
        .select_from(tasks.join(executions, _e.task_id == _t.id))
        .where(_t.id == task_id)
    ).first()


def set_task_budget(conn: Connection, task_id: str, budget: JSON | None) -> None:
    conn.execute(update(tasks).where(_t.id == task_id).values(budget=budget))


def reopen_task(
    conn: Connection, task_id: str, *, status: TaskStatus, timeout_at: datetime | None
) -> bool:
    done = conn.execute(
        update(tasks)
        .where(_t.id == task_id, _t.status.in_(RESUMABLE))
        .values(
            status=status.value,
            result=None,
            error=None,
            finished_at=None,
            cancel_requested_at=None,
            timeout_at=timeout_at,
        )
    )
    return bool(done.rowcount == 1)


# -- fork -----------------------------------------------------------------------------------


def source_of_fork(conn: Connection, task_id: str) -> Any | None:
    return conn.execute(
        select(
            _t.id,
            _t.prompt,
            _t.model,
            _t.tools,
            _t.approve,
            _t.budget,
            _t.metadata,
            _t.status,
            _t.priority,
            _e.id.label("x_id"),
            _e.phase.label("x_phase"),
            _e.turn.label("x_turn"),
            _e.state.label("x_state"),
        )
        .select_from(tasks.join(executions, _e.task_id == _t.id))
        .where(_t.id == task_id)
    ).first()


def items_through(conn: Connection, execution_id: str, turn: int) -> list[Any]:
    return list(
        conn.execute(
            select(_i.seq, _i.turn, _i.kind, _i.call_id, _i.payload)
            .where(_i.execution_id == execution_id, _i.turn <= turn)
            .order_by(_i.seq)
        ).all()
    )


def open_calls_in(conn: Connection, execution_id: str, turn: int) -> int:
    rows = conn.execute(
        select(_c.id).where(
            _c.execution_id == execution_id,
            _c.turn == turn,
            _c.state != CallState.SETTLED.value,
        )
    ).all()
    return len(rows)


def insert_forked_run(
    conn: Connection,
    *,
    task_id: str,
    execution_id: str,
    prompt: str,
    model: str,
    tools: Any,
    approve: Any,
    metadata: JSON,
    turn: int,
    items: list[dict[str, Any]],
    state: JSON,
    now: datetime,
    budget: JSON | None = None,
    priority: int = 0,
) -> None:
    """The fork's task (queued) and its run at call_model, turn ``turn``, with the copied
    history as its transcript. No tool call record is copied: nothing of the source can be
    dispatched from the fork (I26)."""
    insert_task_and_run(
        conn,
        task_id=task_id,
        execution_id=execution_id,
        prompt=prompt,
        model=model,
        tools=tools,
        timeout=None,
        metadata=metadata,
        parent_id=None,
        parent_call_id=None,
        now=now,
        approve=approve,
        budget=budget,
        phase=Phase.CALL_MODEL,
        turn=turn,
        next_seq=len(items),
        state=state,
        trace=new_trace(),  # a trace of its own: the fork's ticks are not the source's
        priority=priority,
    )
    if items:
        conn.execute(
            insert(transcript_items),
            [{**item, "execution_id": execution_id, "created_at": now} for item in items],
        )
