"""Heartbeats: when a periodic piece of the deployment (a sweep) last did its work.

One row per name, overwritten in place; `charlie doctor` reads them to tell whether a beat is
driving recovery without needing the broker.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite

from charlie.store.schema import heartbeats


@dataclass(frozen=True)
class Heartbeat:
    name: str
    at: datetime
    worker: str


def record_heartbeat(conn: Connection, name: str, worker: str, now: datetime) -> None:
    """Upsert ``name``'s heartbeat: one statement, whichever process wrote it last wins."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(heartbeats).values(name=name, at=now, worker=worker)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[heartbeats.c.name], set_={"at": now, "worker": worker}
        )
    )


def load_heartbeats(conn: Connection) -> dict[str, Heartbeat]:
    h = heartbeats.c
    rows = conn.execute(select(h.name, h.at, h.worker)).all()
    return {r.name: Heartbeat(r.name, r.at, r.worker) for r in rows}
