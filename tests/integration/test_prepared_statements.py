"""A turn's fused commits are prepared on PostgreSQL when the connection reaches it directly
(CHARLIE_DB_PREPARE): parsed and planned once per connection instead of at every turn.

A prepared statement's name lives on one server connection, so a connection that may be
handed another server connection between transactions (PgBouncer in transaction pooling:
tests/integration/test_pgbouncer.py) must never use one; the engine tells the two apart by
comparing both ends of its socket with the server's view of them. What a turn commits is the
same either way: the whole suite runs on PostgreSQL with prepares on (a direct connection),
and through PgBouncer with them off, the recovery tests killing workers in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import make_url

from charlie import doctor
from charlie.config import load_settings
from charlie.doctor import Context
from charlie.store.engine import PREPARED, Prepare, get_engine
from charlie.store.fused import PREPARED_EXECUTION
from tests.conftest import BACKEND
from tests.support.databases import own_database

pytestmark = pytest.mark.skipif(
    not (BACKEND.database_url or "").startswith("postgresql"),
    reason="prepared statements are PostgreSQL's (CHARLIE_TEST_DATABASE_URL)",
)

STATEMENT = "SELECT CAST(%(n)s AS integer) * 2 AS doubled"


@pytest.fixture(scope="module")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database of this module's own: these tests start no cluster, so the
    session's database may not exist yet when they run first."""
    with own_database(tmp_path_factory, "prepared") as engine:
        yield engine.url.render_as_string(hide_password=False)


@contextmanager
def engine_for(
    database_url: str, tag: str, prepare: Prepare, unix_sockets: Path | None = None
) -> Iterator[Engine]:
    """An engine of its own (engines are cached per URL: the tag makes the URL unique), over
    TCP as ``database_url`` says or through the Unix socket in ``unix_sockets``."""
    url = make_url(database_url)
    query = {**url.query, "application_name": f"charlie-test-{tag}"}
    if unix_sockets is not None:
        url, query = url.set(host=None), {**query, "host": str(unix_sockets)}
    engine = get_engine(url.set(query=query).render_as_string(hide_password=False), prepare=prepare)
    try:
        yield engine
    finally:
        engine.dispose()


def prepared_here(conn: Connection) -> list[str]:
    """The statements prepared in this connection's server session."""
    rows = conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements").all()
    return [str(row[0]) for row in rows]


def run_many(conn: Connection, times: int = 8, prepared: bool = True) -> None:
    options = PREPARED_EXECUTION if prepared else {}
    for n in range(times):
        assert conn.exec_driver_sql(STATEMENT, {"n": n}, options).scalar() == 2 * n


def test_a_direct_connection_prepares_the_statements_asked_to_and_no_others(
    database_url: str,
) -> None:
    with engine_for(database_url, "direct", Prepare.AUTO) as engine, engine.connect() as conn:
        assert conn.info[PREPARED] is True
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        # past psycopg's own threshold (5): a statement not asked to stays unprepared
        run_many(auto, prepared=False)
        assert prepared_here(auto) == []
        run_many(auto)
        assert prepared_here(auto) == ["SELECT CAST($1 AS integer) * 2 AS doubled"]


def test_an_executemany_is_not_prepared_beside_a_statement_that_is(database_url: str) -> None:
    # psycopg asks to prepare every executemany: only the statements Charlie asks for are
    with engine_for(database_url, "many", Prepare.AUTO) as engine, engine.connect() as conn:
        many = [{"n": n} for n in range(8)]
        conn.exec_driver_sql(STATEMENT, many)
        assert prepared_here(conn) == []
        run_many(conn)
        conn.exec_driver_sql(STATEMENT.replace("2", "3"), many)
        assert prepared_here(conn) == ["SELECT CAST($1 AS integer) * 2 AS doubled"]


def test_off_prepares_nothing(database_url: str) -> None:
    with engine_for(database_url, "off", Prepare.OFF) as engine, engine.connect() as conn:
        assert PREPARED not in conn.info
        run_many(conn)
        assert prepared_here(conn) == []


def test_a_unix_socket_counts_as_not_direct_unless_told(database_url: str) -> None:
    sockets = Path("/var/run/postgresql")
    port = make_url(database_url).port or 5432
    if not (sockets / f".s.PGSQL.{port}").exists():
        pytest.skip(f"no PostgreSQL Unix socket in {sockets} for port {port}")
    unix_auto = engine_for(database_url, "unix-auto", Prepare.AUTO, sockets)
    with unix_auto as engine, engine.connect() as conn:
        assert conn.info[PREPARED] is False
        run_many(conn)
        assert prepared_here(conn) == []
    unix_on = engine_for(database_url, "unix-on", Prepare.ON, sockets)
    with unix_on as engine, engine.connect() as conn:
        assert conn.info[PREPARED] is True
        run_many(conn)
        assert len(prepared_here(conn)) == 1


@pytest.mark.parametrize(
    ("prepare", "said"),
    [
        ("auto", "a turn's commits are prepared on the server (CHARLIE_DB_PREPARE=auto)"),
        ("off", "a turn's commits are not prepared (CHARLIE_DB_PREPARE=off: off)"),
    ],
)
def test_doctor_says_whether_a_turn_is_prepared(
    database_url: str, tmp_path: Path, prepare: str, said: str
) -> None:
    s = replace(load_settings(), home=tmp_path, database_url=database_url)
    check = doctor.check_database(Context(replace(s, db_prepare=prepare), 2.0))
    assert check.status == "ok" and check.detail.endswith(said), check.detail
