"""The sweeps' statements: bounded scans for work that is due, and the compare-and-sets by which
one sweeper wins a row for a stall period (I4, I10, I11, I13, I18).

Every scan is limited; every action is a compare-and-set on ``swept_at`` or on the call's state,
so two beats, or two overlapping runs of one sweep, act at most once per row per stall period.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    distinct,
    exists,
    func,
    literal_column,
    or_,
    select,
    update,
)

from charlie.domain import JSON, CallState, Hold, Outcome, Phase, TaskStatus
from charlie.store.runs import ACTIVE
from charlie.store.schema import executions, tasks, tool_calls

_e, _c, _t = executions.c, tool_calls.c, tasks.c

#: A lease is only treated as lapsed this long after its expiry: a live worker's renewal that is
#: a little late (a busy machine, a slow commit) must not look like a death.
LEASE_GRACE = timedelta(seconds=1)

ENDING = (Phase.REPORT_TERMINAL.value, Phase.REPORT_FAILURE.value, Phase.DONE.value)

#: Why a run's tick is re-published (see sweeps.sweep_stalled_runs).
RUN_REASONS = ("lapsed", "wake", "stalled", "stopping")
#: ...and, every CHARLIE_SWEEP_PROBE_SECONDS, a run in await_tools whose turn has settled
#: quietly with no wake-up stored (see _run_clause).
PROBE = "settled_turn"


#: Runs not done and calls not settled, said as literals: the partial indexes of migration 0015
#: hold exactly these rows, and a planner can use one only where the query says its predicate
#: with the same constant (a bound parameter is not known when a plan is made for many values).
LIVE_RUN = _e.phase != literal_column("'done'")
OPEN_CALL = _c.state != literal_column("'settled'")

#: Runs that should be moving: live and not waiting for their calls (await_tools, where a run
#: may wait for hours, for a tool or a person). The partial index of migration 0016 holds
#: these, so a scan for stalled runs reads the runs in motion, not the runs that wait.
MOVING_RUN = and_(LIVE_RUN, _e.phase != literal_column("'await_tools'"))
#: Started calls: the orphan scan's, said as the partial index of migration 0018 holds them
STARTED_CALL = _c.state == literal_column("'started'")
#: Calls in flight: open and held for no person (an approval, a question, a verdict). The
#: partial index of migration 0016 holds these, so the scans for lost and abandoned calls read
#: the calls in flight, not the calls waiting for people.
IN_FLIGHT_CALL = and_(OPEN_CALL, _c.hold.is_(None))


def _throttle(column: Any, now: datetime, stall: timedelta) -> Any:
    return or_(column.is_(None), column < now - stall)


def _run_clause(
    reason: str, now: datetime, stall: timedelta, held_back: timedelta | None = None
) -> Any:
    free = _e.lease_owner.is_(None)
    if reason == "lapsed":
        return and_(_e.lease_until.is_not(None), _e.lease_until < now - LEASE_GRACE)
    if reason == "wake":
        woken = and_(free, _e.wake_at.is_not(None), _e.wake_at <= now)
        if held_back is None:
            return woken
        # In a broker backlog, the wake-up of a turn's settle (a stall period after it) is
        # mostly a tick still queued, not lost: it waits as long as a stalled run does.
        return and_(
            woken,
            or_(_e.phase != Phase.AWAIT_TOOLS.value, _e.wake_at <= now - held_back),
        )
    if reason == PROBE:
        # An await whose turn has settled, quietly, for the stall period, and that no wake-up
        # will find: read run by run (each quiet run in await_tools, for an open call or one
        # settled lately), hence only every CHARLIE_SWEEP_PROBE_SECONDS.
        # A wake-up still ahead (an earlier wait's deadline) does not find it before that: a
        # settle of a release before 0016 stores none of its own.
        in_turn = and_(_c.execution_id == _e.id, _c.turn == _e.turn)
        return and_(
            free,
            _e.phase == Phase.AWAIT_TOOLS.value,
            or_(_e.wake_at.is_(None), _e.wake_at > now),
            _e.updated_at < now - stall,
            ~exists().where(in_turn, OPEN_CALL),
            ~exists().where(in_turn, _c.settled_at > now - stall),
        )
    if reason == "stalled":
        # Ready, and not moved for the stall period: a commit whose publish was lost. A run in
        # await_tools waits for its calls and is not looked at here: the settle that completes
        # its turn stores a wake-up a stall period ahead (store.calls.await_version_if_complete),
        # which the "wake" clause finds if the await tick published after it is lost.
        return and_(MOVING_RUN, free, _e.updated_at < now - stall, _e.wake_at.is_(None))
    if reason == "stopping":
        stopped = exists().where(
            _t.id == _e.task_id,
            or_(
                _t.status.in_((TaskStatus.CANCELED.value, TaskStatus.TIMED_OUT.value)),
                and_(_t.status.in_(ACTIVE), _t.timeout_at < now),
            ),
        )
        return and_(free, _e.phase.not_in(ENDING), stopped)
    raise ValueError(f"unknown sweep reason {reason!r}")


def runs_due(
    conn: Connection,
    reason: str,
    now: datetime,
    stall: timedelta,
    limit: int,
    *,
    held_back: timedelta | None = None,
) -> list[Any]:
    """Runs whose tick is due for ``reason`` and not swept this stall period:
    (id, phase, version, priority), the longest due first where an index keeps that order.
    ``held_back``: in a broker backlog, how much longer a settled turn's wake-up waits."""
    return list(
        conn.execute(
            select(_e.id, _e.phase, _e.version, _TASK_PRIORITY)
            .where(
                LIVE_RUN,
                _throttle(_e.swept_at, now, stall),
                _run_clause(reason, now, stall, held_back),
            )
            .order_by(*_DUE_ORDER.get(reason, ()))
            .limit(limit)
        ).all()
    )


#: The order a scan takes its runs in, by the column its index keeps in order. Without it,
#: PostgreSQL's estimate (most live runs were updated over a stall period ago, most are not
#: in await_tools: independent guesses, multiplied) made a sequential scan of every run that
#: would stop at its limit look cheaper than the partial index of the runs in motion, which
#: holds only those and, in order, stops at the first one updated lately.
_DUE_ORDER: dict[str, tuple[Any, ...]] = {"wake": (_e.wake_at,), "stalled": (_e.updated_at,)}


def win_run(
    conn: Connection,
    execution_id: str,
    version: int,
    now: datetime,
    stall: timedelta,
) -> bool:
    """Mark the run swept if no sweeper has this stall period."""
    return bool(
        conn.execute(
            update(executions)
            .where(
                _e.id == execution_id,
                _e.version == version,
                _throttle(_e.swept_at, now, stall),
            )
            .values(swept_at=now)
        ).rowcount
    )


#: a run's task's priority, for the tick a sweep (or a poke) publishes: a primary-key probe
#: per row found, off the hot path.
_TASK_PRIORITY = select(_t.priority).where(_t.id == _e.task_id).scalar_subquery().label("priority")
#: a call's task's priority, for the messages a sweep publishes for it: two primary-key
#: probes per row found (its run, its task), off the hot path.
_RUN_PRIORITY = (
    select(_t.priority)
    .select_from(executions.join(tasks, _t.id == _e.task_id))
    .where(_e.id == _c.execution_id)
    .scalar_subquery()
    .label("priority")
)


def _lapsed(now: datetime) -> Any:
    return _c.lease_until < now - LEASE_GRACE


def _run_live() -> Any:
    return exists().where(_e.id == _c.execution_id, _e.phase.not_in(ENDING))


def abandoned_calls(conn: Connection, now: datetime, limit: int) -> list[Any]:
    """Open calls of a run that has ended (a failure, a race with a stop), held by no live
    worker: they settle canceled so each still has its one outcome.

    Driven from the calls in flight (the partial index of migration 0016), each then looked up
    in its run: the cost follows the calls in flight, not the calls kept nor those waiting for
    people. (Said as one anti-join with a LIMIT, PostgreSQL merge-joined both tables whole,
    expecting to stop early.) A call held for a person is not among them: the transition that
    ends a run settles every open call of its turn, held ones included (boundary.close_turn),
    so only a call in flight can outlive its run (a worker's, whose lease then lapses)."""
    open_calls = (
        select(_c.execution_id, _c.turn, _c.call_id, _c.name, _c.started_at)
        .where(IN_FLIGHT_CALL, or_(_c.lease_owner.is_(None), _lapsed(now)))
        .cte("open_calls")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    live = exists().where(_e.id == open_calls.c.execution_id, _e.phase.not_in(ENDING))
    return list(conn.execute(select(open_calls).where(~live).limit(limit)).all())


def overdue_calls(conn: Connection, now: datetime, limit: int) -> list[Any]:
    """Open calls past their deadline (I13)."""
    return list(
        conn.execute(
            select(
                _c.execution_id,
                _c.turn,
                _c.call_id,
                _c.name,
                _c.started_at,
                _c.queued_at,
                _c.deadline_at,
                _RUN_PRIORITY,
            )
            .where(OPEN_CALL, _c.deadline_at < now)
            .limit(limit)
        ).all()
    )


def lost_calls(conn: Connection, now: datetime, stall: timedelta, limit: int) -> list[Any]:
    """Calls queued a stall period ago and never started: their invoke was lost (I11)."""
    return list(
        conn.execute(
            select(_c.execution_id, _c.turn, _c.call_id, _RUN_PRIORITY)
            .where(
                IN_FLIGHT_CALL,  # a question to a person is queued but sent to no worker
                _c.state == CallState.PENDING.value,
                _c.queued_at < now - stall,
                _throttle(_c.swept_at, now, stall),
                _run_live(),
            )
            .limit(limit)
        ).all()
    )


def orphaned_calls(conn: Connection, now: datetime, stall: timedelta, limit: int) -> list[Any]:
    """Started calls whose worker's lease lapsed (I10), with the evidence of their start."""
    return list(
        conn.execute(
            select(
                _c.execution_id,
                _c.turn,
                _c.call_id,
                _c.name,
                _c.resumable,
                _c.attempts,
                _c.started_at,
                _c.started_by,
                _c.lease_owner,
                _c.lease_until,
                _c.handle,
                _c.implementation,
                _c.on_interrupt,
                _RUN_PRIORITY,
            )
            .where(
                STARTED_CALL,
                _lapsed(now),
                _throttle(_c.swept_at, now, stall),
                _run_live(),
            )
            .limit(limit)
        ).all()
    )


def win_call(
    conn: Connection, execution_id: str, turn: int, call_id: str, now: datetime, stall: timedelta
) -> bool:
    """Mark the call swept if no sweeper has this stall period."""
    return bool(
        conn.execute(
            update(tool_calls)
            .where(
                _c.execution_id == execution_id,
                _c.turn == turn,
                _c.call_id == call_id,
                _throttle(_c.swept_at, now, stall),
            )
            .values(swept_at=now)
        ).rowcount
    )


def interrupt_call(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    evidence: JSON,
    now: datetime,
    by: str,
) -> bool:
    """Settle a started call ``interrupted`` with its evidence (I10): only one still started
    with a lapsed lease, never one a live worker holds."""
    return bool(
        conn.execute(
            update(tool_calls)
            .where(
                _c.execution_id == execution_id,
                _c.turn == turn,
                _c.call_id == call_id,
                _c.state == CallState.STARTED.value,
                _lapsed(now),
            )
            .values(
                state=CallState.SETTLED.value,
                outcome=Outcome.INTERRUPTED.value,
                result=evidence,
                settled_at=now,
                settled_by=by,
                lease_owner=None,
            )
        ).rowcount
        == 1
    )


def tasks_past_timeout(conn: Connection, now: datetime, limit: int) -> list[str]:
    """Active tasks whose timeout has passed (I18)."""
    return [
        r.id
        for r in conn.execute(
            select(_t.id).where(_t.status.in_(ACTIVE), _t.timeout_at < now).limit(limit)
        )
    ]


def current_ticks(conn: Connection, task_ids: list[str]) -> list[Any]:
    """The current (id, phase, version, priority) of these tasks' unfinished runs, to poke
    them."""
    return list(
        conn.execute(
            select(_e.id, _e.phase, _e.version, _TASK_PRIORITY).where(
                _e.task_id.in_(task_ids), _e.phase != Phase.DONE.value
            )
        ).all()
    )


#: every phase but done
LIVE_PHASES = tuple(p.value for p in Phase if p is not Phase.DONE)


def fleet_gauges(conn: Connection, now: datetime, stall: timedelta) -> dict[str, Any]:
    """The fleet's gauges for metrics, in five bounded aggregate statements over
    indexed columns: runs not done by phase, active tasks by status, open tool calls and the
    tasks waiting for a person by what they wait for, and the age of the oldest run that is
    due and not moving (what the stalled-run sweep looks for: a lapsed lease, or ready and
    quiet for the stall period)."""
    # phase IN (the live ones), not phase != 'done': the (phase, lease_until) index serves it,
    # so the cost is the live runs', not the whole history's.
    runs_by_phase: dict[str, int] = dict(
        conn.execute(
            select(_e.phase, func.count()).where(_e.phase.in_(LIVE_PHASES)).group_by(_e.phase)
        ).all()
    )
    tasks_by_status = {s: 0 for s in ACTIVE}
    tasks_by_status.update(
        conn.execute(
            select(_t.status, func.count()).where(_t.status.in_(ACTIVE)).group_by(_t.status)
        ).all()
    )
    open_calls = 0
    waiting = {h.value: 0 for h in Hold}
    for hold, calls, runs in conn.execute(
        select(_c.hold, func.count(), func.count(distinct(_c.execution_id)))
        .where(OPEN_CALL)  # pending or started: read through the open calls' partial index
        .group_by(_c.hold)
    ).all():
        open_calls += calls
        if hold is not None:
            waiting[hold] = runs
    # One min() each (an OR of the two made PostgreSQL read every live run): each is then the
    # first row of an index, (phase, lease_until) and the runs in motion's (migration 0016).
    found = [
        conn.execute(
            select(func.min(_e.updated_at)).where(LIVE_RUN, _run_clause(reason, now, stall))
        ).scalar()
        for reason in ("lapsed", "stalled")
    ]
    # SQLite's min() of a text column skips the type's decoding
    stamps = [
        datetime.fromisoformat(t).replace(tzinfo=now.tzinfo) if isinstance(t, str) else t
        for t in found
        if t is not None
    ]
    oldest = min(stamps) if stamps else None
    return {
        "runs": runs_by_phase,
        "tasks": tasks_by_status,
        "open_tool_calls": open_calls,
        "waiting_for_person": waiting,
        "oldest_stalled_run_seconds": max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
    }
