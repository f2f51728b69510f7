"""Heartbeats: when a periodic piece of the deployment (a sweep) last did its work.

One row per name, overwritten in place; `charlie doctor` reads them to tell whether a beat is
driving recovery without needing the broker.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from charlie.store.schema import heartbeats

#: the sweeps' heartbeats, by name: `charlie beat` (or a worker) records them, doctor reads them.
SWEEP_NAMES = ("sweep.stalled_runs", "sweep.tool_calls", "sweep.task_timeouts")

#: the heartbeats of workers are named this, then their node name.
WORKER_PREFIX = "worker:"
#: a worker whose settle that completes a turn stores a wake-up on the run (migration 0016's
#: release and later) says so in a heartbeat of this name, then its node, beside its own: a
#: live worker without one is of an earlier release, whose lost await ticks only a probe finds
SETTLE_WAKES_PREFIX = "settle-wakes:"


@dataclass(frozen=True)
class Heartbeat:
    name: str
    at: datetime
    worker: str
    detail: str | None = None


def record_heartbeat(
    conn: Connection, name: str, worker: str, now: datetime, detail: str | None = None
) -> None:
    """Upsert ``name``'s heartbeat: one statement, whichever process wrote it last wins."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    values = {"at": now, "worker": worker, "detail": detail}
    stmt = dialect.insert(heartbeats).values(name=name, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=[heartbeats.c.name], set_=values))


def load_heartbeats(conn: Connection) -> dict[str, Heartbeat]:
    h = heartbeats.c
    rows = conn.execute(select(h.name, h.at, h.worker, h.detail)).all()
    return {r.name: Heartbeat(r.name, r.at, r.worker, r.detail) for r in rows}


def forget_heartbeat(conn: Connection, name: str) -> None:
    """A worker that shuts down cleanly says so: doctor then does not count it alive."""
    conn.execute(delete(heartbeats).where(heartbeats.c.name == name))


def earlier_release_about(conn: Connection, since: datetime, waiting: str) -> bool:
    """Whether a worker of a release before settle wake-ups has beaten since ``since``: a
    worker heartbeat without its ``SETTLE_WAKES_PREFIX`` one (one waiting for the schema,
    its detail starting with ``waiting``, claims nothing and settles nothing)."""
    beats = load_heartbeats(conn)
    return any(
        name.startswith(WORKER_PREFIX)
        and beat.at >= since
        and not (beat.detail or "").startswith(waiting)
        and SETTLE_WAKES_PREFIX + name.removeprefix(WORKER_PREFIX) not in beats
        for name, beat in beats.items()
    )
