"""Core statements for the pending-tool records: mark started (I9), settle (I12), late reports."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    bindparam,
    case,
    exists,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError

from charlie.domain import (
    ENDING_PHASES,
    CallState,
    Outcome,
    Phase,
    TaskStatus,
    task_id_of,
    utcnow,
)
from charlie.store.engine import sqlstate, write, write_one
from charlie.store.schema import executions, operator_actions, tasks, tool_calls

ENDING_PHASE_VALUES = tuple(p.value for p in ENDING_PHASES)
log = logging.getLogger(__name__)

ACTIVE_STATUSES = (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value, TaskStatus.WAITING.value)

#: ``observe``: look again at the outside work of a wait that settled past its deadline (I13);
#: not a claim, since the call already has its outcome.
#: ``cancel``: ask the outside work of a call settled ``canceled`` to stop (a tool's cancel
#: hook); not a claim either.
Mode = Literal["start", "resume", "reconcile", "observe", "cancel"]

#: A worker's tools as (name, implementation) pairs, sorted (ToolRegistry.implementations()).
Implementations = tuple[tuple[str, str], ...]


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
    #: the task's metadata, read in the same statement (tools see it through their context).
    task_metadata: dict[str, Any] | None = None
    #: the implementation the call was started with (None: a call from before migration 0005).
    implementation: str | None = None
    #: "hold": interrupted, it waits for an operator's verdict instead of being reported.
    on_interrupt: str | None = None
    #: what a person was asked, and answered, when the call parked with a question (the
    #: answer is handed to the resumed handler as ctx.answer).
    hold_info: dict[str, Any] | None = None


_c, _e, _t = tool_calls.c, executions.c, tasks.c
#: One call, by (execution, turn, call id) as bind parameters; see key_params.
CALL_KEY = and_(
    _c.execution_id == bindparam("b_execution"),
    _c.turn == bindparam("b_turn"),
    _c.call_id == bindparam("b_call"),
)


def key_params(execution_id: str, turn: int, call_id: str) -> dict[str, Any]:
    return {"b_execution": execution_id, "b_turn": turn, "b_call": call_id}


def _own_key(call: ClaimedCall) -> dict[str, Any]:
    return key_params(call.execution_id, call.turn, call.call_id)


def _call_columns() -> tuple[Any, ...]:
    """What a handler sees of its call (a ClaimedCall's fields), and the task's metadata."""
    metadata = select(_t.metadata).where(_t.id == bindparam("b_task")).scalar_subquery()
    return (
        _c.name,
        _c.arguments,
        _c.resumable,
        _c.started_at,
        _c.started_by,
        _c.handle,
        _c.attempts,
        _c.deadline_at,
        metadata.label("task_metadata"),
        _c.implementation,
        _c.on_interrupt,
        _c.hold_info,
    )


def _as_call(execution_id: str, turn: int, call_id: str, row: Any) -> ClaimedCall:
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
        row.task_metadata,
        row.implementation,
        row.on_interrupt,
        row.hold_info,
    )


def _implementation_of_name(implementations: Implementations) -> Any:
    """SQL for "this worker's implementation of the call's tool" (NULL: it has none)."""
    if not implementations:
        return null()
    return case(dict(implementations), value=_c.name, else_=null())


#: Several calls of one turn, by (execution, turn) and a list of call ids (b_calls).
CALLS_KEY = and_(
    _c.execution_id == bindparam("b_execution"),
    _c.turn == bindparam("b_turn"),
    _c.call_id.in_(bindparam("b_calls", expanding=True)),
)


@functools.cache
def _claim_statement(mode: Mode, implementations: Implementations = (), many: bool = False) -> Any:
    """The claim of one call, built once per mode and tool set. ``start`` records which
    implementation this worker starts the call with, in the statement that marks it started;
    ``resume``/``reconcile`` take over only a call started with an implementation this worker
    has (or one from before implementations were recorded): never another tool of the same name
    in its place."""
    now = bindparam("b_now", type_=_c.lease_until.type)
    mine = _implementation_of_name(implementations)
    # Work starts only for a live run of an active task: never after a cancel, a timeout or a
    # failure (I18), whatever messages are still in flight.
    live = exists().where(
        _e.id == _c.execution_id,
        _e.phase.not_in(ENDING_PHASE_VALUES),
        exists().where(
            _t.id == _e.task_id,
            _t.status.in_(ACTIVE_STATUSES),
            or_(_t.timeout_at.is_(None), _t.timeout_at > now),
        ),
    )
    # A call held for a person is started by no one until a verdict releases it (I23).
    stmt = update(tool_calls).where(CALLS_KEY if many else CALL_KEY, live, _c.hold.is_(None))
    if mode == "start":
        # A call already past its deadline is not started: it will settle deadline_exceeded
        # as never started (I13), rather than run, late, and leave an uncertain outcome.
        stmt = stmt.where(
            _c.state == CallState.PENDING.value,
            _c.queued_at.is_not(None),
            or_(_c.deadline_at.is_(None), _c.deadline_at > now),
        ).values(
            state=CallState.STARTED.value,
            started_at=now,
            started_by=bindparam("b_owner"),
            implementation=mine,
        )
    elif mode == "resume":
        # A parked wait (no owner) may be observed at any time; a held one only once its
        # holder's lease has lapsed.
        stmt = stmt.where(
            _c.state == CallState.STARTED.value,
            _c.resumable.is_(True),
            or_(_c.lease_owner.is_(None), _c.lease_until < now),
        )
    else:
        stmt = stmt.where(_c.state == CallState.STARTED.value, _c.lease_until < now)
    if mode != "start":
        stmt = stmt.where(or_(_c.implementation.is_(None), _c.implementation == mine))
    return stmt.values(
        lease_owner=bindparam("b_owner"),
        lease_until=bindparam("b_until", type_=_c.lease_until.type),
        attempts=_c.attempts + 1,
    ).returning(*_call_columns(), *((_c.call_id,) if many else ()))


@functools.cache
def _claim_holding_task(
    mode: Mode, implementations: Implementations = (), many: bool = False
) -> Any:
    """PostgreSQL: the claim and the task's share lock (hold_live_task) in one statement, in
    the same order: the call's row is updated (locked) first, then, for the row claimed, the
    task's row is share-locked and read as it is now (a locking read sees the latest commit,
    not the statement's snapshot). One round trip fewer per call start."""
    claimed = _claim_statement(mode, implementations, many).cte("claimed")
    held = (
        select(_t.status.label("task_status"), _t.timeout_at.label("task_timeout_at"))
        # (correlated with the claimed row, so it runs for that row, after the update)
        .where(_t.id == bindparam("b_task"), claimed.c.attempts > 0)
        .with_for_update(read=True)
        .lateral("held")
    )
    return select(claimed, held).select_from(claimed.outerjoin(held, true()))


#: charlie_expect's SQLSTATE (migration 0009): the task stopped while its call was claimed
TASK_STOPPED = "CH001"


@functools.cache
def _claim_alone_statement(
    mode: Mode, implementations: Implementations = (), many: bool = False
) -> Any:
    """PostgreSQL: _claim_holding_task as a statement of its own, run in autocommit (one round
    trip, no BEGIN or COMMIT): a task found stopped once its row is held raises (charlie_expect),
    which rolls the claim back as TaskStopped would (I18)."""
    holding = _claim_holding_task(mode, implementations, many)
    held = holding.selected_columns
    now = bindparam("b_now", type_=_t.timeout_at.type)
    live = and_(
        held.task_status.in_(ACTIVE_STATUSES),
        or_(held.task_timeout_at.is_(None), held.task_timeout_at > now),
    )
    stopped: Any = bindparam("b_stopped", "its task stopped while the call was being claimed")
    return holding.add_columns(func.charlie_expect(live, stopped).label("live"))


def _task_live(status: str | None, timeout_at: datetime | None, now: datetime) -> bool:
    if status is None or status not in ACTIVE_STATUSES:
        return False
    return timeout_at is None or timeout_at > now


class TaskStopped(Exception):
    """The task stopped (a cancel, a timeout) while a call of it was being claimed: the caller
    rolls the claim back."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id} stopped while one of its calls was being claimed")
        self.task_id = task_id


_HOLD_TASK = (
    select(_t.status, _t.timeout_at).where(_t.id == bindparam("b_task")).with_for_update(read=True)
)


def hold_live_task(conn: Connection, task_id: str, now: datetime) -> bool:
    """Share-lock the task's row to the end of the transaction; True while it is active and
    not past its timeout.

    A liveness test in a statement reads a snapshot, which a cancel committing meanwhile does
    not change. Held, the lock orders the two: a cancel or a timeout locks the row to write it
    and takes its time after that, so it either waits for this transaction (and is later than
    what this one records) or this one waits for it and sees the task stopped (I18). Callers:
    a call's claim, the dispatch's local call, a child's submit. SQLite serializes writers in
    BEGIN IMMEDIATE, so there this is a plain read."""
    row = conn.execute(_HOLD_TASK, {"b_task": task_id}).first()
    return row is not None and _task_live(row.status, row.timeout_at, now)


def claim_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    mode: Mode,
    owner: str,
    now: datetime,
    lease_seconds: float,
    *,
    task_held: bool = False,
    implementations: Implementations = (),
) -> ClaimedCall | None:
    """``start``: pending → started, committed before the handler runs (I9).
    ``resume``/``reconcile``: take over a started call whose lease lapsed (I10).
    ``None``: not claimable (already started, settled, someone live holds it, or it was
    started with an implementation not among ``implementations``, see refuse_claim).

    In a transaction: raises TaskStopped, for the caller to roll back, when the task stopped
    while the call was being claimed, unless the caller already holds the task (``task_held``,
    see hold_live_task). Locks go call, then task: the order of a tick, which locks its turn's
    calls before it writes the task, so the two cannot deadlock."""
    # The claim and the task's lock must commit together (rolled back on TaskStopped).
    assert conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT"
    serialized = conn.dialect.name == "sqlite"
    holding = not (task_held or serialized)
    row = conn.execute(
        _claim_holding_task(mode, implementations)
        if holding
        else _claim_statement(mode, implementations),
        {
            **key_params(execution_id, turn, call_id),
            "b_task": task_id_of(execution_id),
            "b_now": now,
            "b_owner": owner,
            "b_until": now + timedelta(seconds=lease_seconds),
        },
    ).first()
    if row is None:
        return None
    if holding and not _task_live(row.task_status, row.task_timeout_at, now):
        raise TaskStopped(task_id_of(execution_id))
    return _as_call(execution_id, turn, call_id, row)


def claim_call_alone(
    engine: Engine,
    execution_id: str,
    turn: int,
    call_id: str,
    mode: Mode,
    owner: str,
    lease_seconds: float,
    *,
    implementations: Implementations = (),
    fused: bool = True,
) -> ClaimedCall | None:
    """claim_call in a transaction of its own, committed before the handler runs (I9); None
    also when the task stopped during the claim (I18). ``fused``: on PostgreSQL, as one
    autocommit statement (CHARLIE_FUSE_COMMITS)."""
    if fused and engine.dialect.name == "postgresql":
        return _claim_alone_autocommit(
            engine, execution_id, turn, call_id, mode, owner, lease_seconds, implementations
        )
    try:
        with write(engine) as conn:
            now = utcnow()  # after BEGIN (SQLite's write lock), so the lease is not born expired
            return claim_call(
                conn,
                execution_id,
                turn,
                call_id,
                mode,
                owner,
                now,
                lease_seconds,
                implementations=implementations,
            )
    except TaskStopped as stopped:
        log.info(
            "call not started: its task stopped while it was being claimed",
            extra={"task_id": stopped.task_id, "execution_id": execution_id, "call_id": call_id},
        )
        return None


def _claim_alone_autocommit(
    engine: Engine,
    execution_id: str,
    turn: int,
    call_id: str,
    mode: Mode,
    owner: str,
    lease_seconds: float,
    implementations: Implementations,
) -> ClaimedCall | None:
    now = utcnow()
    params = {
        **key_params(execution_id, turn, call_id),
        "b_task": task_id_of(execution_id),
        "b_now": now,
        "b_owner": owner,
        "b_until": now + timedelta(seconds=lease_seconds),
    }
    statement = _claim_alone_statement(mode, implementations)
    rows = _claimed_in_autocommit(engine, statement, params, execution_id, (call_id,))
    return _as_call(execution_id, turn, call_id, rows[0]) if rows else None


def _claimed_in_autocommit(
    engine: Engine,
    statement: Any,
    params: dict[str, Any],
    execution_id: str,
    call_ids: tuple[str, ...],
) -> list[Any]:
    """The rows a claim statement of _claim_alone_statement's claimed; none when its task
    stopped while they were being claimed (charlie_expect raised: nothing was written, I18)."""
    try:
        with write_one(engine) as conn:
            return list(conn.execute(statement, params).all())
    except DBAPIError as exc:
        if sqlstate(exc) != TASK_STOPPED:
            raise
        log.info(
            "call not started: its task stopped while it was being claimed",
            extra={
                "task_id": task_id_of(execution_id),
                "execution_id": execution_id,
                "call_id": ",".join(call_ids),
            },
        )
        return []


def claim_calls_alone(
    engine: Engine,
    execution_id: str,
    turn: int,
    call_ids: tuple[str, ...],
    owner: str,
    lease_seconds: float,
    *,
    implementations: Implementations = (),
    fused: bool = True,
) -> tuple[ClaimedCall, ...]:
    """Start several calls of one turn (mode ``start``) in one transaction of its own,
    committed before their handlers run (I9), each under the same rules as claim_call_alone;
    the ones not startable are left out, and a task that stopped meanwhile starts none (I18).
    On PostgreSQL one autocommit statement for them all."""
    if len(call_ids) == 1:
        one = claim_call_alone(
            engine, execution_id, turn, call_ids[0], "start", owner, lease_seconds,
            implementations=implementations, fused=fused,
        )  # fmt: skip
        return () if one is None else (one,)
    now = utcnow()
    params = {
        "b_execution": execution_id,
        "b_turn": turn,
        "b_calls": list(call_ids),
        "b_task": task_id_of(execution_id),
        "b_now": now,
        "b_owner": owner,
        "b_until": now + timedelta(seconds=lease_seconds),
    }
    if engine.dialect.name != "postgresql":
        # SQLite serializes writers in BEGIN IMMEDIATE: the claims and the liveness check agree
        with write(engine) as conn:
            rows = conn.execute(_claim_statement("start", implementations, many=True), params).all()
    elif not fused:
        try:
            with write(engine) as conn:
                rows = conn.execute(
                    _claim_holding_task("start", implementations, many=True), params
                ).all()
                if any(not _task_live(r.task_status, r.task_timeout_at, now) for r in rows):
                    raise TaskStopped(task_id_of(execution_id))
        except TaskStopped:
            return ()
    else:
        statement = _claim_alone_statement("start", implementations, many=True)
        rows = _claimed_in_autocommit(engine, statement, params, execution_id, call_ids)
    by_id = {row.call_id: _as_call(execution_id, turn, row.call_id, row) for row in rows}
    return tuple(by_id[c] for c in call_ids if c in by_id)


def start_local_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    owner: str,
    lease_seconds: float,
    *,
    implementations: Implementations = (),
) -> ClaimedCall | None:
    """Mark the turn's only call started in the dispatch's own transaction (I9), which holds
    the turn's calls already: the task is held before the claim (not after, as claim_call
    does), so a task stopped since the dispatch's claim means no start rather than a rollback
    of the whole dispatch (I18)."""
    now = utcnow()
    if conn.dialect.name != "sqlite" and not hold_live_task(conn, task_id_of(execution_id), now):
        return None
    return claim_call(
        conn,
        execution_id,
        turn,
        call_id,
        "start",
        owner,
        now,
        lease_seconds,
        task_held=True,
        implementations=implementations,
    )


@dataclass(frozen=True)
class Refusal:
    """A take-over this worker refused: the call was started with an implementation it lacks."""

    name: str
    implementation: str
    attempts: int
    started_at: datetime | None
    started_by: str | None
    handle: str | None
    on_interrupt: str | None = None


@functools.cache
def _refuse_statement(implementations: Implementations) -> Any:
    mine = _implementation_of_name(implementations)
    return (
        update(tool_calls)
        .where(
            CALL_KEY,
            _c.state == CallState.STARTED.value,
            _c.lease_until < bindparam("b_now", type_=_c.lease_until.type),
            _c.implementation.is_not(None),
            or_(mine.is_(None), _c.implementation != mine),
        )
        .values(attempts=_c.attempts + 1)
        .returning(
            _c.name,
            _c.implementation,
            _c.attempts,
            _c.started_at,
            _c.started_by,
            _c.handle,
            _c.on_interrupt,
        )
    )


def refuse_claim(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    implementations: Implementations,
    now: datetime,
) -> Refusal | None:
    """Count a take-over refused because the call's lapsed lease was taken under an
    implementation this worker lacks (it has another tool of that name, or none).
    Each refusal is an attempt, so a call that no worker taking it over can run reaches the
    attempt limit and is settled interrupted by its refuser. Only on the path
    of a resume or reconcile that claimed nothing, never on the hot path."""
    row = conn.execute(
        _refuse_statement(implementations),
        {**key_params(execution_id, turn, call_id), "b_now": now},
    ).first()
    if row is None:
        return None
    return Refusal(
        row.name,
        row.implementation,
        row.attempts,
        row.started_at,
        row.started_by,
        row.handle,
        row.on_interrupt,
    )


#: The lease a call was taken under: its owner and the attempt count its claim left (every
#: claim, start or take-over, increments it; a refused take-over too, since it comes only after
#: the lease lapsed). A holder whose lease another worker took over, or whose call was settled,
#: matches neither, so none of its writes land.
HELD_BY = and_(
    _c.state == CallState.STARTED.value,
    _c.lease_owner == bindparam("b_owner"),
    _c.attempts == bindparam("b_token"),
)


def _held(call: ClaimedCall, owner: str) -> dict[str, Any]:
    return {**_own_key(call), "b_owner": owner, "b_token": call.attempts}


_RENEW = (
    update(tool_calls)
    .where(CALL_KEY, HELD_BY)
    .values(lease_until=bindparam("b_until", type_=_c.lease_until.type))
)


def renew_call_lease(conn: Connection, call: ClaimedCall, owner: str, until: datetime) -> bool:
    """Renew the lease this attempt took; False once it is not this attempt's any more."""
    return conn.execute(_RENEW, {**_held(call, owner), "b_until": until}).rowcount == 1


def park_call(
    conn: Connection, call: ClaimedCall, owner: str, handle: str, poll_at: datetime
) -> bool:
    """A resumable wait that is still waiting: keep it started, drop the owner, and let the
    sweep observe it again at ``poll_at``. A normal return, so the crash counter resets.

    The call is a resumable wait from here on (a ``parks`` tool's call becomes one by this
    park, I10), and whatever a person was asked and answered before is spent."""
    done = conn.execute(
        update(tool_calls)
        .where(CALL_KEY, HELD_BY)
        .values(
            handle=handle,
            lease_owner=None,
            lease_until=poll_at,
            attempts=0,
            swept_at=None,
            resumable=True,
            hold_info=None,
        ),
        _held(call, owner),
    )
    return done.rowcount == 1


def park_for_answer(
    conn: Connection,
    call: ClaimedCall,
    owner: str,
    *,
    handle: str | None,
    info: dict[str, Any],
    deadline_at: datetime,
) -> bool:
    """A started call whose work needs a person's answer (an AskPerson): held for a reply
    with no owner and no lease, so no sweep resumes it and no worker waits (I25); a reply
    releases it (charlie.reply), and only then may a resume claim it (hold IS NULL, I23).
    Its deadline becomes a question's; its task is ``waiting``."""
    done = conn.execute(
        update(tool_calls)
        .where(CALL_KEY, HELD_BY)
        .values(
            handle=handle,
            hold="reply",
            hold_info=info,
            lease_owner=None,
            lease_until=None,
            attempts=0,
            swept_at=None,
            resumable=True,
            deadline_at=deadline_at,
        ),
        _held(call, owner),
    )
    if done.rowcount != 1:
        return False
    conn.execute(
        update(tasks)
        .where(_t.id == task_id_of(call.execution_id), _t.status.in_(ACTIVE_STATUSES))
        .values(status=TaskStatus.WAITING.value)
    )
    return True


_RECORD_HANDLE = update(tool_calls).where(CALL_KEY, HELD_BY).values(handle=bindparam("b_handle"))


def record_handle(conn: Connection, call: ClaimedCall, owner: str, handle: str) -> bool:
    """Record the handle of the call's outside work; False (nothing written) when this attempt
    no longer holds the call: the handle of whoever holds it now stands."""
    return conn.execute(_RECORD_HANDLE, {**_held(call, owner), "b_handle": handle}).rowcount == 1


#: The first result wins (I12): only an unsettled call takes an outcome.
SETTLE = (
    update(tool_calls)
    .where(CALL_KEY, _c.state != CallState.SETTLED.value)
    .values(
        state=CallState.SETTLED.value,
        outcome=bindparam("b_outcome"),
        result=bindparam("b_result", type_=_c.result.type),
        settled_at=bindparam("b_now", type_=_c.settled_at.type),
        settled_by=bindparam("b_owner"),
        lease_owner=None,
        lease_until=None,
        duration_ms=bindparam("b_duration"),
        # settled, it waits for nobody (a question's deadline, a held call's stop)
        hold=None,
    )
)


#: A holder's settle: only while the call is still held under the lease it was taken with
#:. A holder whose lease lapsed and was taken over settles nothing.
SETTLE_HELD = SETTLE.where(
    _c.lease_owner == bindparam("b_owner"), _c.attempts == bindparam("b_token")
)


#: A holder whose lease lapsed while its call was held for an operator (hold='reconcile') and
#: not taken over since (the attempt count is still its own): its real result is the call's
#: first, so it settles the call (SETTLE ends the hold) rather than becoming a late report.
SETTLE_HELD_LATE = SETTLE.where(_c.hold == "reconcile", _c.attempts == bindparam("b_token"))


def settle_held_late(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    outcome: str,
    result: Any,
    owner: str,
    now: datetime,
    duration_ms: float | None,
    token: int,
) -> bool:
    return settle_call(
        conn, execution_id, turn, call_id, outcome, result, owner, now, duration_ms,
        token=token, statement=SETTLE_HELD_LATE,
    )  # fmt: skip


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
    *,
    token: int | None = None,
    statement: Any = None,
) -> bool:
    """The first result wins (I12): only an unsettled call takes an outcome. On False the
    caller records a late report instead. ``token``: a holder settles, fenced by the lease it
    took (owner and attempt count, see HELD_BY); without it, a sweep or a stop."""
    if statement is None:
        statement = SETTLE if token is None else SETTLE_HELD
    done = conn.execute(
        statement,
        {
            **({} if token is None else {"b_token": token}),
            **key_params(execution_id, turn, call_id),
            "b_outcome": outcome,
            "b_result": result,
            "b_now": now,
            "b_owner": owner,
            "b_duration": duration_ms,
        },
    )
    return done.rowcount == 1


_LOCK_RUN = (
    select(_e.phase, _e.version, _e.inbox)
    .where(_e.id == bindparam("b_execution"))
    .with_for_update()
)


def lock_run(conn: Connection, execution_id: str) -> tuple[str, int] | None:
    """Lock the run's row for the rest of the transaction; return its (phase, version).

    Whoever settles a call locks the run first (the order ticks take too: run, then calls), so
    settlers of one run take turns: of two settling the last two calls, the second sees the
    first's commit and knows the turn is complete (I7)."""
    row = conn.execute(_LOCK_RUN, {"b_execution": execution_id}).first()
    return (row.phase, row.version) if row else None


def lock_run_inbox(conn: Connection, execution_id: str) -> int:
    """Lock the run's row (as lock_run) and return its mailbox count as it is now."""
    row = conn.execute(_LOCK_RUN, {"b_execution": execution_id}).first()
    return int(row.inbox) if row else 0


_COUNT_UNSETTLED = (
    select(func.count())
    .select_from(tool_calls)
    .where(
        _c.execution_id == bindparam("b_execution"),
        _c.turn == bindparam("b_turn"),
        _c.state != CallState.SETTLED.value,
    )
)


def count_unsettled(conn: Connection, execution_id: str, turn: int) -> int:
    return int(
        conn.execute(_COUNT_UNSETTLED, {"b_execution": execution_id, "b_turn": turn}).scalar_one()
    )


#: The turn's completion, as the settler that completes it writes it: the run (in await_tools,
#: its turn with no open call left) gets a wake-up a stall period ahead. The settler publishes
#: the await tick after its commit, and the tick's claim clears the wake-up; if that publish is
#: lost (the settler died first, the broker refused it), the sweeps' wake scan finds the run
#: when the wake-up comes, through the index on wake_at, instead of probing every quiet run in
#: await_tools for a settled turn (I4, I7). One statement, as the count it replaces.
_WAKE_IF_COMPLETE = (
    update(executions)
    .where(
        _e.id == bindparam("b_execution"),
        _e.phase == Phase.AWAIT_TOOLS.value,
        ~exists().where(
            _c.execution_id == bindparam("b_execution"),
            _c.turn == bindparam("b_turn"),
            _c.state != CallState.SETTLED.value,
        ),
    )
    .values(wake_at=bindparam("b_wake", type_=_e.wake_at.type))
    .returning(_e.version)
)


def settle_in_turn(
    conn: Connection,
    execution_id: str,
    turn: int,
    settle: Callable[[Connection], bool],
    recheck_at: datetime,
) -> tuple[bool, int | None]:
    """Settle one call the one way every settler does (I7): the run's row locked first (see
    lock_run), then ``settle`` (False: it settled nothing), then, in the same transaction,
    whether that was the turn's last open call. Returns whether it settled, and the version of
    the run's await tick when the turn is now complete and the run waits in await_tools (the
    caller runs or publishes that tick after the commit; ``recheck_at`` is when the sweeps look
    for it if that tick is lost, see await_version_if_complete)."""
    position = lock_run(conn, execution_id)
    if not settle(conn):
        return False, None
    if position is None:
        return True, None
    return True, await_version_if_complete(conn, execution_id, turn, *position, recheck_at)


def await_version_if_complete(
    conn: Connection,
    execution_id: str,
    turn: int,
    phase: str,
    version: int,
    recheck_at: datetime,
) -> int | None:
    """After a settle, under the run's lock: the version of the run's await tick when the run
    waits in await_tools and this turn has no open call left (I7), else None. A completed turn
    also stores ``recheck_at`` as the run's wake-up (_WAKE_IF_COMPLETE): a stall period ahead,
    when the sweeps re-publish the tick unless it has been claimed by then."""
    if phase != Phase.AWAIT_TOOLS.value:
        return None
    woken = conn.execute(
        _WAKE_IF_COMPLETE, {"b_execution": execution_id, "b_turn": turn, "b_wake": recheck_at}
    ).first()
    return None if woken is None else int(woken.version)


def hold_interrupted(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    evidence: Any,
    now: datetime,
    *,
    owner: str | None = None,
    token: int | None = None,
) -> bool:
    """An interrupted call of an ``on_interrupt="hold"`` tool that no reconcile hook settled:
    held for an operator's verdict instead of reported (charlie.reconcile). It stays started
    (it was), with no lease and no deadline, so no sweep takes it over, settles it or times it
    out; its task is ``waiting`` (I25). A worker holds it fenced by its lease (``owner`` and
    ``token``); a sweep only once its lease has lapsed.

    ``hold_info`` keeps the call's deadline (a ``not_done`` repeat gets the same one) and the
    last operator action on the call so far: verdicts before it belong to an earlier round
    (an approve that let it run, a ``not_done`` that repeated it), I24."""
    row = conn.execute(
        select(_c.queued_at, _c.deadline_at, _c.hold_info).where(CALL_KEY),
        key_params(execution_id, turn, call_id),
    ).first()
    if row is None:
        return False
    info = dict(row.hold_info or {})
    if row.deadline_at is not None and row.queued_at is not None:
        info["deadline_seconds"] = (row.deadline_at - row.queued_at).total_seconds()
    last_action = conn.execute(
        select(func.max(operator_actions.c.id)).where(
            operator_actions.c.task_id == task_id_of(execution_id),
            operator_actions.c.call_id == call_id,
            operator_actions.c.turn == turn,
        )
    ).scalar()
    info.update(evidence=evidence, held_at=now.isoformat(), after_action=int(last_action or 0))
    stmt = update(tool_calls).where(
        CALL_KEY, _c.state == CallState.STARTED.value, _c.hold.is_(None)
    )
    params = key_params(execution_id, turn, call_id)
    if token is not None:
        stmt = stmt.where(HELD_BY)
        params.update(b_owner=owner, b_token=token)
    else:
        stmt = stmt.where(_c.lease_until < bindparam("b_now", type_=_c.lease_until.type))
        params["b_now"] = now
    held = conn.execute(
        stmt.values(
            hold="reconcile",
            hold_info=info,
            lease_owner=None,
            lease_until=None,
            deadline_at=None,
        ),
        params,
    )
    if held.rowcount != 1:
        return False
    conn.execute(
        update(tasks)
        .where(_t.id == task_id_of(execution_id), _t.status.in_(ACTIVE_STATUSES))
        .values(status=TaskStatus.WAITING.value)
    )
    return True


def is_held(conn: Connection, execution_id: str, turn: int, call_id: str) -> bool:
    return (
        conn.execute(
            select(_c.hold).where(CALL_KEY), key_params(execution_id, turn, call_id)
        ).scalar()
        is not None
    )


def settled_by(conn: Connection, execution_id: str, turn: int, call_id: str) -> str | None:
    return conn.execute(
        select(_c.settled_by).where(CALL_KEY), key_params(execution_id, turn, call_id)
    ).scalar()


def record_late_report(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    outcome: str,
    result: Any,
    *,
    first_only: bool = False,
) -> bool:
    """Count a result that came after the call's outcome (I12); ``late_result`` keeps the
    latest such result.

    ``first_only``: the end of a wait's outside work is one fact however many observers saw
    it, so it is recorded only while no late report is (tested on the count, which is never
    NULL, rather than on the JSON column, where None may be stored as JSON null)."""
    c = tool_calls.c
    stmt = update(tool_calls).where(CALL_KEY)
    if first_only:
        stmt = stmt.where(c.late_reports == 0)
    done = conn.execute(
        stmt.values(
            late_reports=c.late_reports + 1,
            late_result={"outcome": outcome, "result": result},
        ),
        key_params(execution_id, turn, call_id),
    )
    return done.rowcount == 1


#: Resumable waits settled past their deadline whose outside work has not been seen to end.
#: (The outcome is said as the literal of the partial index of migration 0018 holds.)
OVERDUE_WAIT = and_(
    _c.state == CallState.SETTLED.value,
    _c.outcome == literal_column(f"'{Outcome.DEADLINE_EXCEEDED.value}'"),
    _c.resumable.is_(True),
    _c.handle.is_not(None),
    _c.late_reports == 0,
)


def overdue_waits(
    conn: Connection, settled_since: datetime, looked_before: datetime, limit: int
) -> list[Any]:
    """What the late watch observes (I13): the work behind a wait is not assumed stopped by
    its deadline, and once the deadline settled the call nobody else is looking at it. Only
    waits settled since ``settled_since`` and not looked at since ``looked_before``; the
    caller spaces the looks out further as a wait ages (see due_for_a_look)."""
    return list(
        conn.execute(
            select(_c.execution_id, _c.turn, _c.call_id, _c.settled_at, _c.swept_at)
            .where(
                OVERDUE_WAIT,
                _c.settled_at > settled_since,
                or_(_c.swept_at.is_(None), _c.swept_at < looked_before),
            )
            .order_by(_c.swept_at.is_not(None), _c.swept_at)
            .limit(limit)
        ).all()
    )


def due_for_a_look(
    settled_at: datetime, looked_at: datetime | None, now: datetime, every: timedelta
) -> bool:
    """An overdue wait is looked at every ``every`` at first, then every tenth of its age
    past the deadline: about fifty looks in an hour rather than one per stall period."""
    if looked_at is None:
        return True
    return now - looked_at >= max(every, (now - settled_at) / 10)


def load_overdue_wait(
    conn: Connection, execution_id: str, turn: int, call_id: str
) -> ClaimedCall | None:
    """An overdue wait to observe once more, as its handler sees a call; None once its late
    report is in (or it was never one)."""
    row = conn.execute(
        select(*_call_columns()).where(CALL_KEY, OVERDUE_WAIT),
        {**key_params(execution_id, turn, call_id), "b_task": task_id_of(execution_id)},
    ).first()
    return None if row is None else _as_call(execution_id, turn, call_id, row)


def load_canceled_call(
    conn: Connection, execution_id: str, turn: int, call_id: str
) -> ClaimedCall | None:
    """A call settled ``canceled`` with a handle on outside work, as its handler sees a call
    (for its tool's cancel hook); None for any other."""
    row = conn.execute(
        select(*_call_columns()).where(
            CALL_KEY,
            _c.state == CallState.SETTLED.value,
            _c.outcome == Outcome.CANCELED.value,
            _c.handle.is_not(None),
        ),
        {**key_params(execution_id, turn, call_id), "b_task": task_id_of(execution_id)},
    ).first()
    return None if row is None else _as_call(execution_id, turn, call_id, row)


def waiters_on(conn: Connection, task_id: str) -> list[Any]:
    """The calls waiting on this task (their handle): parked resumable waits, and overdue ones
    whose late report is still to come (I13): (execution_id, turn, call_id, state, priority:
    the waiting run's, for its message)."""
    waiting_run = (
        select(_t.priority)
        .select_from(executions.join(tasks, _t.id == _e.task_id))
        .where(_e.id == _c.execution_id)
        .scalar_subquery()
    )
    return list(
        conn.execute(
            select(
                _c.execution_id, _c.turn, _c.call_id, _c.state, waiting_run.label("priority")
            ).where(
                _c.handle == task_id,
                or_(
                    and_(_c.state == CallState.STARTED.value, _c.resumable.is_(True)),
                    OVERDUE_WAIT,
                ),
            )
        ).all()
    )
