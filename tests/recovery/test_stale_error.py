"""Error state belongs to the attempt that raised it (I8, I17).

A write the database refused early in a run is evidence for that attempt only: once the run
moves on, a later poison in a tool phase must neither blame the old refusal nor drop the turn's
result items (I8: every call gets its result)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

import charlie
from charlie.domain import TaskStatus, execution_id_for
from charlie.runtime import get_runtime
from charlie.store.engine import read
from charlie.store.schema import executions
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.integration.test_refused_writes import refuse_transcript_writes, run_sql
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(240)]


def _execution(xid: str) -> object:
    with read(get_runtime().engine) as conn:
        return conn.execute(
            select(executions.c.error, executions.c.version, executions.c.phase).where(
                executions.c.id == xid
            )
        ).first()


def test_a_refusal_early_on_does_not_poison_a_later_turn(cluster: Cluster, script) -> None:
    task_id = f"stale-{uuid.uuid4().hex[:8]}"
    xid = execution_id_for(task_id)
    # Every tick of the first turn's advance dies inside its transaction: poison there.
    cluster.set_faults(
        {
            "tick.in_transaction": {
                "action": "kill",
                "times": 50,
                "match": {"phase": "advance_turn"},
            }
        }
    )
    install, remove = refuse_transcript_writes(xid)
    run_sql(install)
    try:
        model, _ = script(
            [
                {
                    "say": "write it",
                    "tool_calls": [
                        {"id": "w", "name": "ledger_write", "arguments": {"key": "stale"}}
                    ],
                },
                {"say": "never reached"},
            ]
        )
        charlie.submit("stale error", model=model, task_id=task_id)
        # the first attempt's write is refused, and recorded as its error
        wait_for(lambda: (row := _execution(xid)) is not None and row.error, timeout=30)
    finally:
        run_sql(remove)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.FAILED
    assert info.error["type"] == "PoisonMessage" and info.error["phase"] == "advance_turn"
    # the poison is this phase's own: its workers died; the old refusal is not its cause
    assert "refused by the test trigger" not in info.error["message"], info.error
    assert info.error["last_error"] is None
    # I8: the call that ran has its one result, written by the poison's own transition
    assert_every_call_has_one_result(task_id)
    results = [i for i in charlie.transcript(task_id) if i.kind == "tool_result"]
    assert [r.call_id for r in results] == ["w"]
