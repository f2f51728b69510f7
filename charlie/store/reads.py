"""The reads the Python API (and the Children port) make: one named statement per question.

Nothing here writes or locks. Each function takes an open connection, so a caller decides the
transaction and the try-again on a lost connection.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Row, and_, func, or_, select, true

from charlie.domain import TaskStatus
from charlie.store.schema import (
    executions,
    operator_actions,
    tasks,
    tool_calls,
    transcript_items,
    transitions,
)

_t, _e, _i, _c, _tr = tasks.c, executions.c, transcript_items.c, tool_calls.c, transitions.c


def task_with_run(conn: Connection, task_id: str) -> Row[Any] | None:
    """The task row and its run's phase, turn and model-call counters (None: no such task)."""
    return conn.execute(_with_run().where(_t.id == task_id)).first()


def _with_run() -> Any:
    return select(
        tasks,
        _e.phase.label("x_phase"),
        _e.turn.label("x_turn"),
        _e.model_calls.label("x_model_calls"),
        _e.model_repeats.label("x_model_repeats"),
        _e.state.label("x_state"),
        _e.lease_owner.label("x_lease_owner"),
    ).select_from(tasks.outerjoin(executions, _e.task_id == _t.id))


def task_page(
    conn: Connection,
    *,
    statuses: list[str] | None,
    parent: str | None,
    limit: int,
    before: tuple[Any, str] | None,
    search: str | None = None,
) -> list[Row[Any]]:
    """Tasks newest first, each with its run's counters: at most ``limit``, older than the
    ``before`` keyset (created_at, id), filtered by status, parent and a search in id and
    prompt."""
    stmt = task_page_statement(
        statuses=statuses, parent=parent, limit=limit, before=before, search=search
    )
    return list(conn.execute(stmt).all())


def task_page_statement(
    *,
    statuses: list[str] | None,
    parent: str | None,
    limit: int,
    before: tuple[Any, str] | None,
    search: str | None = None,
) -> Any:
    """The statement of :func:`task_page`. Each filter walks its own index in (created_at, id)
    order (migration 0006), so a page costs the same whatever the table's size. A search
    filters the rows that walk reads (no index: it stops when the page is full)."""
    stmt = _with_run()
    if statuses:
        stmt = stmt.where(_t.status.in_(statuses))
    if parent is not None:
        stmt = stmt.where(_t.parent_id == parent)
    if search:
        stmt = stmt.where(
            or_(
                _t.id.icontains(search, autoescape=True),
                _t.prompt.icontains(search, autoescape=True),
            )
        )
    if before is not None:
        created, task_id = before
        stmt = stmt.where(
            or_(_t.created_at < created, and_(_t.created_at == created, _t.id < task_id))
        )
    return stmt.order_by(_t.created_at.desc(), _t.id.desc()).limit(limit)


def task_created_at(conn: Connection, task_id: str) -> Any:
    """A task's creation time (a page's keyset), or None."""
    return conn.execute(select(_t.created_at).where(_t.id == task_id)).scalar_one_or_none()


def execution_id_of(conn: Connection, task_id: str) -> str | None:
    xid = conn.execute(select(_e.id).where(_e.task_id == task_id)).scalar_one_or_none()
    return None if xid is None else str(xid)


def transcript_rows(conn: Connection, execution_id: str) -> list[Any]:
    """The run's transcript items in their one chronology (I6)."""
    return list(
        conn.execute(
            select(_i.seq, _i.turn, _i.kind, _i.call_id, _i.payload)
            .where(_i.execution_id == execution_id)
            .order_by(_i.seq)
        ).all()
    )


def call_rows(conn: Connection, execution_id: str) -> list[Any]:
    """The run's tool-call records, in turn and call order, with their evidence."""
    return list(
        conn.execute(
            select(tool_calls).where(_c.execution_id == execution_id).order_by(_c.turn, _c.idx)
        ).all()
    )


def transition_rows(conn: Connection, execution_id: str) -> list[dict[str, Any]]:
    """Every transition of the run, in order (I21)."""
    rows = conn.execute(
        select(
            _tr.from_phase, _tr.to_phase, _tr.version, _tr.at, _tr.worker, _tr.duration_ms, _tr.note
        )
        .where(_tr.execution_id == execution_id)
        .order_by(_tr.id)
    ).all()
    return [dict(r._mapping) for r in rows]


def run_revision(conn: Connection, task_id: str, execution_id: str) -> tuple[Any, ...] | None:
    """What changes when anything shown of a run changes (None: no such task): the task's
    status and usage, the run's version, phase, mailbox and next transcript seq, its stored
    wake-up (a wait commits no new version: a retried model call's next attempt, I36, moves
    it), aggregates of its calls (dispatch, leases, holds, outcomes, late reports), its latest
    operator action and its children. Each part is an indexed lookup or an aggregate over one
    run's rows."""
    calls = (
        select(
            func.count(),
            func.count(_c.queued_at),
            func.count(_c.started_at),
            func.count(_c.settled_at),
            func.count(_c.hold),
            func.coalesce(func.sum(_c.attempts), 0),
            func.coalesce(func.sum(_c.late_reports), 0),
            func.max(_c.lease_until),
        )
        .where(_c.execution_id == execution_id)
        .subquery()
    )
    last_action = (
        select(func.max(operator_actions.c.id))
        .where(operator_actions.c.task_id == task_id)
        .scalar_subquery()
    )
    children = select(func.count()).where(_t.parent_id == task_id).scalar_subquery()
    row = conn.execute(
        select(
            _t.status,
            _t.input_tokens,
            _t.output_tokens,
            _t.reasoning_tokens,
            _t.finished_at,
            _e.version,
            _e.phase,
            _e.inbox,
            _e.next_seq,
            _e.lease_owner,
            _e.wake_at,
            last_action,
            children,
            calls,
        )
        .select_from(tasks.outerjoin(executions, _e.task_id == _t.id).join(calls, true()))
        .where(_t.id == task_id)
    ).first()
    return None if row is None else tuple(row)


def canceled_among(conn: Connection, task_ids: list[str]) -> list[str]:
    """Which of these tasks are canceled."""
    rows = conn.execute(
        select(_t.id).where(_t.id.in_(task_ids), _t.status == TaskStatus.CANCELED.value)
    )
    return [r.id for r in rows]


def task_trace(conn: Connection, task_id: str) -> Any:
    """What a worker's tracing needs of a task, once per task per process: its stored trace
    context and its times (the task's own span), or None."""
    return conn.execute(
        select(_t.trace, _t.created_at, _t.finished_at, _t.status, _t.model).where(_t.id == task_id)
    ).first()


def task_resumes(conn: Connection, task_id: str) -> Any:
    """How often a task was resumed, and when last (its evidence rows, I27)."""
    a = operator_actions.c
    return conn.execute(
        select(func.count().label("count"), func.max(a.at).label("last")).where(
            a.task_id == task_id, a.action == "resume"
        )
    ).one()


def model_call_states(conn: Connection, limit: int = 500) -> list[Any]:
    """Runs at call_model: task id and state, the most recently moved first, at most
    ``limit`` (``charlie doctor`` reads which of them retry a failed model call, I36)."""
    stmt = (
        select(_e.task_id, _e.state)
        .where(_e.phase == "call_model")
        .order_by(_e.updated_at.desc())
        .limit(limit)
    )
    return list(conn.execute(stmt).all())
