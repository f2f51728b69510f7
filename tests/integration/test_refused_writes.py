"""A database that refuses a write loses nothing: the tick's work is not half-written, the
refusal is kept as evidence, and the run goes on once the database accepts writes again."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select, text

import charlie
from charlie.domain import TaskStatus, execution_id_for
from charlie.runtime import get_runtime
from charlie.store.engine import read
from charlie.store.schema import executions
from tests.conftest import wait_for
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def refuse_transcript_writes(execution_id: str) -> tuple[list[str], list[str]]:
    """SQL to install and remove a trigger refusing this run's transcript inserts."""
    if get_runtime().settings.is_sqlite:
        install = [
            f"""CREATE TRIGGER refuse_writes BEFORE INSERT ON transcript_items
                WHEN NEW.execution_id = '{execution_id}'
                BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END"""
        ]
        return install, ["DROP TRIGGER refuse_writes"]
    install = [
        f"""CREATE OR REPLACE FUNCTION refuse_writes() RETURNS trigger AS $$
            BEGIN
              IF NEW.execution_id = '{execution_id}' THEN
                RAISE EXCEPTION 'refused by the test trigger';
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql""",
        """CREATE TRIGGER refuse_writes BEFORE INSERT ON transcript_items
           FOR EACH ROW EXECUTE FUNCTION refuse_writes()""",
    ]
    return install, ["DROP TRIGGER refuse_writes ON transcript_items"]


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
