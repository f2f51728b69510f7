"""The statements of the provider limits the fleet keeps (charlie/limits.py decides; I30).

Every caller of a limit locks its ``limit_state`` row first (an upsert, so the first caller
creates it), counts, and either takes a slot or records itself as a waiter, in one short
transaction; nothing here is held across a model call. A slot is in flight while it is not
released and the run lease that took it (execution, version, attempt) is live: a worker killed
while it holds one gives it back when its lease lapses, and a run claimed again (its attempt
counted anew) never counts its old slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, case, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from charlie.domain import Phase
from charlie.limits import WINDOW, Counted
from charlie.store.schema import executions, limit_slots, limit_state, limit_waiters, tasks

_s, _w, _e, _l = limit_slots.c, limit_waiters.c, executions.c, limit_state.c

#: a slot not released (its holder died and its run was never claimed again) is forgotten
#: after this long; it stopped counting when its lease lapsed.
FORGET = timedelta(hours=1)


def _dialect(conn: Connection) -> Any:
    return postgresql if conn.dialect.name == "postgresql" else sqlite


def lock_limit(conn: Connection, key: str) -> datetime | None:
    """Lock the limit's row (creating it), so callers of one limit count one at a time; its
    pause. One statement: an upsert that touches the row takes its lock on PostgreSQL, and a
    SQLite write transaction holds the database's."""
    stmt = _dialect(conn).insert(limit_state).values(limit_key=key)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_l.limit_key], set_={"limit_key": stmt.excluded.limit_key}
    ).returning(_l.paused_until)
    paused: datetime | None = conn.execute(stmt).scalar_one()
    return paused


def _live_slot(now: datetime) -> Any:
    return and_(
        _s.released_at.is_(None),
        _e.version == _s.version,
        _e.attempts == _s.attempt,
        _e.lease_until > now,
    )


def _fresh_waiter(key: str, now: datetime, stale: timedelta) -> Any:
    """A waiter still at the call it waits for, that asked recently."""
    return and_(
        _w.limit_key == key,
        _w.seen_at > now - stale,
        _e.version == _w.version,
        _e.phase == Phase.CALL_MODEL.value,
    )


def count(
    conn: Connection,
    key: str,
    execution_id: str,
    task_id: str,
    now: datetime,
    stale: timedelta,
    paused_until: datetime | None,
) -> tuple[Counted, int, datetime | None]:
    """What the limit holds now (the caller holds its row), seen from this run: (the counts,
    the task's priority, since when this run has waited, or None)."""
    mine = conn.execute(
        select(
            tasks.c.priority,
            select(_w.since)
            .where(_w.limit_key == key, _w.execution_id == execution_id)
            .scalar_subquery(),
        ).where(tasks.c.id == task_id)
    ).first()
    priority, since = (int(mine[0] or 0), mine[1]) if mine is not None else (0, None)
    my_since = since or now
    cutoff = now - WINDOW
    others_waiting = and_(_fresh_waiter(key, now, stale), _w.execution_id != execution_id)
    ahead = or_(_w.priority > priority, and_(_w.priority == priority, _w.since < my_since))
    row = conn.execute(
        select(
            select(func.count())
            .select_from(limit_slots.join(executions, _e.id == _s.execution_id))
            .where(_s.limit_key == key, _s.execution_id != execution_id, _live_slot(now))
            .scalar_subquery(),
            select(func.count()).where(_s.limit_key == key, _s.taken_at > cutoff).scalar_subquery(),
            select(func.coalesce(func.sum(_s.tokens), 0))
            .where(_s.limit_key == key, _s.taken_at > cutoff)
            .scalar_subquery(),
            select(func.min(_s.taken_at))
            .where(_s.limit_key == key, _s.taken_at > cutoff)
            .scalar_subquery(),
            select(func.count())
            .select_from(limit_waiters.join(executions, _e.id == _w.execution_id))
            .where(others_waiting, ahead)
            .scalar_subquery(),
            select(func.count())
            .select_from(limit_waiters.join(executions, _e.id == _w.execution_id))
            .where(others_waiting)
            .scalar_subquery(),
        )
    ).one()
    oldest = row[3]
    counted = Counted(
        now=now,
        in_flight=int(row[0]),
        recent=int(row[1]),
        recent_tokens=int(row[2]),
        oldest=oldest,
        ahead=int(row[4]),
        waiting=int(row[5]),
        paused_until=paused_until,
    )
    return counted, priority, since


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
    conn.execute(
        update(limit_slots)
        .where(_s.execution_id == execution_id, _s.released_at.is_(None))
        .values(released_at=now)
    )
    if waited:
        conn.execute(
            delete(limit_waiters).where(_w.limit_key == key, _w.execution_id == execution_id)
        )
    slot_id: int = conn.execute(
        limit_slots.insert()
        .values(
            limit_key=key,
            execution_id=execution_id,
            version=version,
            attempt=attempt,
            taken_at=now,
            tokens=tokens,
        )
        .returning(_s.id)
    ).scalar_one()
    return slot_id


def wait(
    conn: Connection,
    key: str,
    execution_id: str,
    version: int,
    priority: int,
    since: datetime | None,
    now: datetime,
) -> None:
    """Record (or renew) this run as a waiter, keeping its place in the order (``since``)."""
    values = {"version": version, "priority": priority, "seen_at": now, "woken_at": None}
    stmt = (
        _dialect(conn)
        .insert(limit_waiters)
        .values(limit_key=key, execution_id=execution_id, since=since or now, **values)
    )
    conn.execute(
        stmt.on_conflict_do_update(index_elements=[_w.limit_key, _w.execution_id], set_=values)
    )


@dataclass(frozen=True)
class Woken:
    execution_id: str
    version: int


def release(
    conn: Connection,
    key: str,
    slot_id: int,
    tokens: int | None,
    now: datetime,
    stale: timedelta,
    wake: int,
    woken_grace: timedelta,
) -> list[Woken]:
    """The request is answered (or failed): its slot stops counting as in flight, its tokens
    become what the provider reported. Returns the first ``wake`` waiters of the limit, free to
    run (no lease) and not woken in the last ``woken_grace`` (another release's: the next
    release wakes the one after it), whose call_model tick the caller publishes."""
    values: dict[str, Any] = {"released_at": now}
    if tokens is not None:
        values["tokens"] = tokens
    conn.execute(
        update(limit_slots).where(_s.id == slot_id, _s.released_at.is_(None)).values(**values)
    )
    conn.execute(
        delete(limit_slots).where(
            _s.limit_key == key,
            _s.taken_at < now - WINDOW,
            or_(_s.released_at.is_not(None), _s.taken_at < now - FORGET),
        )
    )
    if wake <= 0:
        return []
    rows = conn.execute(
        select(_w.execution_id, _w.version)
        .select_from(limit_waiters.join(executions, _e.id == _w.execution_id))
        .where(
            _fresh_waiter(key, now, stale),
            or_(_e.lease_until.is_(None), _e.lease_until < now),
            or_(_w.woken_at.is_(None), _w.woken_at < now - woken_grace),
        )
        .order_by(_w.priority.desc(), _w.since, _w.execution_id)
        .limit(wake)
    ).all()
    if rows:
        conn.execute(
            update(limit_waiters)
            .where(_w.limit_key == key, _w.execution_id.in_([r.execution_id for r in rows]))
            .values(woken_at=now)
        )
    return [Woken(r.execution_id, r.version) for r in rows]


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


def statuses(conn: Connection, now: datetime, stale: timedelta) -> list[LimitStatus]:
    """Every limit used so far: what is in flight, waiting, sent in the last minute."""
    out = []
    for row in conn.execute(select(_l.limit_key, _l.paused_until, _l.throttles)).all():
        key = row.limit_key
        in_flight = conn.execute(
            select(func.count())
            .select_from(limit_slots.join(executions, _e.id == _s.execution_id))
            .where(_s.limit_key == key, _live_slot(now))
        ).scalar_one()
        waiting = conn.execute(
            select(func.count())
            .select_from(limit_waiters.join(executions, _e.id == _w.execution_id))
            .where(_fresh_waiter(key, now, stale))
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
