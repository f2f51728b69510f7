"""Charlie's default PostgreSQL path through a PgBouncer in transaction pooling mode.

Behind transaction pooling, one client's consecutive transactions may run on different server
connections: a statement prepared on the server in one is unknown in the next, or another
client's statement of the same name ("prepared statement "_pg3_0" does not exist", "bind
message supplies 28 parameters, but prepared statement "_pg3_1" requires 7"). psycopg 3
prepares a statement after its fifth execution unless told not to; Charlie's engines tell it
(charlie.store.engine.server_connect_args). The whole production path and the recovery tests
run through a PgBouncer in CI (.ci/run); this is the quick check of the cause, for both drivers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from charlie.store.engine import PREPARED, get_engine
from charlie.store.fused import PREPARED_EXECUTION
from tests.conftest import BACKEND
from tests.support.cluster import free_port
from tests.support.pgbouncer import PgBouncer, pgbouncer_problem


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    if not (BACKEND.database_url or "").startswith("postgresql"):
        pytest.skip("PgBouncer stands in front of PostgreSQL (CHARLIE_TEST_DATABASE_URL)")
    problem = pgbouncer_problem()
    if problem:
        pytest.skip(problem)
    upstream = make_url(BACKEND.database_url or "")
    started = PgBouncer(
        free_port(), upstream.host or "127.0.0.1", upstream.port or 5432, pool_size=4
    ).start()
    yield started
    started.stop()


@pytest.mark.parametrize("driver", ["postgresql", "postgresql+psycopg", "postgresql+psycopg2"])
def test_a_statement_run_often_survives_a_change_of_server_connection(
    bouncer: PgBouncer, driver: str
) -> None:
    # `postgresql://` is psycopg 3 on SQLAlchemy 2.1 (the default a new user writes).
    url = make_url(bouncer.url(BACKEND.database_url or "")).set(
        drivername=driver, database="postgres"
    )
    engine = get_engine(url.render_as_string(hide_password=False))
    statement = text("SELECT CAST(:n AS integer) + 1")
    try:
        with engine.connect() as first, engine.connect() as second:
            # More than psycopg 3's prepare threshold (5), each in a transaction of its own,
            # on the only server connection there is so far.
            for n in range(8):
                assert first.execute(statement, {"n": n}).scalar() == n + 1
                first.commit()
            # Another client holds that server connection in an open transaction ...
            assert second.execute(text("SELECT 1")).scalar() == 1
            # ... so the next transaction of the first runs on another one.
            assert first.execute(statement, {"n": 41}).scalar() == 42
            first.commit()
            second.commit()
            # and back on the first server connection, the same still works
            for n in range(8):
                assert second.execute(statement, {"n": n}).scalar() == n + 1
                second.commit()
    finally:
        engine.dispose()


def test_a_fused_commit_through_pgbouncer_is_never_prepared(bouncer: PgBouncer) -> None:
    """CHARLIE_DB_PREPARE=auto: the server sees PgBouncer's connection, not the client's, so
    the statements a turn prepares on a direct connection run unprepared here, and keep
    working when the next transaction lands on another server connection."""
    url = make_url(bouncer.url(BACKEND.database_url or "")).set(
        database="postgres", query={"application_name": "charlie-prepare-auto"}
    )
    engine = get_engine(url.render_as_string(hide_password=False))
    statement = "SELECT CAST(%(n)s AS integer) + 1"
    try:
        with engine.connect() as first, engine.connect() as second:
            assert first.info[PREPARED] is False
            auto = first.execution_options(isolation_level="AUTOCOMMIT")
            for n in range(8):
                assert auto.exec_driver_sql(statement, {"n": n}, PREPARED_EXECUTION).scalar() == (
                    n + 1
                )
            assert second.execute(text("SELECT 1")).scalar() == 1  # holds a server connection
            assert auto.exec_driver_sql(statement, {"n": 41}, PREPARED_EXECUTION).scalar() == 42
            second.commit()
    finally:
        engine.dispose()
