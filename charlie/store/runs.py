"""Core statements for executions, transcripts and transitions: the tick's reads and writes.

Every state change is a compare-and-set on the row's version and lease (I1, I2): a statement
that matches no row means another worker or a newer message got there first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, insert, or_, select, update

from charlie.domain import (
    JSON,
    CallState,
    CallView,
    Effect,
    Item,
    ItemKind,
    Outcome,
    Phase,
    TaskStatus,
    TaskView,
    Transition,
)
from charlie.store.schema import executions, tasks, tool_calls, transcript_items, transitions

ACTIVE = (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value, TaskStatus.WAITING.value)


@dataclass(frozen=True)
class Claim:
    """An execution row as claimed by this worker for one tick."""

    execution_id: str
    task_id: str
    phase: Phase
    version: int
    turn: int
    next_seq: int
    state: JSON
    attempts: int
    #: the error an earlier attempt of this tick recorded (a refused write), if any.
    last_error: JSON | None = None


def claim_execution(
    conn: Connection,
    execution_id: str,
    phase: Phase,
    version: int,
    owner: str,
    now: datetime,
    lease_seconds: float,
) -> Claim | None:
    """Take the lease on the row if it is still at (phase, version) and nobody live holds it.

    ``None`` is a stale or duplicate message (I2)."""
    e = executions.c
    stmt = (
        update(executions)
        .where(
            e.id == execution_id,
            e.phase == phase.value,
            e.version == version,
            or_(e.lease_until.is_(None), e.lease_until < now),
        )
        .values(
            lease_owner=owner,
            lease_until=now + timedelta(seconds=lease_seconds),
            attempts=e.attempts + 1,
            wake_at=None,
        )
        .returning(e.task_id, e.turn, e.next_seq, e.state, e.attempts, e.error)
    )
    row = conn.execute(stmt).first()
    if row is None:
        return None
    return Claim(
        execution_id,
        row.task_id,
        phase,
        version,
        row.turn,
        row.next_seq,
        row.state,
        row.attempts,
        row.error,
    )


def renew_execution_lease(
    conn: Connection, execution_id: str, version: int, owner: str, until: datetime
) -> bool:
    e = executions.c
    stmt = (
        update(executions)
        .where(e.id == execution_id, e.version == version, e.lease_owner == owner)
        .values(lease_until=until)
    )
    return conn.execute(stmt).rowcount == 1


def task_view(row: Any) -> TaskView:
    return TaskView(
        id=row.id,
        prompt=row.prompt,
        model=row.model,
        tools=row.tools,
        metadata=row.metadata or {},
        status=TaskStatus(row.status),
        parent_id=row.parent_id,
        timeout_at=row.timeout_at,
    )


def load_task(conn: Connection, task_id: str) -> TaskView | None:
    t = tasks.c
    row = conn.execute(
        select(
            t.id, t.prompt, t.model, t.tools, t.metadata, t.status, t.parent_id, t.timeout_at
        ).where(t.id == task_id)
    ).first()
    return task_view(row) if row else None


def load_items(conn: Connection, execution_id: str) -> list[Item]:
    i = transcript_items.c
    rows = conn.execute(
        select(i.seq, i.turn, i.kind, i.call_id, i.payload)
        .where(i.execution_id == execution_id)
        .order_by(i.seq)
    )
    return [Item(r.seq, r.turn, ItemKind(r.kind), r.call_id, r.payload) for r in rows]


def call_view(r: Any) -> CallView:
    return CallView(
        call_id=r.call_id,
        turn=r.turn,
        index=r.idx,
        name=r.name,
        arguments=r.arguments,
        state=CallState(r.state),
        outcome=Outcome(r.outcome) if r.outcome else None,
        result=r.result,
        queued_at=r.queued_at,
        started_at=r.started_at,
        settled_at=r.settled_at,
        deadline_at=r.deadline_at,
    )


CALL_COLUMNS = (
    tool_calls.c.call_id,
    tool_calls.c.turn,
    tool_calls.c.idx,
    tool_calls.c.name,
    tool_calls.c.arguments,
    tool_calls.c.state,
    tool_calls.c.outcome,
    tool_calls.c.result,
    tool_calls.c.queued_at,
    tool_calls.c.started_at,
    tool_calls.c.settled_at,
    tool_calls.c.deadline_at,
)


def load_calls(
    conn: Connection, execution_id: str, turn: int, *, lock: bool = False
) -> list[CallView]:
    c = tool_calls.c
    stmt = (
        select(*CALL_COLUMNS).where(c.execution_id == execution_id, c.turn == turn).order_by(c.idx)
    )
    # FOR UPDATE on PostgreSQL; SQLite's writes are serialized by BEGIN IMMEDIATE anyway.
    rows = conn.execute(stmt.with_for_update() if lock else stmt)
    return [call_view(r) for r in rows]


def count_unsettled(conn: Connection, execution_id: str, turn: int) -> int:
    c = tool_calls.c
    return int(
        conn.execute(
            select(func.count())
            .select_from(tool_calls)
            .where(
                c.execution_id == execution_id,
                c.turn == turn,
                c.state != CallState.SETTLED.value,
            )
        ).scalar_one()
    )


def commit_transition(
    conn: Connection,
    claim: Claim,
    transition: Transition,
    *,
    owner: str,
    now: datetime,
    duration_ms: float,
    error: JSON | None = None,
) -> bool:
    """Write a tick's whole outcome in the caller's transaction (I1).

    Returns False, writing nothing, when the lease was lost meanwhile; the caller rolls back.
    """
    e = executions.c
    moving = transition.to is not None
    values: dict[str, Any] = {
        "lease_owner": None,
        "lease_until": None,
        "wake_at": transition.wake_at,
    }
    if transition.state is not None:
        values["state"] = transition.state
    if moving:
        assert transition.to is not None
        values.update(
            phase=transition.to.value,
            version=e.version + 1,
            updated_at=now,
            swept_at=None,
            attempts=0,
        )
    else:
        # A wait finished its tick normally; the next claim is not a retry.
        values["attempts"] = 0
    if transition.items:
        values["next_seq"] = e.next_seq + len(transition.items)
    if transition.next_turn:
        values["turn"] = e.turn + 1
    if transition.model_calls:
        values["model_calls"] = e.model_calls + transition.model_calls
    if transition.model_repeats:
        values["model_repeats"] = e.model_repeats + transition.model_repeats
    if error is not None:
        values["error"] = error
    result = conn.execute(
        update(executions)
        .where(
            e.id == claim.execution_id,
            e.version == claim.version,
            e.lease_owner == owner,
        )
        .values(**values)
    )
    if result.rowcount != 1:
        return False

    if transition.items:
        conn.execute(
            insert(transcript_items),
            [
                {
                    "execution_id": claim.execution_id,
                    "seq": claim.next_seq + n,
                    "turn": claim.turn,
                    "kind": item.kind.value,
                    "call_id": item.call_id,
                    "payload": item.payload,
                    "created_at": now,
                }
                for n, item in enumerate(transition.items)
            ],
        )
    if transition.calls:
        conn.execute(insert(tool_calls), _call_rows(claim, transition, now))
    c = tool_calls.c
    key = and_(c.execution_id == claim.execution_id, c.turn == claim.turn)
    # One executemany per kind of change, whatever the fan-out: no statement per call.
    if transition.queue_calls:
        conn.execute(
            update(tool_calls)
            .where(key, c.call_id == bindparam("b_call"), c.queued_at.is_(None))
            .values(queued_at=now, dispatch_version=claim.version, deadline_at=bindparam("b_at")),
            [{"b_call": cid, "b_at": deadline} for cid, deadline in transition.queue_calls],
        )
    if transition.settle:
        conn.execute(
            update(tool_calls)
            .where(key, c.call_id == bindparam("b_call"), c.state != CallState.SETTLED.value)
            .values(
                state=CallState.SETTLED.value,
                outcome=bindparam("b_outcome"),
                result=bindparam("b_result", type_=tool_calls.c.result.type),
                settled_at=now,
                settled_by=owner,
                lease_owner=None,
            ),
            [
                {"b_call": s.call_id, "b_outcome": s.outcome.value, "b_result": s.result}
                for s in transition.settle
            ],
        )
    if transition.finish_order:
        conn.execute(
            update(tool_calls)
            .where(key, c.call_id == bindparam("b_call"))
            .values(finish_order=bindparam("b_order")),
            [{"b_call": cid, "b_order": n} for cid, n in transition.finish_order.items()],
        )
    if transition.task_status is not None or transition.usage:
        t = tasks.c
        task_values: dict[str, Any] = {}
        if transition.usage:
            task_values.update(
                input_tokens=t.input_tokens + transition.usage.get("input_tokens", 0),
                output_tokens=t.output_tokens + transition.usage.get("output_tokens", 0),
                reasoning_tokens=t.reasoning_tokens + transition.usage.get("reasoning_tokens", 0),
            )
        if transition.task_status is not None:
            task_values["status"] = transition.task_status.value
            if transition.task_status is TaskStatus.RUNNING:
                task_values["started_at"] = func.coalesce(t.started_at, now)
        conn.execute(
            update(tasks).where(t.id == claim.task_id, t.status.in_(ACTIVE)).values(**task_values)
        )
    if moving:
        assert transition.to is not None
        conn.execute(
            insert(transitions).values(
                execution_id=claim.execution_id,
                from_phase=claim.phase.value,
                to_phase=transition.to.value,
                version=claim.version + 1,
                at=now,
                worker=owner,
                duration_ms=duration_ms,
                note=transition.note,
            )
        )
    return True


def _call_rows(claim: Claim, transition: Transition, now: datetime) -> list[dict[str, Any]]:
    rows = []
    for call in transition.calls:
        settled = call.settled
        rows.append(
            {
                "execution_id": claim.execution_id,
                "call_id": call.call_id,
                "turn": claim.turn,
                "idx": call.index,
                "name": call.name,
                "arguments": call.arguments,
                "effect": Effect(call.effect).value,
                "resumable": call.resumable,
                "state": CallState.SETTLED.value if settled else CallState.PENDING.value,
                "outcome": settled[0].value if settled else None,
                "result": settled[1] if settled else None,
                "settled_at": now if settled else None,
                "settled_by": "validation" if settled else None,
                "attempts": 0,
                "late_reports": 0,
            }
        )
    return rows


def record_refused_tick(
    conn: Connection,
    execution_id: str,
    version: int,
    owner: str,
    error: JSON,
    *,
    claim_committed: bool,
) -> None:
    """A tick whose writes the database refused: keep the error as evidence and free the run
    for the sweep. If the claim was rolled back with the rest, count the attempt here, so the
    poison limit still bounds the retries."""
    e = executions.c
    stmt = update(executions).where(e.id == execution_id, e.version == version)
    if claim_committed:
        stmt = stmt.where(e.lease_owner == owner).values(
            error=error, lease_owner=None, lease_until=None
        )
    else:
        stmt = stmt.where(e.lease_owner.is_(None)).values(error=error, attempts=e.attempts + 1)
    conn.execute(stmt)


def execution_position(conn: Connection, execution_id: str) -> tuple[Phase, int] | None:
    e = executions.c
    row = conn.execute(select(e.phase, e.version).where(e.id == execution_id)).first()
    return (Phase(row.phase), row.version) if row else None
