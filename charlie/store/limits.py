"""The statements of the provider limits the fleet keeps (charlie/limits.py decides; I30).

Every caller of a limit locks its ``limit_state`` row first (an upsert, so the first caller
creates it), counts, and either takes a slot or records itself as a waiter, in one short
transaction; nothing here is held across a model call. A slot is in flight while it is not
released and the run lease that took it (execution, version, attempt) is live: a worker killed
while it holds one gives it back when its lease lapses, and a run claimed again (its attempt
counted anew) never counts its old slot.

The statements a model call runs are built once, with bound parameters (a limited call pays
for its statements, not for building them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    case,
    delete,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from charlie.domain import Phase
from charlie.limits import WINDOW, Counted
from charlie.store.schema import (
    executions,
    limit_actions,
    limit_slots,
    limit_state,
    limit_waiters,
    tasks,
)

_s, _w, _e, _l = limit_slots.c, limit_waiters.c, executions.c, limit_state.c

#: a slot not released (its holder died and its run was never claimed again) is forgotten
#: after this long; it stopped counting when its lease lapsed.
FORGET = timedelta(hours=1)
#: every this many slots, a release also deletes what no count reads any more
PRUNE_EVERY = 32

_KEY = bindparam("b_key", type_=_l.limit_key.type)
_XID = bindparam("b_xid", type_=_s.execution_id.type)
_NOW = bindparam("b_now", type_=_s.taken_at.type)
_CUTOFF = bindparam("b_cutoff", type_=_s.taken_at.type)


def _dialect(conn: Connection) -> Any:
    return postgresql if conn.dialect.name == "postgresql" else sqlite


def _live_slot(now: Any) -> Any:
    return and_(
        _s.released_at.is_(None),
        _e.version == _s.version,
        _e.attempts == _s.attempt,
        _e.lease_until > now,
    )


def _fresh_waiter(key: Any, now: Any) -> Any:
    """A waiter still at the call it waits for, that has not failed to ask again in time."""
    return and_(
        _w.limit_key == key,
        _w.expires_at > now,
        _e.version == _w.version,
        _e.phase == Phase.CALL_MODEL.value,
    )


_SLOTS_WITH_RUNS = limit_slots.join(executions, _e.id == _s.execution_id)
_WAITERS_WITH_RUNS = limit_waiters.join(executions, _e.id == _w.execution_id)


@functools.cache
def _lock_statement(dialect: str) -> Any:
    insert = (postgresql if dialect == "postgresql" else sqlite).insert
    stmt = insert(limit_state).values(limit_key=_KEY)
    return stmt.on_conflict_do_update(
        index_elements=[_l.limit_key], set_={"limit_key": stmt.excluded.limit_key}
    ).returning(_l.paused_until)


def lock_limit(conn: Connection, key: str) -> datetime | None:
    """Lock the limit's row (creating it), so callers of one limit count one at a time; its
    pause. One statement: an upsert that touches the row takes its lock on PostgreSQL, and a
    SQLite write transaction holds the database's."""
    paused: datetime | None = conn.execute(
        _lock_statement(conn.dialect.name), {"b_key": key}
    ).scalar_one()
    return paused


def _count_statement() -> Any:
    priority = (
        select(func.coalesce(func.max(tasks.c.priority), 0))
        .where(tasks.c.id == bindparam("b_task", type_=tasks.c.id.type))
        .scalar_subquery()
    )
    # A row whose wait ended long ago (its run stopped or failed while waiting, and was
    # resumed) is no place in line: a run that waits again starts at the back.
    since = (
        select(_w.since)
        .where(_w.limit_key == _KEY, _w.execution_id == _XID, _w.expires_at > _NOW)
        .scalar_subquery()
    )
    others = and_(_fresh_waiter(_KEY, _NOW), _w.execution_id != _XID)
    ahead = or_(
        _w.priority > priority,
        and_(_w.priority == priority, _w.since < func.coalesce(since, _NOW)),
    )
    # A request counts for a minute from when its slot was taken and for a minute after it
    # ended: the provider counts it from its arrival, between the two, whatever the delay
    # between taking the slot and sending (a client's first connection, a busy machine).
    recent = and_(_s.limit_key == _KEY, or_(_s.taken_at > _CUTOFF, _s.released_at > _CUTOFF))
    return select(
        select(func.count())
        .select_from(_SLOTS_WITH_RUNS)
        .where(_s.limit_key == _KEY, _s.execution_id != _XID, _live_slot(_NOW))
        .scalar_subquery()
        .label("in_flight"),
        select(func.count()).where(recent).scalar_subquery().label("recent"),
        select(func.coalesce(func.sum(_s.tokens), 0))
        .where(recent)
        .scalar_subquery()
        .label("recent_tokens"),
        select(func.min(func.coalesce(_s.released_at, _s.taken_at)))
        .where(recent)
        .scalar_subquery()
        .label("oldest"),
        select(func.count())
        .select_from(_WAITERS_WITH_RUNS)
        .where(others, ahead)
        .scalar_subquery()
        .label("ahead"),
        select(func.count())
        .select_from(_WAITERS_WITH_RUNS)
        .where(others)
        .scalar_subquery()
        .label("waiting"),
        select(func.count())
        .select_from(_WAITERS_WITH_RUNS)
        .where(others, _w.woken_at > bindparam("b_woken", type_=_w.woken_at.type))
        .scalar_subquery()
        .label("woken"),
        priority.label("priority"),
        since.label("since"),
        select(_l.paused_until).where(_l.limit_key == _KEY).scalar_subquery().label("paused"),
    )


_COUNT = _count_statement()


def count(
    conn: Connection,
    key: str,
    execution_id: str,
    task_id: str,
    now: datetime,
    woken_grace: timedelta,
) -> tuple[Counted, int, datetime | None]:
    """What the limit holds now, seen from this run, in one statement: (the counts, the
    task's priority, since when this run has waited, or None). Exact when the caller holds
    the limit's row (lock_limit); without it, a look that may be a moment old. Waiters woken
    in the last ``woken_grace`` count as woken (their room is promised)."""
    row = conn.execute(
        _COUNT,
        {
            "b_key": key,
            "b_xid": execution_id,
            "b_task": task_id,
            "b_now": now,
            "b_cutoff": now - WINDOW,
            "b_woken": now - woken_grace,
        },
    ).one()
    counted = Counted(
        now=now,
        in_flight=int(row.in_flight),
        recent=int(row.recent),
        recent_tokens=int(row.recent_tokens),
        oldest=_aware(row.oldest),
        ahead=int(row.ahead),
        waiting=int(row.waiting),
        paused_until=_aware(row.paused),
        woken=int(row.woken),
    )
    return counted, int(row.priority or 0), _aware(row.since)


def _aware(value: Any) -> datetime | None:
    """A time as the statement returned it, aware in UTC (SQLite keeps naive text)."""
    if value is None:
        return None
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


_RELEASE_OWN = (
    update(limit_slots)
    .where(_s.execution_id == _XID, _s.released_at.is_(None))
    .values(released_at=_NOW)
)
_FORGET_WAITER = delete(limit_waiters).where(_w.limit_key == _KEY, _w.execution_id == _XID)
_TAKE = (
    limit_slots.insert()
    .values(
        limit_key=_KEY,
        execution_id=_XID,
        version=bindparam("b_version"),
        attempt=bindparam("b_attempt"),
        taken_at=_NOW,
        tokens=bindparam("b_tokens"),
    )
    .returning(_s.id)
)


def take_slot(
    conn: Connection,
    key: str,
    execution_id: str,
    version: int,
    attempt: int,
    tokens: int,
    now: datetime,
    waited: bool,
) -> int:
    """Record the request about to be sent; the run stops waiting. Any slot of this run left
    unreleased (a release that did not commit) is released first: a run has one call in
    flight, so it is never counted twice (I30). Returns the slot's id."""
    params = {"b_key": key, "b_xid": execution_id, "b_now": now}
    conn.execute(_RELEASE_OWN, params)
    if waited:
        conn.execute(_FORGET_WAITER, params)
    slot_id: int = conn.execute(
        _TAKE, {**params, "b_version": version, "b_attempt": attempt, "b_tokens": tokens}
    ).scalar_one()
    return slot_id


@functools.cache
def _wait_statement(dialect: str) -> Any:
    insert = (postgresql if dialect == "postgresql" else sqlite).insert
    values = {
        "version": bindparam("b_version"),
        "priority": bindparam("b_priority"),
        "expires_at": bindparam("b_expires", type_=_w.expires_at.type),
        "woken_at": None,
    }
    stmt = insert(limit_waiters).values(
        limit_key=_KEY, execution_id=_XID, since=bindparam("b_since", type_=_w.since.type), **values
    )
    return stmt.on_conflict_do_update(index_elements=[_w.limit_key, _w.execution_id], set_=values)


def wait(
    conn: Connection,
    key: str,
    execution_id: str,
    version: int,
    priority: int,
    since: datetime | None,
    now: datetime,
    expires: datetime,
) -> None:
    """Record (or renew) this run as a waiter, keeping its place in the order (``since``),
    until ``expires``: a waiter that has not asked again by then (its run stopped, its
    wake-up lost) holds no one back."""
    conn.execute(
        _wait_statement(conn.dialect.name),
        {
            "b_key": key,
            "b_xid": execution_id,
            "b_version": version,
            "b_priority": priority,
            "b_since": since or now,
            "b_expires": expires,
        },
    )


@dataclass(frozen=True)
class Woken:
    execution_id: str
    version: int
    #: its task's priority (as its waiter row has it), for its tick's message
    priority: int = 0


_RELEASE = (
    update(limit_slots)
    .where(_s.id == bindparam("b_slot"), _s.released_at.is_(None))
    .values(released_at=_NOW)
)
_RELEASE_WITH_TOKENS = (
    update(limit_slots)
    .where(_s.id == bindparam("b_slot"), _s.released_at.is_(None))
    .values(released_at=_NOW, tokens=bindparam("b_tokens"))
)
# A waiter whose run still holds its lease (its tick is about to commit its wait) is woken
# too: its tick sees the mark once its wait is committed and looks again at once (woken_while
# _leased), rather than the room idling until its own wake-up (I30).
_NEXT_IN_LINE = (
    select(_w.execution_id, _w.version, _w.priority)
    .select_from(_WAITERS_WITH_RUNS)
    .where(
        _fresh_waiter(_KEY, _NOW),
        _w.execution_id != _XID,
        or_(_w.woken_at.is_(None), _w.woken_at < bindparam("b_woken", type_=_w.woken_at.type)),
    )
    .order_by(_w.priority.desc(), _w.since, _w.execution_id)
    .limit(bindparam("b_wake"))
)
_MARK_WOKEN = (
    update(limit_waiters)
    .where(_w.limit_key == _KEY, _w.execution_id.in_(bindparam("b_woken_ids", expanding=True)))
    .values(woken_at=_NOW)
)


def release(
    conn: Connection,
    key: str,
    slot_id: int,
    tokens: int | None,
    now: datetime,
    wake: int,
    woken_grace: timedelta,
) -> list[Woken]:
    """The request is answered (or failed): its slot stops counting as in flight, its tokens
    become what the provider reported. Returns the first ``wake`` waiters of the limit, free to
    run (no lease) and not woken in the last ``woken_grace`` (another release's: the next
    release wakes the one after it), whose call_model tick the caller publishes."""
    params: dict[str, Any] = {"b_key": key, "b_slot": slot_id, "b_now": now, "b_tokens": tokens}
    conn.execute(_RELEASE if tokens is None else _RELEASE_WITH_TOKENS, params)
    if slot_id % PRUNE_EVERY == 0:
        # What no count reads any more: slots out of the window (released, or whose holder
        # died long ago), waiters that stopped asking long ago (their runs stopped or moved on).
        conn.execute(
            delete(limit_slots).where(
                _s.limit_key == key,
                _s.taken_at < now - WINDOW,
                or_(_s.released_at.is_not(None), _s.taken_at < now - FORGET),
            )
        )
        conn.execute(delete(limit_waiters).where(_w.limit_key == key, _w.expires_at < now - FORGET))
    return next_in_line(conn, key, now, wake, woken_grace)


def next_in_line(
    conn: Connection,
    key: str,
    now: datetime,
    wake: int,
    woken_grace: timedelta,
    caller: str = "",
) -> list[Woken]:
    """The first ``wake`` waiters of the limit (but ``caller``) not woken in the last
    ``woken_grace``, marked woken: the caller publishes their call_model ticks."""
    if wake <= 0:
        return []
    params = {
        "b_key": key,
        "b_now": now,
        "b_woken": now - woken_grace,
        "b_wake": wake,
        "b_xid": caller,
    }
    rows = conn.execute(_NEXT_IN_LINE, params).all()
    if rows:
        conn.execute(_MARK_WOKEN, {**params, "b_woken_ids": [r.execution_id for r in rows]})
    return [Woken(r.execution_id, r.version, r.priority) for r in rows]


_LEAVE = delete(limit_waiters).where(_w.execution_id == _XID).returning(_w.limit_key)


def leave(
    conn: Connection, execution_id: str, now: datetime, woken_grace: timedelta
) -> list[Woken]:
    """The run's wait ended without a slot (its task canceled, stopped, over budget, failed):
    its waiter rows end with it (a resumed run does not keep its old place), and the next in
    line of each limit it waited on is woken, for the room it may have been woken for
    (I30)."""
    keys = conn.execute(_LEAVE, {"b_xid": execution_id}).scalars().all()
    woken: list[Woken] = []
    for key in keys:
        woken += next_in_line(conn, key, now, 1, woken_grace)
    return woken


_WOKEN_WHILE_LEASED = (
    select(_w.execution_id, _w.version, _w.priority)
    .select_from(_WAITERS_WITH_RUNS)
    .where(
        _w.execution_id.in_(bindparam("b_ids", expanding=True)),
        _w.woken_at.is_not(None),
        _e.version == _w.version,
        _e.phase == Phase.CALL_MODEL.value,
        or_(_e.lease_until.is_(None), _e.lease_until < _NOW),
    )
)


def woken_while_leased(conn: Connection, execution_ids: list[str], now: datetime) -> list[Woken]:
    """Of these runs, whose waits this process has just committed, those a release woke while
    they still held their leases (a wait's own write clears the mark): their waits are over."""
    rows = conn.execute(_WOKEN_WHILE_LEASED, {"b_ids": execution_ids, "b_now": now}).all()
    return [Woken(r.execution_id, r.version, r.priority) for r in rows]


def pause(conn: Connection, key: str, until: datetime) -> None:
    """The provider asked to wait (a 429 / 529 with retry-after): every caller of the limit
    waits until ``until``, fleet-wide; a later pause already recorded stands."""
    lock_limit(conn, key)
    conn.execute(
        update(limit_state)
        .where(_l.limit_key == key)
        .values(
            paused_until=case(
                (or_(_l.paused_until.is_(None), _l.paused_until < until), until),
                else_=_l.paused_until,
            ),
            throttles=_l.throttles + 1,
        )
    )


@dataclass(frozen=True)
class LimitStatus:
    """What `charlie status`, the console and the metrics say of one limit."""

    key: str
    in_flight: int
    waiting: int
    recent: int
    paused_until: datetime | None
    throttles: int


def statuses(conn: Connection, now: datetime) -> list[LimitStatus]:
    """Every limit used so far: what is in flight, waiting, sent in the last minute."""
    out = []
    for row in conn.execute(select(_l.limit_key, _l.paused_until, _l.throttles)).all():
        key = row.limit_key
        in_flight = conn.execute(
            select(func.count())
            .select_from(_SLOTS_WITH_RUNS)
            .where(_s.limit_key == key, _live_slot(now))
        ).scalar_one()
        waiting = conn.execute(
            select(func.count()).select_from(_WAITERS_WITH_RUNS).where(_fresh_waiter(key, now))
        ).scalar_one()
        recent = conn.execute(
            select(func.count()).where(_s.limit_key == key, _s.taken_at > now - WINDOW)
        ).scalar_one()
        out.append(
            LimitStatus(
                key, int(in_flight), int(waiting), int(recent), row.paused_until, int(row.throttles)
            )
        )
    return out


# -- what operators see and do (I27, I32, I36) ---------------------------------------------


def paused(conn: Connection, key: str) -> tuple[bool, datetime | None]:
    """Whether the limit has been used (its row exists), and the pause recorded on it (None:
    none)."""
    row = conn.execute(select(_l.paused_until).where(_l.limit_key == key)).first()
    return (row is not None, None if row is None else _aware(row.paused_until))


def lift_pause(conn: Connection, key: str) -> datetime | None:
    """Lift the limit's pause (its row locked first, as every caller of the limit does); the
    pause it lifted, or None when there was none."""
    until = lock_limit(conn, key)
    conn.execute(update(limit_state).where(_l.limit_key == key).values(paused_until=None))
    return _aware(until)


def record_limit_action(
    conn: Connection,
    *,
    key: str,
    action: str,
    actor: str,
    now: datetime,
    channel: str,
    authenticated: bool,
    note: str | None = None,
    detail: Any = None,
) -> int:
    """The evidence row of an operator's action on a limit (I27), with how it arrived (I32)."""
    row = conn.execute(
        limit_actions.insert()
        .values(
            limit_key=key,
            action=action,
            actor=actor,
            at=now,
            note=note,
            detail=detail,
            channel=channel,
            authenticated=authenticated,
        )
        .returning(limit_actions.c.id)
    ).first()
    assert row is not None
    return int(row.id)


@dataclass(frozen=True)
class LimitActionRow:
    id: int
    key: str
    action: str
    actor: str
    at: datetime
    note: str | None
    detail: Any
    channel: str
    authenticated: bool


def limit_action_rows(
    conn: Connection, key: str | None = None, last: int = 20
) -> list[LimitActionRow]:
    """The last ``last`` operator actions on limits (on ``key`` only, when given), newest
    first."""
    a = limit_actions.c
    stmt = select(limit_actions).order_by(a.id.desc()).limit(last)
    if key is not None:
        stmt = stmt.where(a.limit_key == key)
    return [
        LimitActionRow(
            int(r.id),
            r.limit_key,
            r.action,
            r.actor,
            _aware(r.at) or r.at,
            r.note,
            r.detail,
            r.channel,
            bool(r.authenticated),
        )
        for r in conn.execute(stmt).all()
    ]


@dataclass(frozen=True)
class HeldRun:
    execution_id: str
    version: int
    priority: int
    model: str


def held_until(conn: Connection, now: datetime, until: datetime, last: int) -> list[HeldRun]:
    """Runs at a model call, free (no live lease), whose stored wake-up falls after ``now`` and
    no later than ``until`` (a pause's end): those a lifted pause held, the throttled call's own
    retry and the limit's waiters (the caller keeps those of its limit, by their task's
    model)."""
    stmt = (
        select(_e.id, _e.version, tasks.c.priority, tasks.c.model)
        .select_from(executions.join(tasks, tasks.c.id == _e.task_id))
        .where(
            _e.phase == Phase.CALL_MODEL.value,
            _e.wake_at > now,
            _e.wake_at <= until + timedelta(seconds=1),
            or_(_e.lease_until.is_(None), _e.lease_until < now),
        )
        .order_by(tasks.c.priority.desc(), _e.wake_at)
        .limit(last)
    )
    return [
        HeldRun(r.id, int(r.version), int(r.priority or 0), r.model) for r in conn.execute(stmt)
    ]
