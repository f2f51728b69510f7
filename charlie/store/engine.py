"""Engines per backend, and the transaction helpers every writer uses.

SQLite needs care to behave under several processes: WAL so readers never block the writer, a
busy timeout so a writer waits instead of failing, and ``BEGIN IMMEDIATE`` for write transactions
(Python's sqlite3 opens deferred ones, which fail with "database is locked" when they upgrade).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, exc, inspect
from sqlalchemy.engine import make_url

from charlie.home import open_private, private_file
from charlie.store.alembic_config import alembic_config

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()
_migrated: set[str] = set()

#: A pooled connection idle longer than this is pinged before use (see _ping_if_idle).
PING_AFTER_IDLE = 5.0


def _private_sqlite_file(url: str) -> None:
    """Create a SQLite database's file 0600 before SQLite writes a byte (it holds every prompt,
    transcript and result; SQLite gives the -wal and -shm files the database file's mode)."""
    parsed = make_url(url)
    path = parsed.database
    if path and path != ":memory:" and not parsed.query.get("uri"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        private_file(Path(path))


def _sqlite_engine(url: str) -> Engine:
    _private_sqlite_file(url)
    path = make_url(url).database
    # hide_parameters: a failed statement's error (logged, and carried in task events) must not
    # quote its parameters, which hold prompts, transcripts and tool results.
    engine = create_engine(
        url, connect_args={"timeout": 30, "check_same_thread": False}, hide_parameters=True
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide when transactions begin (see "begin" below).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

        # Which database file this is (database_identity): one made again, or copied into
        # place anew, is another file. (No statement: a stat of the file.)
        record.info[IDENTITY] = _file_identity(path)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = "DEFERRED" if conn.get_execution_options().get("readonly") else "IMMEDIATE"
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


@dataclass(frozen=True)
class PoolLimits:
    """How many connections one process's engine may hold to a server database: ``size`` kept
    open, plus up to ``overflow`` opened under load and closed when returned
    (CHARLIE_DB_POOL_SIZE, CHARLIE_DB_MAX_OVERFLOW). The fleet's connection budget is the sum
    over its processes (docs/production/pgbouncer.md)."""

    size: int = 5
    overflow: int = 10

    @property
    def most(self) -> int:
        return self.size + self.overflow


class Prepare(StrEnum):
    """Whether the hot statements (a turn's fused commits) are prepared on the server
    (CHARLIE_DB_PREPARE). ``auto``: on a connection that reaches PostgreSQL itself, not through
    a pooler (see :func:`_reaches_server_directly`); ``on``: always (a PgBouncer of 1.22 or
    later with ``max_prepared_statements`` set keeps them per client); ``off``: never."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


#: a pooled connection's info key: True when its statements marked ``PREPARED_OPTION`` are
#: prepared on the server
PREPARED = "charlie_prepared"
#: the execution option a statement is prepared with, on a connection that allows it
PREPARED_OPTION = "charlie_prepare"
#: psycopg's threshold while a statement asked to be prepared runs: its own count never
#: reaches it (``None``, the connection's threshold otherwise, turns even an explicit prepare
#: off, and an ``executemany``, which psycopg always asks to prepare, with it)
ONLY_WHEN_ASKED = 2**31


def server_connect_args(url: str) -> dict[str, Any]:
    """Driver arguments that keep every connection safe behind a transaction-pooling PgBouncer,
    where consecutive transactions of one client may run on different server connections.

    psycopg 3 prepares a statement on the server after its fifth execution and then refers to
    it by name (``_pg3_0``); on another server connection that name does not exist, or names
    another client's statement ("bind message supplies 28 parameters, but prepared statement
    "_pg3_1" requires 7"). ``prepare_threshold=None`` turns server-side prepares off (a
    connection known to reach PostgreSQL itself turns them on for the fused commits alone:
    _allow_prepared). psycopg2
    never prepares on the server. Nothing else Charlie does outlives a transaction: no SET
    (isolation levels ride on BEGIN), no advisory lock, LISTEN or temporary table, and the pool
    rolls a connection back when it is returned."""
    if make_url(url).get_dialect().driver == "psycopg":
        return {"prepare_threshold": None}
    return {}


def _server_engine(url: str, pool: PoolLimits, prepare: Prepare = Prepare.AUTO) -> Engine:
    # LIFO: a busy worker keeps reusing its warm connection, and the others age out.
    engine = create_engine(
        url,
        pool_size=pool.size,
        max_overflow=pool.overflow,
        pool_use_lifo=True,
        pool_recycle=1800,
        hide_parameters=True,  # see _sqlite_engine
        connect_args=server_connect_args(url),
    )

    def ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        """Pessimistic disconnect handling, but only for connections that sat idle.

        ``pool_pre_ping`` costs a round trip on every checkout, about a third of a tick's
        database time. A connection in steady use is not pinged; one that waited in the pool (a
        producer between submits, a worker after a quiet spell, a database restart) is, and a
        dead one is replaced before anyone uses it. A connection that dies while busy fails its
        statement; the pool then drops every connection older than the failure (SQLAlchemy's
        disconnect handling), and the tick's retry or the sweep takes it from there."""
        last = record.info.get("charlie_used_at")
        if last is not None and time.monotonic() - last < PING_AFTER_IDLE:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as error:
            raise exc.DisconnectionError(f"pooled connection is dead: {error}") from error
        if not alive:
            raise exc.DisconnectionError("pooled connection is dead")

    event.listen(engine, "connect", _mark_used)
    event.listen(engine, "connect", _server_identity)
    if make_url(url).get_dialect().driver == "psycopg" and prepare is not Prepare.OFF:
        event.listen(
            engine, "connect", lambda c, r: _allow_prepared(c, r, always=prepare is Prepare.ON)
        )
        event.listen(engine, "do_execute", _execute_prepared)
    event.listen(engine, "checkout", ping_if_idle)
    event.listen(engine, "checkin", _mark_used)
    return engine


def _mark_used(_dbapi_conn: Any, record: Any) -> None:
    record.info["charlie_used_at"] = time.monotonic()


#: a pooled connection's info key for database_identity
IDENTITY = "charlie_database"

#: the connection's ends as the server sees them, and its process (_reaches_server_directly)
_ENDS = (
    "host(inet_server_addr()), inet_server_port(), host(inet_client_addr()), "
    "inet_client_port(), pg_backend_pid()"
)

#: Which database a server connection reaches, read once when it connects (never per tick): the
#: database's oid (a database dropped and created again under its name gets another) and when
#: the server started (a restored backup or a recreated cluster is served by a server started
#: since). A change of either only costs each run one read of its transcript.
#: The same statement reads the two ends of this connection as the server sees them, and its
#: server process, for _reaches_server_directly (``_ENDS``).
_SERVER_IDENTITY = (
    f"SELECT d.oid, pg_postmaster_start_time(), {_ENDS} FROM pg_database d "
    "WHERE d.datname = current_database()"
)
#: a pooled connection's info key: the connection's ends as the server saw them
_SERVER_ENDS = "charlie_server_ends"


def _server_identity(dbapi_conn: Any, record: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(_SERVER_IDENTITY)
        row = cursor.fetchone()
    finally:
        cursor.close()
        dbapi_conn.rollback()
    record.info[IDENTITY] = ("postgresql", *row[:2]) if row is not None else None
    record.info[_SERVER_ENDS] = tuple(row[2:]) if row is not None else None


def _reaches_server_directly(dbapi_conn: Any, server_ends: tuple[Any, ...] | None) -> bool:
    """Whether this TCP connection ends at PostgreSQL itself: the server's view of the
    connection (its own address and port, the client's) is this socket's, both ends, and the
    server process it reports is the one its startup named to the client (a pooler hands its
    clients a process id and cancel key of its own). Through PgBouncer or any other proxy the
    server sees the proxy's connection, whose ends are not this socket's; through NAT the
    addresses differ too. A Unix socket has no addresses to compare: it counts as not direct
    (``CHARLIE_DB_PREPARE=on`` turns prepares on there)."""
    if not server_ends or None in server_ends:
        return False
    server_addr, server_port, client_addr, client_port, backend_pid = server_ends
    if backend_pid != dbapi_conn.info.backend_pid:
        return False
    try:
        with socket.socket(fileno=os.dup(dbapi_conn.pgconn.socket)) as sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            mine, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return False
    return (_host(mine[0]), mine[1], _host(peer[0]), peer[1]) == (
        _host(client_addr),
        client_port,
        _host(server_addr),
        server_port,
    )


def prepares_fused_commits(conn: Connection, prepare: Prepare) -> bool | None:
    """Whether a worker's connection like ``conn`` prepares the fused commits under
    ``prepare`` (what ``charlie doctor`` reports); None when its driver never prepares on the
    server (psycopg2, SQLite)."""
    if conn.dialect.name != "postgresql" or conn.dialect.driver != "psycopg":
        return None
    if prepare is not Prepare.AUTO:
        return prepare is Prepare.ON
    ends = conn.exec_driver_sql(f"SELECT {_ENDS}").one()
    return _reaches_server_directly(conn.connection.dbapi_connection, tuple(ends))


def _host(address: str) -> str:
    """An address as one spelling: an IPv4 address mapped into IPv6 as its IPv4 form."""
    return address.removeprefix("::ffff:").lower()


def _allow_prepared(dbapi_conn: Any, record: Any, *, always: bool) -> None:
    """Prepare the hot statements on a connection that reaches PostgreSQL itself (or always,
    ``CHARLIE_DB_PREPARE=on``). A prepared statement's name lives on one server connection:
    behind a transaction-pooling PgBouncer older than 1.22, or without its
    ``max_prepared_statements``, the next transaction may run on another server connection
    where the name is missing or names another client's statement (server_connect_args)."""
    # only the statements asked to (_execute_prepared); the rest as before: parsed each time
    record.info[PREPARED] = always or _reaches_server_directly(
        dbapi_conn, record.info.get(_SERVER_ENDS)
    )


def _execute_prepared(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    """A statement executed with the ``PREPARED_OPTION`` on a connection that allows it is
    prepared on the server at its first execution and bound by name from then on: PostgreSQL
    neither parses nor plans it again (a fused commit is 2 to 4 KB of SQL: parsing and
    planning it took longer than running it). Returns False to let the dialect execute any
    other statement as usual."""
    if not context.execution_options.get(PREPARED_OPTION):
        return False
    if not context.root_connection.info.get(PREPARED):
        return False
    connection = cursor.connection
    connection.prepare_threshold = ONLY_WHEN_ASKED
    try:
        cursor.execute(statement, parameters, prepare=True)
    finally:
        connection.prepare_threshold = None
    return True


def _file_identity(path: str | None) -> object:
    if not path or path == ":memory:":
        return ("memory", uuid.uuid4().hex)  # a database of this connection alone
    try:
        stat = os.stat(path)
    except OSError:
        return ("sqlite", path, uuid.uuid4().hex)  # (created by this connection just now)
    return ("sqlite", stat.st_dev, stat.st_ino)


def database_identity(conn: Connection) -> object:
    """Which database ``conn`` reaches, as read when its DBAPI connection was made; None when
    not known (a connection from another engine)."""
    return conn.info.get(IDENTITY)


def get_engine(url: str, pool: PoolLimits | None = None, prepare: Prepare = Prepare.AUTO) -> Engine:
    """One engine per URL per process (the engine is the pool; it is this process's state).
    ``pool``: its limits on a server database, taken by the call that makes the engine (a
    process's runtime makes it first, with its settings)."""
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            if url.startswith("sqlite"):
                engine = _sqlite_engine(url)
            else:
                engine = _server_engine(url, pool or PoolLimits(), prepare)
            _engines[url] = engine
        return engine


def dispose_after_fork() -> None:
    """A forked pool child must not share its parent's connections."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose(close=False)


def again_if_disconnected(work: Callable[[], T], what: str) -> T:
    """Run ``work``; if its connection turned out dead (the database restarted since the pool
    last used it), run it once more on a fresh one. ``work`` must be safe to repeat: it holds
    its own transaction, which the failure rolled back or, at worst, committed just before."""
    try:
        return work()
    except exc.DBAPIError as error:
        if not error.connection_invalidated:
            raise
        log.warning("database connection lost; trying again to %s", what)
        return work()


def sqlstate(error: exc.DBAPIError) -> str | None:
    """The SQLSTATE of a database error, from psycopg 3 (``sqlstate``) or psycopg2
    (``pgcode``); None from a driver that has neither (SQLite)."""
    orig = error.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return str(code) if code else None


def retried_if_disconnected(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorate a function whose whole work may run again after a lost connection (see
    :func:`again_if_disconnected`): the public API's reads and idempotent writes."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        return again_if_disconnected(lambda: fn(*args, **kwargs), fn.__name__)

    return wrapper


@contextmanager
def write(
    engine: Engine, after_commit: Callable[[Connection], None] | None = None
) -> Iterator[Connection]:
    """One write transaction; committed on exit, rolled back on error. ``after_commit`` runs
    on the connection once its COMMIT has returned (a fault point: a connection lost after the
    server committed, which the caller must read back, never assume)."""
    with engine.connect() as conn:
        with conn.begin():
            yield conn
        if after_commit is not None:
            after_commit(conn)


def lose_connection(conn: Connection) -> None:
    """Terminate this connection's own server backend (a fault point's action, PostgreSQL):
    the statement raises the driver's own error for a lost connection."""
    conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")


@contextmanager
def write_one(engine: Engine) -> Iterator[Connection]:
    """A connection for one self-contained write statement.

    On a server database the statement runs in autocommit: it is its own transaction, without
    the BEGIN and COMMIT round trips. SQLite takes its write lock in ``BEGIN IMMEDIATE`` and
    pays nothing for the extra statements, so there it is an ordinary write transaction."""
    if engine.dialect.name == "sqlite":
        with write(engine) as conn:
            yield conn
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        yield conn


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    with engine.connect().execution_options(readonly=True) as conn, conn.begin():
        yield conn


def server_version(conn: Connection) -> str:
    """The database server's version, e.g. ``15.4`` or SQLite's ``3.40.1``."""
    sql = "select sqlite_version()" if conn.dialect.name == "sqlite" else "show server_version"
    return str(conn.exec_driver_sql(sql).scalar()).split()[0]


def upgrade(url: str, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` (``charlie db upgrade``)."""
    from alembic import command

    if url.startswith("sqlite"):
        _private_sqlite_file(url)  # Alembic opens it with an engine of its own
    cfg = alembic_config(url)
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

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
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
            from charlie.store.revisions import check_schema

            with get_engine(url).connect() as conn:
                fit = check_schema(conn)
            if fit.can_claim:  # a newer schema this code still works on (rolling upgrades)
                _migrated.add(url)
                return
            raise SchemaMissing(
                f"the database {make_url(url).render_as_string(hide_password=True)} does not "
                f"fit this code: {fit.why}"
            )
        lock_path = (lock_dir or Path(".")) / ".migrate.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(open_private(lock_path, os.O_WRONLY), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if current_revision(url) != head:
                    log.info("applying migrations to %s", url)
                    upgrade(url)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    _migrated.add(url)


__all__ = [
    "PoolLimits",
    "again_if_disconnected",
    "database_identity",
    "dispose_after_fork",
    "ensure_schema",
    "get_engine",
    "lose_connection",
    "read",
    "retried_if_disconnected",
    "server_connect_args",
    "sqlstate",
    "upgrade",
    "write",
    "write_one",
]
