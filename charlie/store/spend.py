"""Statements on delegation trees: a task's ancestry, its children, and what a tree has spent.

A delegated child's spend counts against its parent's budget, and its parent's parent's. The
spend is not copied up the tree: each task's usage is written once, by the commit of the model
call that spent it (a compare-and-set, I1, I2), and a budget that covers a subtree sums the
subtree's rows when it is checked. A retried or recovered commit cannot count twice what it
never wrote twice.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, func, literal, select

from charlie.domain import TaskSpend
from charlie.store.schema import executions, tasks

_t, _e = tasks.c, executions.c

#: how far a tree walk goes at most, whatever CHARLIE_DELEGATE_MAX_DEPTH says: parent ids never
#: form a cycle (a task's parent exists before it), this only bounds a walk of a damaged table.
MAX_WALK = 64


def _ancestry_statement() -> Any:
    up = (
        select(_t.id, _t.parent_id, literal(0).label("depth"))
        .where(_t.id == bindparam("b_task"))
        .cte("up", recursive=True)
    )
    parent = tasks.alias("parent")
    up = up.union_all(
        select(parent.c.id, parent.c.parent_id, up.c.depth + 1).where(
            parent.c.id == up.c.parent_id, up.c.depth < MAX_WALK
        )
    )
    return (
        select(up.c.id, up.c.parent_id, up.c.depth, _t.budget, _t.approve)
        .join(tasks, _t.id == up.c.id)
        .order_by(up.c.depth)
    )


def _subtree_statement() -> Any:
    down = (
        select(_t.id, literal(0).label("depth"))
        .where(_t.id == bindparam("b_root"))
        .cte("down", recursive=True)
    )
    child = tasks.alias("child")
    down = down.union_all(
        select(child.c.id, down.c.depth + 1).where(
            child.c.parent_id == down.c.id, down.c.depth < MAX_WALK
        )
    )
    return select(
        _t.id,
        _t.parent_id,
        _t.model,
        _t.budget,
        _t.input_tokens,
        _t.output_tokens,
        _t.reasoning_tokens,
        _t.cache_read_tokens,
        _t.cache_write_tokens,
        _e.model_calls,
    ).select_from(down.join(tasks, _t.id == down.c.id).outerjoin(executions, _e.task_id == _t.id))


_ANCESTRY = _ancestry_statement()
_SUBTREE = _subtree_statement()
_CHILDREN = select(func.count()).select_from(tasks).where(_t.parent_id == bindparam("b_task"))
_LOCK_PARENT = select(_t.id).where(_t.id == bindparam("b_task")).with_for_update(key_share=True)


def ancestry(conn: Connection, task_id: str) -> list[Any]:
    """The task and its ancestors, nearest first: (id, parent_id, depth, budget, approve)."""
    return list(conn.execute(_ANCESTRY, {"b_task": task_id}).all())


def subtree_spend(conn: Connection, root: str) -> list[TaskSpend]:
    """``root`` and every task under it, each with its budget and durable usage."""
    return [
        TaskSpend(
            task_id=r.id,
            parent_id=r.parent_id,
            model=r.model,
            budget=r.budget or None,
            usage={
                "input_tokens": r.input_tokens or 0,
                "output_tokens": r.output_tokens or 0,
                "reasoning_tokens": r.reasoning_tokens or 0,
                "cache_read_tokens": r.cache_read_tokens or 0,
                "cache_write_tokens": r.cache_write_tokens or 0,
                "model_calls": r.model_calls or 0,
            },
        )
        for r in conn.execute(_SUBTREE, {"b_root": root})
    ]


def delegation_spend(conn: Connection, task_id: str) -> tuple[TaskSpend, ...]:
    """What the boundary of a budgeted task in a delegation tree checks: the spend of the
    subtree under its farthest ancestor with a budget (itself when none has one). Every budget
    on its way up covers a subtree of that one."""
    chain = ancestry(conn, task_id)
    budgeted = [r.id for r in chain if r.budget]
    top = budgeted[-1] if budgeted else task_id
    return tuple(subtree_spend(conn, top))


def lock_for_child(conn: Connection, parent_id: str) -> None:
    """Lock a parent's row against another child's submit until this transaction ends, so that
    children are counted one submit at a time (PostgreSQL: FOR NO KEY UPDATE, which a cancel's
    lock of the tree also takes; SQLite serializes writers in BEGIN IMMEDIATE)."""
    conn.execute(_LOCK_PARENT, {"b_task": parent_id}).all()


def children_count(conn: Connection, parent_id: str) -> int:
    return int(conn.execute(_CHILDREN, {"b_task": parent_id}).scalar() or 0)
