"""The reads the Python API (and the Children port) make: one named statement per question.

Nothing here writes or locks. Each function takes an open connection, so a caller decides the
transaction and the try-again on a lost connection.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Row, select

from charlie.domain import TaskStatus
from charlie.store.schema import executions, tasks, tool_calls, transcript_items, transitions

_t, _e, _i, _c, _tr = tasks.c, executions.c, transcript_items.c, tool_calls.c, transitions.c


def task_with_run(conn: Connection, task_id: str) -> Row[Any] | None:
    """The task row and its run's phase, turn and model-call counters (None: no such task)."""
    return conn.execute(
        select(
            tasks,
            _e.phase.label("x_phase"),
            _e.turn.label("x_turn"),
            _e.model_calls.label("x_model_calls"),
            _e.model_repeats.label("x_model_repeats"),
        )
        .select_from(tasks.outerjoin(executions, _e.task_id == _t.id))
        .where(_t.id == task_id)
    ).first()


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


def canceled_among(conn: Connection, task_ids: list[str]) -> list[str]:
    """Which of these tasks are canceled."""
    rows = conn.execute(
        select(_t.id).where(_t.id.in_(task_ids), _t.status == TaskStatus.CANCELED.value)
    )
    return [r.id for r in rows]
