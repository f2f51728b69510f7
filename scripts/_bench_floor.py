"""The floor: a bare Celery chain that does the least a Charlie tick must do, and no more.

Every link reads and locks one row, updates it, commits, and publishes the next link. No Charlie
code runs in a link: the app takes Celery's settings from the same ``celeryconfig`` module as
Charlie's workers (so the same broker URL and transport, acks_late, prefetch 1, JSON, task
events as configured), on its own queue. The database work goes through SQLAlchemy Core, as
Charlie's does, with the same SQLite pragmas (WAL, synchronous=NORMAL, ``BEGIN IMMEDIATE``);
on PostgreSQL the row is locked with ``SELECT ... FOR UPDATE``.

Worker: ``celery -A _bench_floor worker -Q bench_floor`` with ``BENCH_FLOOR_DATABASE_URL``
set and ``scripts/`` on PYTHONPATH. The benchmark creates the table and publishes each chain's
first link with :func:`start_chains`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Engine, create_engine, event, text

QUEUE = "bench_floor"
TABLE = "bench_floor_chain"

app = Celery("bench_floor")
app.config_from_object("celeryconfig")
app.conf.task_default_queue = QUEUE
app.conf.beat_schedule = {}
if os.environ.get("BENCH_FLOOR_BROKER_DIR") and app.conf.broker_url.startswith("charliefs"):
    # The embedded broker: Charlie's transport (celeryconfig registered it), with its own queue
    # directory, so neither worker lists the other's messages.
    from charlie.broker import transport_options

    app.conf.broker_transport_options = transport_options(
        Path(os.environ["BENCH_FLOOR_BROKER_DIR"]),
        app.conf.broker_transport_options["polling_interval"],
    )

_engine: Engine | None = None
_engine_pid = 0


def make_engine(url: str) -> Engine:
    """An engine configured as Charlie configures its own (pool size; SQLite pragmas)."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_size=5, max_overflow=10, pool_use_lifo=True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def engine() -> Engine:
    """This process's engine; a forked pool child makes its own."""
    global _engine, _engine_pid
    if _engine is None or _engine_pid != os.getpid():
        _engine = make_engine(os.environ["BENCH_FLOOR_DATABASE_URL"])
        _engine_pid = os.getpid()
    return _engine


def create_table(eng: Engine) -> None:
    with eng.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {TABLE}")
        conn.exec_driver_sql(
            f"CREATE TABLE {TABLE} (id VARCHAR(64) PRIMARY KEY, n INTEGER NOT NULL, "
            "total INTEGER NOT NULL, started_at DOUBLE PRECISION NOT NULL, "
            "updated_at DOUBLE PRECISION, done_at DOUBLE PRECISION)"
        )


def _select_sql(eng: Engine) -> Any:
    lock = "" if eng.dialect.name == "sqlite" else " FOR UPDATE"
    return text(f"SELECT n, total FROM {TABLE} WHERE id = :id{lock}")


_UPDATE = text(
    f"UPDATE {TABLE} SET n = n + 1, updated_at = :now, "
    "done_at = CASE WHEN :done THEN :now ELSE done_at END WHERE id = :id"
)


@app.task(name="bench_floor.link", ignore_result=True)  # type: ignore[untyped-decorator]
def link(chain_id: str, n: int) -> str:
    """One link: lock the chain's row, check it is at ``n``, move it to ``n + 1``, commit, and
    publish the next link unless the chain is done. A stale or duplicate link does nothing."""
    eng = engine()
    with eng.begin() as conn:
        row = conn.execute(_select_sql(eng), {"id": chain_id}).first()
        if row is None or row.n != n:
            return "stale"
        done = n + 1 >= row.total
        conn.execute(_UPDATE, {"id": chain_id, "now": time.time(), "done": done})
    if not done:
        link.delay(chain_id, n + 1)
    return "done" if done else "moved"


def start_chains(eng: Engine, ids: list[str], links: int) -> None:
    """Insert one row per chain and publish each chain's first link."""
    now = time.time()
    with eng.begin() as conn:
        conn.execute(
            text(f"INSERT INTO {TABLE} (id, n, total, started_at) VALUES (:id, 0, :total, :now)"),
            [{"id": i, "total": links, "now": now} for i in ids],
        )
    with app.producer_or_acquire() as producer:
        for chain_id in ids:
            link.apply_async((chain_id, 0), producer=producer)
