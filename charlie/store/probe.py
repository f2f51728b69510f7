"""What `charlie doctor` asks of a database it may not be able to reach: a URL fit to print,
where an SQLite URL's file is, one connection with a timeout, and the migration it is at.

Apart from the engines of engine.py: a check connects once, with a short timeout, and must not
create or migrate anything.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.engine import make_url

from charlie.store.engine import server_connect_args, server_version


def printable_url(url: str) -> str:
    """A URL (a database's or a broker's) as it may be printed: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1] if "@" in url else url


def sqlite_file(url: str) -> str | None:
    """The file an SQLite URL names; None for an in-memory database."""
    path = make_url(url).database
    return path if path and path != ":memory:" else None


def connect_once(url: str, timeout: float) -> tuple[Engine, str]:
    """An engine for ``url`` that has connected once, and the server's version. Raises what
    the driver raised (ImportError: the driver is not installed)."""
    args: dict[str, Any] = {}
    if url.startswith("postgresql"):
        # server_connect_args: safe behind a transaction-pooling PgBouncer, as the workers are
        args["connect_args"] = {**server_connect_args(url), "connect_timeout": max(1, int(timeout))}
    engine = create_engine(url, **args)
    with engine.connect() as conn:
        return engine, server_version(conn)


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at; None when it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        revision: str | None = MigrationContext.configure(conn).get_current_revision()
        return revision


_CONNECTIONS = (
    "SELECT count(*) FILTER (WHERE backend_type = 'client backend'), "
    "count(*) FILTER (WHERE backend_type = 'client backend' AND datname = current_database()), "
    "current_setting('max_connections')::int, "
    "current_setting('superuser_reserved_connections')::int, inet_server_port() "
    "FROM pg_stat_activity"
)


def connection_counts(engine: Engine) -> tuple[int, int, int, int, int | None]:
    """PostgreSQL's client connections (all, this database's), max_connections, the
    superusers' reserve and the port the server listens on (not the URL's behind a pooler)."""
    with engine.connect() as conn:
        in_use, here, limit, reserved, port = conn.execute(text(_CONNECTIONS)).one()
    return int(in_use), int(here), int(limit), int(reserved), port


def port_of(url: str) -> int:
    """The port a PostgreSQL URL names (5432 when it names none)."""
    return make_url(url).port or 5432
