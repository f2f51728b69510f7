"""Core statements for the pending-tool records: mark started (I9), settle (I12), late reports."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Connection, and_, exists, or_, update

from charlie.domain import ENDING_PHASES, CallState, TaskStatus
from charlie.store.schema import executions, tasks, tool_calls

ENDING_PHASE_VALUES = tuple(p.value for p in ENDING_PHASES)
ACTIVE_STATUSES = (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value, TaskStatus.WAITING.value)

Mode = Literal["start", "resume", "reconcile"]


@dataclass(frozen=True)
class ClaimedCall:
    execution_id: str
    turn: int
    call_id: str
    name: str
    arguments: dict[str, Any]
    resumable: bool
    started_at: datetime | None
    started_by: str | None
    handle: str | None
    attempts: int
    deadline_at: datetime | None


def _key(execution_id: str, turn: int, call_id: str) -> Any:
    c = tool_calls.c
    return and_(c.execution_id == execution_id, c.turn == turn, c.call_id == call_id)


def claim_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    mode: Mode,
    owner: str,
    now: datetime,
    lease_seconds: float,
) -> ClaimedCall | None:
    """``start``: pending → started, committed before the handler runs (I9).
    ``resume``/``reconcile``: take over a started call whose lease lapsed (I10).
    ``None``: not claimable (already started, settled, or someone live holds it)."""
    c = tool_calls.c
    e, t = executions.c, tasks.c
    until = now + timedelta(seconds=lease_seconds)
    # Work starts only for a live run of an active task: never after a cancel, a timeout or a
    # failure (I18), whatever messages are still in flight.
    live = exists().where(
        e.id == execution_id,
        e.phase.not_in(ENDING_PHASE_VALUES),
        exists().where(t.id == e.task_id, t.status.in_(ACTIVE_STATUSES)),
    )
    stmt = update(tool_calls).where(_key(execution_id, turn, call_id), live)
    if mode == "start":
        stmt = stmt.where(c.state == CallState.PENDING.value, c.queued_at.is_not(None)).values(
            state=CallState.STARTED.value, started_at=now, started_by=owner
        )
    elif mode == "resume":
        # A parked wait (no owner) may be observed at any time; a held one only once its
        # holder's lease has lapsed.
        stmt = stmt.where(
            c.state == CallState.STARTED.value,
            c.resumable.is_(True),
            or_(c.lease_owner.is_(None), c.lease_until < now),
        )
    else:
        stmt = stmt.where(c.state == CallState.STARTED.value, c.lease_until < now)
    stmt = stmt.values(lease_owner=owner, lease_until=until, attempts=c.attempts + 1).returning(
        c.name,
        c.arguments,
        c.resumable,
        c.started_at,
        c.started_by,
        c.handle,
        c.attempts,
        c.deadline_at,
    )
    row = conn.execute(stmt).first()
    if row is None:
        return None
    return ClaimedCall(
        execution_id,
        turn,
        call_id,
        row.name,
        row.arguments,
        row.resumable,
        row.started_at,
        row.started_by,
        row.handle,
        row.attempts,
        row.deadline_at,
    )


def renew_call_lease(conn: Connection, call: ClaimedCall, owner: str, until: datetime) -> bool:
    c = tool_calls.c
    stmt = (
        update(tool_calls)
        .where(
            _key(call.execution_id, call.turn, call.call_id),
            c.state == CallState.STARTED.value,
            c.lease_owner == owner,
        )
        .values(lease_until=until)
    )
    return conn.execute(stmt).rowcount == 1


def park_call(
    conn: Connection, call: ClaimedCall, owner: str, handle: str, poll_at: datetime
) -> bool:
    """A resumable wait that is still waiting: keep it started, drop the owner, and let the
    sweep observe it again at ``poll_at``. A normal return, so the crash counter resets."""
    c = tool_calls.c
    done = conn.execute(
        update(tool_calls)
        .where(
            _key(call.execution_id, call.turn, call.call_id),
            c.state == CallState.STARTED.value,
            c.lease_owner == owner,
        )
        .values(handle=handle, lease_owner=None, lease_until=poll_at, attempts=0, swept_at=None)
    )
    return done.rowcount == 1


def record_handle(conn: Connection, call: ClaimedCall, handle: str) -> None:
    conn.execute(
        update(tool_calls)
        .where(_key(call.execution_id, call.turn, call.call_id))
        .values(handle=handle)
    )


def settle_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    outcome: str,
    result: Any,
    owner: str,
    now: datetime,
    duration_ms: float | None = None,
) -> bool:
    """The first result wins (I12): only an unsettled call takes an outcome. On False the
    caller records a late report instead."""
    c = tool_calls.c
    done = conn.execute(
        update(tool_calls)
        .where(_key(execution_id, turn, call_id), c.state != CallState.SETTLED.value)
        .values(
            state=CallState.SETTLED.value,
            outcome=outcome,
            result=result,
            settled_at=now,
            settled_by=owner,
            lease_owner=None,
            lease_until=None,
            duration_ms=duration_ms,
        )
    )
    return done.rowcount == 1


def record_late_report(
    conn: Connection, execution_id: str, turn: int, call_id: str, outcome: str, result: Any
) -> None:
    c = tool_calls.c
    conn.execute(
        update(tool_calls)
        .where(_key(execution_id, turn, call_id))
        .values(
            late_reports=c.late_reports + 1,
            late_result={"outcome": outcome, "result": result},
        )
    )
