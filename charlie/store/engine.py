"""Engines per backend, and the transaction helpers every writer uses.

SQLite needs care to behave under several processes: WAL so readers never block the writer, a
busy timeout so a writer waits instead of failing, and ``BEGIN IMMEDIATE`` for write transactions
(Python's sqlite3 opens deferred ones, which fail with "database is locked" when they upgrade).
"""

from __future__ import annotations

import fcntl
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()
_migrated: set[str] = set()


def _sqlite_engine(url: str) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide when transactions begin (see "begin" below).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = "DEFERRED" if conn.get_execution_options().get("readonly") else "IMMEDIATE"
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


def get_engine(url: str) -> Engine:
    """One engine per URL per process (the engine is the pool; it is this process's state)."""
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            if url.startswith("sqlite"):
                engine = _sqlite_engine(url)
            else:
                engine = create_engine(
                    url, pool_size=5, max_overflow=10, pool_pre_ping=True, pool_recycle=1800
                )
            _engines[url] = engine
        return engine


def dispose_after_fork() -> None:
    """A forked pool child must not share its parent's connections."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose(close=False)


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """One write transaction; committed on exit, rolled back on error."""
    with engine.begin() as conn:
        yield conn


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    with engine.connect().execution_options(readonly=True) as conn, conn.begin():
        yield conn


def migrations_dir() -> Path:
    return Path(__file__).parent / "migrations"


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (``charlie db upgrade``)."""
    from alembic import command

    cfg = _alembic_config(url)
    cfg.attributes["connection_url"] = url
    command.upgrade(cfg, revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = get_engine(url)
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


class SchemaMissing(RuntimeError):
    pass


def ensure_schema(url: str, *, auto_upgrade: bool, lock_dir: Path | None = None) -> None:
    """Check the schema is current; on the embedded default, bring it up to date first.

    Several processes (a worker, beat, the CLI) may start at once on a fresh SQLite file, so the
    upgrade runs under a file lock.
    """
    if url in _migrated:
        return
    head = head_revision()
    if current_revision(url) != head:
        if not auto_upgrade:
            raise SchemaMissing(
                f"the database {make_url(url).render_as_string(hide_password=True)} is not at "
                f"Charlie's schema revision {head}; run `charlie db upgrade` first"
            )
        lock_path = (lock_dir or Path(".")) / ".migrate.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if current_revision(url) != head:
                    log.info("applying migrations to %s", url)
                    upgrade(url)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    _migrated.add(url)


__all__ = ["dispose_after_fork", "ensure_schema", "get_engine", "read", "upgrade", "write"]
