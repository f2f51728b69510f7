"""A database that refuses a write loses nothing: the tick's work is not half-written, the
refusal is kept as evidence, and the run goes on once the database accepts writes again."""

from __future__ import annotations

import re
import threading
import time
import uuid

import psycopg
import pytest
from sqlalchemy import select, text

import charlie
from charlie import api
from charlie.domain import TaskStatus, execution_id_for
from charlie.runtime import get_runtime
from charlie.store.engine import read
from charlie.store.schema import executions, tasks
from tests.conftest import wait_for
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def refuse_inserts(table: str, execution_id: str, when: str = "") -> tuple[list[str], list[str]]:
    """SQL to install and remove a trigger refusing this run's inserts into ``table`` (and,
    with ``when``, only those rows matching that extra condition on NEW). The trigger is named
    after the run, so one left by a test that died before its cleanup refuses only its own run's
    writes and never collides with the next test's."""
    name = "refuse_" + re.sub(r"[^a-z0-9]", "_", execution_id.lower())
    if get_runtime().settings.is_sqlite:
        install = [
            f"""CREATE TRIGGER {name} BEFORE INSERT ON {table}
                WHEN NEW.execution_id = '{execution_id}' {when}
                BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END"""
        ]
        return install, [f"DROP TRIGGER {name}"]
    install = [
        f"""CREATE OR REPLACE FUNCTION {name}() RETURNS trigger AS $$
            BEGIN
              IF NEW.execution_id = '{execution_id}' {when} THEN
                RAISE EXCEPTION 'refused by the test trigger';
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql""",
        f"""CREATE TRIGGER {name} BEFORE INSERT ON {table}
           FOR EACH ROW EXECUTE FUNCTION {name}()""",
    ]
    return install, [f"DROP TRIGGER {name} ON {table}", f"DROP FUNCTION {name}()"]


def refuse_transcript_writes(execution_id: str) -> tuple[list[str], list[str]]:
    return refuse_inserts("transcript_items", execution_id)


def run_sql(statements: list[str]) -> None:
    with get_runtime().engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def test_refused_write_is_recorded_and_the_run_continues(cluster: Cluster, script) -> None:
    task_id = f"refused-{uuid.uuid4().hex[:8]}"
    xid = execution_id_for(task_id)
    install, remove = refuse_transcript_writes(xid)
    run_sql(install)
    try:
        model, _ = script([{"say": "written at last"}])
        charlie.submit("refused", model=model, task_id=task_id)

        def recorded_error() -> dict | None:
            with read(get_runtime().engine) as conn:
                row = conn.execute(
                    select(executions.c.error, executions.c.attempts, executions.c.version).where(
                        executions.c.id == xid
                    )
                ).first()
            return row if row is not None and row.error else None

        row = wait_for(recorded_error, timeout=30)
    finally:
        run_sql(remove)
    assert "refused by the test trigger" in row.error["message"]
    assert row.error["phase"] == "load_context"
    assert row.version == 0 and row.attempts >= 1  # nothing half-written, the attempt counted
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result["answer"] == "written at last"
    assert [i.seq for i in charlie.transcript(task_id)] == [0, 1, 2]


def test_a_write_refused_every_time_ends_in_report_failure_saying_why(
    cluster: Cluster, script
) -> None:
    task_id = f"refused-{uuid.uuid4().hex[:8]}"
    install, remove = refuse_transcript_writes(execution_id_for(task_id))
    run_sql(install)
    try:
        model, _ = script([{"say": "never"}])
        charlie.submit("refused forever", model=model, task_id=task_id)
        info = charlie.wait(task_id, timeout=90)
    finally:
        run_sql(remove)
    assert info.status is TaskStatus.FAILED
    assert info.error["type"] == "PoisonMessage", info.error
    assert "refused by the test trigger" in info.error["message"]
    assert "refused by the test trigger" in info.error["last_error"]["message"]


def test_a_refused_await_tick_does_not_lose_its_tool_result(
    cluster: Cluster, script, workspace
) -> None:
    """I12, I3: a turn's only call runs in the worker that dispatched it, and its result is
    settled in the await tick's transaction. When the database refuses that transaction, the
    result is settled on its own: the call keeps the outcome its handler produced (not
    `interrupted` by the sweep), and the run goes on once writes are accepted again."""
    task_id = f"refused-await-{uuid.uuid4().hex[:8]}"
    install, remove = refuse_inserts(
        "transitions", execution_id_for(task_id), "AND NEW.to_phase = 'advance_turn'"
    )
    run_sql(install)
    try:
        model, _ = script(
            [
                {"tool_calls": [{"id": "ls", "name": "list_files", "arguments": {}}]},
                {"say": "listed"},
            ]
        )
        charlie.submit(
            "refused await", model=model, task_id=task_id, metadata={"workspace": str(workspace)}
        )
        call = wait_for(
            lambda: next((c for c in api.calls(task_id) if c.state == "settled"), None), timeout=30
        )
    finally:
        run_sql(remove)
    assert call.outcome == "ok", call
    assert call.settled_by == call.started_by  # the worker that ran it, not the sweep
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok"


def test_connections_dropped_by_the_database_cost_nothing(cluster: Cluster, script) -> None:
    """A database restart closes every pooled connection. Workers ping only connections that
    sat idle, so a busy one fails its next statement: the tick or invocation runs again on a
    fresh connection, and producers' reads retry too. The run finishes with a dense
    transcript, and no ping is paid on connections in steady use."""
    rt = get_runtime()
    if rt.settings.is_sqlite:
        pytest.skip("SQLite has no server connections to drop")
    turns = [
        {
            "tool_calls": [
                {
                    "id": f"s{n}",
                    "name": "sleep_then",
                    "arguments": {"seconds": 0.05, "value": str(n)},
                }
            ]
        }
        for n in range(12)
    ]
    model, _ = script([*turns, {"say": "survived"}])
    task_id = charlie.submit("drops", model=model, tools=["sleep_then"])
    database = rt.engine.url.database
    stop = threading.Event()
    dropped: list[int] = []

    def drop_connections() -> None:
        url = rt.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        admin = psycopg.connect(url, autocommit=True)
        with admin:
            while not stop.wait(0.25):
                rows = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                ).fetchall()
                dropped.append(len(rows))

    dropper = threading.Thread(target=drop_connections, daemon=True)
    dropper.start()
    try:
        time.sleep(2.0)
    finally:
        stop.set()
        dropper.join(timeout=10)
    assert sum(dropped) > 0, "the test dropped no connection"
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "survived"
    seqs = [i.seq for i in charlie.transcript(task_id)]
    assert seqs == list(range(len(seqs)))


def test_a_producer_survives_a_connection_the_database_dropped(cluster: Cluster, script) -> None:
    """A producer's pooled connection, killed by the database while it sat in the pool for less
    than the ping interval, fails its next statement: submit, a task's read and cancel run
    again on a fresh one, and the submit saves one task, not two (its id is fixed before the
    first try)."""
    rt = get_runtime()
    if rt.settings.is_sqlite:
        pytest.skip("SQLite has no server connections to drop")
    url = rt.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def kill_the_pooled_connection() -> None:
        with rt.engine.connect() as conn:  # back in the pool, just used: it will not be pinged
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with psycopg.connect(url, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)

    # Long enough to cancel it running, short enough not to hold a worker from later tests.
    call = {"id": "w", "name": "sleep_then", "arguments": {"seconds": 3, "value": "late"}}
    model, _ = script([{"tool_calls": [call]}, {"say": "never"}])
    prompt = f"dropped before submit {uuid.uuid4().hex}"
    kill_the_pooled_connection()
    task_id = charlie.submit(prompt, model=model)
    wait_for(lambda: any(c.state == "started" for c in api.calls(task_id)))
    with read(rt.engine) as conn:
        saved = conn.execute(select(tasks.c.id).where(tasks.c.prompt == prompt)).all()
    assert [r.id for r in saved] == [task_id]
    kill_the_pooled_connection()  # a read runs again too (what charlie.wait polls)
    assert charlie.get_task(task_id).status is TaskStatus.RUNNING
    kill_the_pooled_connection()
    assert charlie.cancel(task_id) is True
    assert charlie.wait(task_id, timeout=30).status is TaskStatus.CANCELED
