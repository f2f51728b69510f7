"""The connection budget: each process's pool is bounded by CHARLIE_DB_POOL_SIZE +
CHARLIE_DB_MAX_OVERFLOW, and `charlie doctor` reports the connections in use against
PostgreSQL's max_connections, warning when the running fleet could exceed it."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from charlie.config import load_settings
from charlie.runtime import database_engine
from tests.conftest import BACKEND, wait_for
from tests.integration.test_production_path import doctor
from tests.support.cluster import Cluster

APP = "charlie-budget-test"


def _connected(url: str) -> int:
    from sqlalchemy import create_engine, pool

    probe = create_engine(url, poolclass=pool.NullPool)
    try:
        with probe.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"),
                    {"a": APP},
                ).scalar()
                or 0
            )
    finally:
        probe.dispose()


def test_a_process_pool_holds_at_most_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (BACKEND.database_url or "").startswith("postgresql"):
        pytest.skip("a server database's pool (SQLite has no connection limit)")
    # An engine of its own (the URL names the application), made as a process's runtime
    # makes it, from its settings.
    url = make_url(BACKEND.database_url or "").update_query_dict({"application_name": APP})
    monkeypatch.setenv("CHARLIE_DATABASE_URL", url.render_as_string(hide_password=False))
    monkeypatch.setenv("CHARLIE_DB_POOL_SIZE", "2")
    monkeypatch.setenv("CHARLIE_DB_MAX_OVERFLOW", "1")
    engine = database_engine(load_settings())
    plain = BACKEND.database_url or ""
    held = [engine.connect() for _ in range(3)]
    try:
        for conn in held:
            conn.execute(text("SELECT 1"))
        port = held[0].execute(text("SELECT inet_server_port()")).scalar()
        if port == (make_url(plain).port or 5432):  # (behind a pooler, PostgreSQL sees its pool)
            assert wait_for(lambda: _connected(plain) == 3, 10, 0.1)
        fourth: list[object] = []
        waiter = threading.Thread(target=lambda: fourth.append(engine.connect()), daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert not fourth, "a fourth connection was opened past 2 + 1"
        held.pop().close()  # one returned: the waiting checkout gets it
        waiter.join(10)
        assert fourth, "the waiting checkout did not get the returned connection"
        held.append(fourth[0])  # type: ignore[arg-type]
        assert engine.pool.checkedout() == 3
    finally:
        for conn in held:
            conn.close()
        engine.dispose()


def test_doctor_reports_connections_and_warns_when_the_fleet_could_exceed_them(
    cluster: Cluster,
) -> None:
    if not (BACKEND.database_url or "").startswith("postgresql"):
        pytest.skip("PostgreSQL's max_connections (SQLite has no connection limit)")
    _, checks = doctor(cluster.settings_env)
    line = checks["connections"]
    assert line["status"] in ("ok", "WARN"), line
    assert "of max_connections" in line["detail"], line
    assert "a process here may hold 15 (CHARLIE_DB_POOL_SIZE 5 + " in line["detail"], line
    # Workers whose pools could take far more than the server allows (3 processes each).
    with cluster.configured(CHARLIE_DB_POOL_SIZE="100", CHARLIE_DB_MAX_OVERFLOW="10"):

        def warned() -> dict[str, str] | None:
            found = doctor(cluster.settings_env)[1]["connections"]
            pooled = "through a pooler" in found["detail"]
            wanted = "may open 770 (2 worker(s) and a beat)" in found["detail"]
            return found if wanted and (pooled or found["status"] == "WARN") else None

        found = wait_for(warned, 60, 1)
    if "through a pooler" in found["detail"]:
        assert found["status"] == "ok" and "max_client_conn" in found["detail"], found
    else:
        assert "could exceed max_connections" in found["detail"], found
        assert "PgBouncer" in found["fix"], found
