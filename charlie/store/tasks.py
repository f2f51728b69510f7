"""The scheduler's statements on the ``tasks`` table (and the run a submit creates with it).

The lifecycle rules (what may move to what, in which transaction, in which lock order) are the
scheduler's (charlie/scheduler.py); these are the statements it runs. Every terminal write is a
compare-and-set from an active status (I16, I18).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, insert, select, update

from charlie.domain import JSON, Phase, TaskStatus
from charlie.store.runs import ACTIVE
from charlie.store.schema import executions, tasks

_t = tasks.c


def insert_task_and_run(
    conn: Connection,
    *,
    task_id: str,
    execution_id: str,
    prompt: str,
    model: str,
    tools: list[str] | None,
    timeout: float | None,
    metadata: JSON | None,
    parent_id: str | None,
    parent_call_id: str | None,
    now: datetime,
    approve: list[str] | None = None,
    phase: Phase = Phase.LOAD_CONTEXT,
    budget: JSON | None = None,
    turn: int = 0,
    next_seq: int = 0,
    state: JSON | None = None,
    trace: JSON | None = None,
    priority: int = 0,
) -> None:
    """A queued task and its run at ``phase`` (load_context; a fork's: call_model), version 0
    (raises IntegrityError when the id is taken)."""
    conn.execute(
        insert(tasks).values(
            id=task_id,
            parent_id=parent_id,
            parent_call_id=parent_call_id,
            prompt=prompt,
            model=model,
            tools=tools,
            approve=approve,
            budget=budget,
            metadata=metadata or {},
            status=TaskStatus.QUEUED.value,
            timeout_at=now + timedelta(seconds=timeout) if timeout else None,
            created_at=now,
            input_tokens=0,
            output_tokens=0,
            reasoning_tokens=0,
            cache_read_tokens=0,
            cache_write_tokens=0,
            trace=trace,
            priority=priority,
        )
    )
    conn.execute(
        insert(executions).values(
            id=execution_id,
            task_id=task_id,
            phase=phase.value,
            version=0,
            state=state or {},
            turn=turn,
            next_seq=next_seq,
            updated_at=now,
            attempts=0,
            model_calls=0,
            model_repeats=0,
            inbox=0,
            created_at=now,
        )
    )


def submitted_work(conn: Connection, task_id: str) -> Any:
    """The (prompt, model) a task id was submitted with, or None."""
    return conn.execute(select(_t.prompt, _t.model).where(_t.id == task_id)).first()


def finish_task(
    conn: Connection, task_id: str, status: TaskStatus, result: Any, error: Any, now: datetime
) -> bool:
    """Record a terminal status if the task is still active."""
    done = conn.execute(
        update(tasks)
        .where(_t.id == task_id, _t.status.in_(ACTIVE))
        .values(status=status.value, result=result, error=error, finished_at=now)
    )
    return bool(done.rowcount == 1)


def children_of(conn: Connection, parent_ids: list[str]) -> list[str]:
    """The ids of these tasks' children (one level)."""
    return list(conn.execute(select(_t.id).where(_t.parent_id.in_(parent_ids))).scalars())


def lock_tasks(conn: Connection, task_ids: list[str]) -> list[str]:
    """Lock these tasks (in id order, so two lockers cannot deadlock) and return those that
    exist. Shared with key_share: it orders against a claim or a child's submit holding one."""
    rows = conn.execute(
        select(_t.id).where(_t.id.in_(task_ids)).order_by(_t.id).with_for_update(key_share=True)
    ).all()
    return [r.id for r in rows]


def mark_canceled(conn: Connection, task_ids: list[str], now: datetime) -> list[str]:
    """Cancel those of these tasks still active; returns their ids."""
    rows = conn.execute(
        update(tasks)
        .where(_t.id.in_(task_ids), _t.status.in_(ACTIVE))
        .values(
            status=TaskStatus.CANCELED.value,
            cancel_requested_at=now,
            finished_at=now,
            error={"reason": "canceled"},
        )
        .returning(_t.id)
    )
    return [r.id for r in rows]


def lock_task(conn: Connection, task_id: str) -> None:
    conn.execute(select(_t.id).where(_t.id == task_id).with_for_update(key_share=True)).all()


def time_out(conn: Connection, task_id: str, now: datetime) -> bool:
    """Time the task out if it is still active and past its timeout."""
    done = conn.execute(
        update(tasks)
        .where(_t.id == task_id, _t.status.in_(ACTIVE), _t.timeout_at < now)
        .values(status=TaskStatus.TIMED_OUT.value, finished_at=now, error={"reason": "timed out"})
    ).rowcount
    return bool(done)
