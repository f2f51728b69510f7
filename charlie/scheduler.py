"""The scheduler: owns the task lifecycle (I18) and is the only writer of terminal statuses.

queued → running ⇄ waiting → succeeded | failed | canceled | timed_out. Every terminal write is a
compare-and-set from an active status, so writing it twice, late or concurrently is benign.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from charlie import faults
from charlie.domain import JSON, Action, Origin, TaskStatus, execution_id_for, utcnow
from charlie.observe import new_trace
from charlie.ports import TransientSchedulerError
from charlie.store import spend
from charlie.store import tasks as task_store
from charlie.store.calls import hold_live_task
from charlie.store.engine import read, write
from charlie.store.people import record_action
from charlie.store.types import Connection, ConstraintViolation, DatabaseUnavailable, Engine


class TaskNotFound(LookupError):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"no task with id {task_id!r}")
        self.task_id = task_id


class TaskConflict(ValueError):
    """A task id reused for different work: idempotency covers the same submission only."""


class ParentStopped(RuntimeError):
    """A child task submitted for a parent that was canceled, timed out or finished (I18)."""

    def __init__(self, parent_id: str, task_id: str) -> None:
        super().__init__(
            f"task {task_id!r} not started: its parent {parent_id!r} is no longer active"
        )
        self.parent_id = parent_id
        self.task_id = task_id


class DelegationRefused(ValueError):
    """A child its parent may not start: past a delegation limit, or its parent's budget spent.
    Nothing was written; the message names the limit and the setting that sets it."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


@dataclass(frozen=True)
class ChildRules:
    """What bounds a delegated child, applied in its submit's transaction while it holds its
    parent's row, so that siblings submitted at once are counted one at a time."""

    #: CHARLIE_DELEGATE_MAX_DEPTH: a submitted task is at depth 0; no child deeper than this
    max_depth: int
    #: CHARLIE_DELEGATE_MAX_CHILDREN: children one task may start in all
    max_children: int
    #: the child's budget, from its parent's tree as this transaction reads it (raises
    #: DelegationRefused when nothing is left of it)
    budget: Callable[[Connection], JSON | None]


@dataclass(frozen=True)
class Submitted:
    task_id: str
    execution_id: str
    created: bool


def submit(
    engine: Engine,
    *,
    prompt: str,
    model: str,
    tools: list[str] | None,
    task_id: str | None,
    timeout: float | None,
    metadata: JSON | None,
    parent_id: str | None = None,
    parent_call_id: str | None = None,
    approve: list[str] | None = None,
    trace: JSON | None = None,
    budget: JSON | None = None,
    rules: ChildRules | None = None,
    priority: int = 0,
) -> Submitted:
    """Write the task and its execution in one transaction; idempotent on ``task_id``,
    whatever has happened to its parent since the first submit.

    A child (``parent_id``) waits for whatever its parent's calls wait for (its parent's
    ``approve`` list, which holds its ancestors', joins its own, I23); with ``rules`` it is
    refused past the delegation limits, and its budget is what its parent's tree has left."""
    task_id = task_id or uuid.uuid4().hex
    now = utcnow()
    execution_id = execution_id_for(task_id)
    try:
        with write(engine) as conn:
            if parent_id is not None:
                if rules is not None:
                    # Siblings submitted at once are counted one at a time.
                    spend.lock_for_child(conn, parent_id)
                # A child holds its parent's row: a cancel of the parent then either waits for
                # this commit and finds the child, or this waits for the cancel and refuses
                # (I18).
                if not hold_live_task(conn, parent_id, utcnow()):
                    existing = _already_submitted(conn, task_id, prompt, model)
                    if existing is not None:
                        return existing  # made before the stop, which stopped it too (I19)
                    raise ParentStopped(parent_id, task_id)
                # A delegate repeated after a crash finds its child whatever the limits say
                # now: it is the child they were checked for (I19).
                existing = _already_submitted(conn, task_id, prompt, model)
                if existing is not None:
                    return existing
                chain = spend.ancestry(conn, parent_id)
                inherited = chain[0].approve if chain else None
                if inherited:
                    approve = sorted(set(approve or ()) | set(inherited))
                if rules is not None:
                    _check_limits(conn, rules, parent_id, depth=len(chain))
                    budget = rules.budget(conn)
            task_store.insert_task_and_run(
                conn,
                task_id=task_id,
                execution_id=execution_id,
                prompt=prompt,
                model=model,
                tools=tools,
                timeout=timeout,
                metadata=metadata,
                parent_id=parent_id,
                parent_call_id=parent_call_id,
                now=now,
                approve=approve,
                # the producer's span (a delegate's: its parent task's) parents the task's
                trace=trace or new_trace(),
                budget=budget,
                priority=priority,
            )
    except ConstraintViolation:
        with read(engine) as conn:
            existing = _already_submitted(conn, task_id, prompt, model)
        if existing is None:
            raise
        return existing
    return Submitted(task_id, execution_id, created=True)


def _check_limits(conn: Connection, rules: ChildRules, parent_id: str, *, depth: int) -> None:
    """Refuse a child ``depth`` levels below a submitted task, or one more than its parent may
    start (DelegationRefused, naming the limit and its setting)."""
    if depth > rules.max_depth:
        raise DelegationRefused(
            f"cannot delegate: delegation may nest at most {rules.max_depth} level(s) below a "
            f"submitted task (CHARLIE_DELEGATE_MAX_DEPTH={rules.max_depth}) and this task is "
            f"{depth - 1} level(s) down; do this work in this task instead",
            limit="CHARLIE_DELEGATE_MAX_DEPTH",
            max_depth=rules.max_depth,
            depth=depth - 1,
        )
    started = spend.children_count(conn, parent_id)
    if started >= rules.max_children:
        raise DelegationRefused(
            f"cannot delegate: a task may start at most {rules.max_children} child task(s) "
            f"(CHARLIE_DELEGATE_MAX_CHILDREN={rules.max_children}) and this task has started "
            f"{started}; wait for those and do the rest in this task",
            limit="CHARLIE_DELEGATE_MAX_CHILDREN",
            max_children=rules.max_children,
            children=started,
        )


def _already_submitted(conn: Connection, task_id: str, prompt: str, model: str) -> Submitted | None:
    """The task of an earlier submit of this same work; TaskConflict if the id names other
    work."""
    row = task_store.submitted_work(conn, task_id)
    if row is None:
        return None
    if row.prompt != prompt or row.model != model:
        raise TaskConflict(
            f"task id {task_id!r} already names a task with a different prompt or model"
        )
    return Submitted(task_id, execution_id_for(task_id), created=False)


def finish(
    engine: Engine, task_id: str, status: TaskStatus, *, result: Any = None, error: Any = None
) -> bool:
    """Record a terminal status; False when the task was already terminal or is gone (I16)."""
    assert status.terminal
    faults.hit("scheduler.finish", task_id=task_id, status=status.value)
    now = utcnow()
    try:
        with write(engine) as conn:
            return task_store.finish_task(conn, task_id, status, result, error, now)
    except DatabaseUnavailable as exc:
        raise TransientSchedulerError(f"scheduler write for task {task_id} failed: {exc}") from exc


class DbScheduler:
    """The scheduler port the report phases use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def finish(
        self, task_id: str, status: TaskStatus, *, result: Any = None, error: Any = None
    ) -> bool:
        try:
            accepted = finish(self.engine, task_id, status, result=result, error=error)
        except faults.InjectedFault as exc:
            raise TransientSchedulerError(str(exc)) from exc
        if status in (TaskStatus.CANCELED, TaskStatus.TIMED_OUT):
            # A stopped task's children stop too (I18); the sweep stops their runs.
            cancel_descendants(self.engine, task_id)
        return accepted


def descendants(engine: Engine, task_id: str) -> list[str]:
    found, frontier = [], [task_id]
    with read(engine) as conn:
        while frontier:
            frontier = task_store.children_of(conn, frontier)
            found.extend(frontier)
    return found


def cancel(
    engine: Engine,
    task_id: str,
    *,
    actor: str | None = None,
    note: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> list[str]:
    """Cancel a task and its children; returns the ids whose status changed. The executor stops
    each at its next tick boundary (I18). With an ``actor``, a cancel that stopped anything is
    recorded as that operator's action, in the same transaction (I27)."""
    with write(engine) as conn:
        tree = _lock_tree(conn, task_id)
        if not tree:
            raise TaskNotFound(task_id)
        now = utcnow()
        changed = task_store.mark_canceled(conn, tree, now)
        if actor is not None and changed:
            record_action(
                conn,
                task_id=task_id,
                action=Action.CANCEL,
                actor=actor,
                now=now,
                note=note,
                detail={"canceled": changed},
                request_id=request_id,
                origin=origin,
            )
        return changed


def cancel_descendants(engine: Engine, task_id: str) -> list[str]:
    """Cancel a finished task's children (a parent that timed out no longer waits for them)."""
    with write(engine) as conn:
        tree = _lock_tree(conn, task_id)
        return task_store.mark_canceled(conn, tree[1:], utcnow()) if len(tree) > 1 else []


def _lock_tree(conn: Connection, root: str) -> list[str]:
    """Lock a task and its descendants, parents before children, and return their ids (the
    root first; [] when it does not exist).

    The time a stop records is taken after this: after any transaction holding one of these
    tasks (a call's claim, a child's submit; see store.calls.hold_live_task) has committed, so
    a call's start and the cancel that follows keep their order, and a child submitted while
    its parent was being canceled is found here or refused there (I18). Locking each level
    before reading the next is what catches the child: its submit holds the parent's row."""
    found: list[str] = []
    level = [root]
    while level:
        found += task_store.lock_tasks(conn, level)
        level = task_store.children_of(conn, level)
    return found


def expire(engine: Engine, task_ids: list[str]) -> list[str]:
    """Time out tasks whose timeout has passed (the sweep passes candidates). One transaction
    per task: a lock on one row at a time cannot deadlock with a cancel locking a tree."""
    expired: list[str] = []
    for task_id in task_ids:
        with write(engine) as conn:
            task_store.lock_task(conn, task_id)
            now = utcnow()  # after the lock, as in cancel (see _lock_tree)
            done = task_store.time_out(conn, task_id, now)
        if done:
            expired.append(task_id)
    return expired
